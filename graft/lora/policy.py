"""The policy a run trains: the frozen base model of `model:` with a fresh LoRA adapter from `lora:`.

One function, so the trainer, benchmarks and tests build the same policy from the same config
sections, and a LoRA setting added to `LoraConfig` has one place to be passed on.
"""

from __future__ import annotations

import peft

from graft.config import LoraConfig, ModelConfig
from graft.lora.attach import attach_lora
from graft.models.loading import load_model


def build_policy(model_cfg: ModelConfig, lora_cfg: LoraConfig, seed: int) -> peft.PeftModel:
    """Load the base at `model_cfg.path` in `model_cfg.dtype` and attach a trainable LoRA adapter.

    Args:
        model_cfg: the base model (path, dtype).
        lora_cfg: rank, alpha, dropout, target and exclude modules (`name` is the engines' business).
        seed: seeds the LoRA initialisation, so the same seed gives the same initial adapter.

    Raises:
        ValueError: `model.path` is unset or not a model directory, or a target or exclude module
            does not exist (see `attach_lora`).
    """
    if model_cfg.path is None:
        raise ValueError("model.path is required to build the policy")
    return attach_lora(load_model(model_cfg.path, dtype=model_cfg.dtype), rank=lora_cfg.rank, alpha=lora_cfg.alpha,
                       dropout=lora_cfg.dropout, target_modules=lora_cfg.target_modules,
                       exclude_modules=lora_cfg.exclude_modules, seed=seed)
