"""What is never published: a policy whose weights or outputs are not finite.

A NaN adapter, or a diverged one (lr 1e30 gives finite LoRA tensors whose product overflows in the
engine), poisons a shared vLLM server: after it is unloaded, plain base-model requests kept failing
("Out of range float values are not JSON compliant") until another adapter overwrote its slot, and
the next run there failed at step 0. So before every sync the trainer's copy is checked: every
LoRA tensor finite, and the logits of a fixed probe prompt finite (one forward of 24 tokens). A
refused version is not published; the engines keep serving the last good one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from graft.sync.source import Policy, eval_mode, policy_source
from graft.sync.verify import PROBE_PROMPT

__all__ = ["NonFinitePolicyError", "check_finite_policy", "eval_mode"]


class NonFinitePolicyError(ValueError):
    """The policy about to be published has non-finite weights or outputs."""


def check_finite_policy(policy: Policy, version: int, probe: Sequence[int] = PROBE_PROMPT) -> None:
    """Refuse to publish `policy` as `version` unless its LoRA weights and its probe logits are finite.

    On an FSDP2 run's rank 0 `policy` is the sharded source: the LoRA tensors are the ones gathered
    after the step, and the probe forward is a collective every rank joins.

    Raises:
        NonFinitePolicyError: naming the first non-finite tensor, or the probe's logits.
    """
    source = policy_source(policy)
    for name, tensor in source.lora_tensors().items():
        if not torch.isfinite(tensor).all():
            raise NonFinitePolicyError(f"policy version {version} has NaN or infinite values in {name}: not "
                                       "published, the engines keep serving the last good version (the update "
                                       "diverged: lower train.lr)")
    if not source.probe_logits_finite(probe):
        raise NonFinitePolicyError(f"policy version {version} computes non-finite logits on the probe prompt "
                                   "(its weights are finite but too large): not published, the engines keep "
                                   "serving the last good version (the update diverged: lower train.lr)")
