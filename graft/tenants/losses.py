"""The per-datum losses a tenant's `forward_backward` names, registered by name: the Tinker API's
built-in losses, as its SDK documents them (`cross_entropy`, `importance_sampling`, `ppo`).

Each takes one datum's log-probs at its scored positions (`logprobs_C`: log p(target) under the
tenant's adapter now, with gradients) and the datum's per-position inputs, and returns the datum's
loss as a sum over positions: the caller's weights and advantages carry any normalisation, so a
tenant's loss does not depend on which other datums share its batch.

Shape suffixes: see graft/__init__.py (C: a datum's scored positions).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

PPO_CLIP = 0.2  # the clip range of `ppo` when the datum gives none (Tinker's default)


def cross_entropy(logprobs_C: Tensor, inputs: Mapping[str, Tensor]) -> Tensor:
    """-sum(weights * log p(target)): supervised learning (`weights` 0 on prompt positions)."""
    return -(inputs["weights"] * logprobs_C).sum()


def importance_sampling(logprobs_C: Tensor, inputs: Mapping[str, Tensor]) -> Tensor:
    """-sum(p / q * advantage), q the sampler's probability (`logprobs`): the policy gradient for
    samples drawn by another policy (a server's), unclipped."""
    return -(torch.exp(logprobs_C - inputs["logprobs"]) * inputs["advantages"]).sum()


def ppo(logprobs_C: Tensor, inputs: Mapping[str, Tensor]) -> Tensor:
    """-sum(min(r * A, clip(r, 1 - e, 1 + e) * A)), r = p / q: PPO's clipped surrogate."""
    ratio_C = torch.exp(logprobs_C - inputs["logprobs"])
    advantages_C = inputs["advantages"]
    clipped_C = torch.clamp(ratio_C, 1 - PPO_CLIP, 1 + PPO_CLIP)
    return -torch.minimum(ratio_C * advantages_C, clipped_C * advantages_C).sum()


# name -> (loss, the per-position inputs it needs)
LOSSES: dict[str, tuple[Callable[[Tensor, Mapping[str, Tensor]], Tensor], tuple[str, ...]]] = {
    "cross_entropy": (cross_entropy, ("weights",)),
    "importance_sampling": (importance_sampling, ("logprobs", "advantages")),
    "ppo": (ppo, ("logprobs", "advantages")),
}
