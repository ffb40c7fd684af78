"""Test helpers shared across the suite (plain functions; fixtures live in conftest.py)."""

import subprocess

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


def live_group_members(pgid: int) -> list[str]:
    """`ps` lines of the non-zombie processes in process group `pgid` (independent of the launcher's check)."""
    listing = subprocess.run(["ps", "-e", "-o", "pgid=,pid=,stat=,args="], capture_output=True, text=True, check=True)
    rows = (line.split(None, 3) for line in listing.stdout.splitlines())
    return [" ".join(row) for row in rows if int(row[0]) == pgid and not row[2].startswith("Z")]
