"""Shared fixtures: tiny models built once per test session (both architectures)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from graft.models.tiny import build_tiny_model  # noqa: E402

ARCHS = ("qwen2", "llama")


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, object]:
    """arch -> directory of a tiny fp32 model (hidden 64, 2 layers, seed 0)."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_model(root / arch, arch=arch, hidden=64, layers=2, seed=0) for arch in ARCHS}


@pytest.fixture
def input_ids() -> torch.Tensor:
    return torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(0))
