"""Shared fixtures: tiny models built once per test session (both architectures)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from graft.lora.attach import attach_lora, lora_parameters  # noqa: E402
from graft.models.loading import load_model  # noqa: E402
from graft.models.tiny import build_tiny_model  # noqa: E402

ARCHS = ("qwen2", "llama")


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, object]:
    """arch -> directory of a tiny fp32 model (hidden 64, 2 layers, seed 0)."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_model(root / arch, arch=arch, hidden=64, layers=2, seed=0) for arch in ARCHS}


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


@pytest.fixture
def input_ids() -> torch.Tensor:
    return torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(0))
