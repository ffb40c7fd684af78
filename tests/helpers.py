"""Test helpers shared across the suite (plain functions; fixtures live in conftest.py)."""

import torch

from graft.lora.attach import attach_lora, lora_parameters
from graft.models.loading import load_model


def randomize_lora(model: torch.nn.Module, seed: int = 1, std: float = 0.05) -> None:
    """Give the adapter non-zero weights (PEFT initialises lora_B to zero, a trivial adapter)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in lora_parameters(model).values():
            param.copy_(torch.randn(param.shape, generator=generator) * std)


def trained_like_peft_model(model_dir, *, rank: int = 8, alpha: float = 16, seed: int = 1, **kwargs):
    """A fp32 tiny model with a random non-zero LoRA adapter attached."""
    model = attach_lora(load_model(model_dir), rank=rank, alpha=alpha, seed=0, **kwargs)
    randomize_lora(model, seed)
    return model
