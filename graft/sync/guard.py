"""What is never published: a policy whose weights or outputs are not finite.

A NaN adapter, or a diverged one (lr 1e30 gives finite LoRA tensors whose product overflows in the
engine), poisons a shared vLLM server: after it is unloaded, plain base-model requests kept failing
("Out of range float values are not JSON compliant") until another adapter overwrote its slot, and
the next run there failed at step 0. So before every sync the trainer's copy is checked: every
LoRA tensor finite, and the logits of a fixed probe prompt finite (one forward of 24 tokens). A
refused version is not published; the engines keep serving the last good one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from graft.lora.attach import lora_parameters
from graft.sync.verify import PROBE_PROMPT


class NonFinitePolicyError(ValueError):
    """The policy about to be published has non-finite weights or outputs."""


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """`model` in eval mode (no dropout, no RNG drawn) for the body, its own mode again after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def check_finite_policy(policy: nn.Module, version: int, probe: Sequence[int] = PROBE_PROMPT) -> None:
    """Refuse to publish `policy` as `version` unless its LoRA weights and its probe logits are finite.

    Raises:
        NonFinitePolicyError: naming the first non-finite tensor, or the probe's logits.
    """
    for name, param in lora_parameters(policy).items():
        if not torch.isfinite(param.detach()).all():
            raise NonFinitePolicyError(f"policy version {version} has NaN or infinite values in {name}: not "
                                       "published, the engines keep serving the last good version (the update "
                                       "diverged: lower train.lr)")
    device = next(policy.parameters()).device
    with eval_mode(policy), torch.no_grad():
        logits = policy(input_ids=torch.tensor([list(probe)], device=device), use_cache=False).logits
    if not torch.isfinite(logits).all():
        raise NonFinitePolicyError(f"policy version {version} computes non-finite logits on the probe prompt "
                                   "(its weights are finite but too large): not published, the engines keep "
                                   "serving the last good version (the update diverged: lower train.lr)")
