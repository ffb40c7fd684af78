"""The per-datum losses a tenant's `forward_backward` names, registered by name: the Tinker API's
built-in losses (`cross_entropy`, `importance_sampling`, `ppo`, `cispo`, `dro`) and their
`loss_fn_config` keys, with the semantics the Tinker documentation gives them.

Where they are defined. The `tinker` SDK (0.38.0) ships no implementation of any of them (the server
computes them): `tinker/types/loss_fn_type.py` names them in `LossFnType` (with `gspo`,
`stable_reinforce` and `custom`, which graft does not serve), `ForwardBackwardInput.loss_fn_config`
(`tinker/types/forward_backward_input.py`) is `Mapping[str, float | str]`, "e.g., PPO clip
thresholds", and `tinker/proto/request_conv.py` sends a number as both `loss_fn_config[k]` and
`loss_fn_config_v2[k].number`, a string as `loss_fn_config_v2[k].text`. The formulas, their torch
"implemented as" code and the config keys are the Tinker docs' loss pages (tinker-docs.thinkingmachines.ai
/tinker/losses/{ppo,cispo,dro}, and `docs/losses.mdx` of thinking-machines-lab/tinker-cookbook);
the defaults: `ppo` 0.8 and 1.2 (its epsilons "fixed to 0.2"; cookbook `tutorials/202_loss_functions.py`:
"PPO defaults to 0.8 and 1.2"), `cispo` 0.0 and 4.0 (docs' cispo page, "Choosing clipping
thresholds": a one-sided clip by default). The docs give no default for `dro`'s `beta`, only the
example `{"beta": 0.05}`; graft takes that value.

Each loss takes one datum's log-probs at its scored positions (`logprobs_C`: log p(target) under the
tenant's adapter now, with gradients), the datum's per-position inputs, and the loss's whole config
(`loss_config`), and returns the datum's loss as a sum over positions: the caller's weights and
advantages carry any normalisation, so a tenant's loss does not depend on which other datums share
its batch. In the formulas p is the tenant's probability of the target token, q the sampler's
(`logprobs` holds log q), A the `advantages`, r = p / q, sg() stops the gradient.

Shape suffixes: see graft/__init__.py (C: a datum's scored positions).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
from torch import Tensor

CLIP_LOW, CLIP_HIGH = "clip_low_threshold", "clip_high_threshold"


class LossConfigError(ValueError):
    """A `loss_fn_config` the loss does not take: an unknown key, a value that is not a number, or one
    out of range (graft.tenants.policy turns it into its TenantError)."""


def cross_entropy(logprobs_C: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    """-sum(weights * log p): supervised learning (`weights` 0 on prompt positions)."""
    return -(inputs["weights"] * logprobs_C).sum()


def importance_sampling(logprobs_C: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    """-sum(r * A), r = p / q: the policy gradient for samples drawn by another policy (a server's),
    unclipped."""
    return -(torch.exp(logprobs_C - inputs["logprobs"]) * inputs["advantages"]).sum()


def ppo(logprobs_C: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    """-sum(min(r * A, clip(r, low, high) * A)), r = p / q: PPO's clipped surrogate, token-wise, with
    `clip_low_threshold` and `clip_high_threshold` the ratio's bounds themselves (1 - e_low, 1 + e_high)."""
    ratio_C = torch.exp(logprobs_C - inputs["logprobs"])
    advantages_C = inputs["advantages"]
    clipped_C = torch.clamp(ratio_C, config[CLIP_LOW], config[CLIP_HIGH])
    return -torch.minimum(ratio_C * advantages_C, clipped_C * advantages_C).sum()


def cispo(logprobs_C: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    """-sum(sg(clip(r, low, high)) * log p * A), r = p / q: CISPO (MiniMax-M1) clips the ratio and
    weights log p by it, so no token's gradient is zeroed, only its coefficient bounded."""
    ratio_C = torch.exp(logprobs_C - inputs["logprobs"])
    clipped_C = torch.clamp(ratio_C, config[CLIP_LOW], config[CLIP_HIGH]).detach()
    return -(clipped_C * logprobs_C * inputs["advantages"]).sum()


def dro(logprobs_C: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    """-sum(log p * A - beta / 2 * (log p - log q)^2): DRO's objective, a quadratic penalty that keeps
    the policy near the sampler's (its soft advantages are the client's to compute)."""
    penalty_C = (logprobs_C - inputs["logprobs"]) ** 2
    return -(logprobs_C * inputs["advantages"] - 0.5 * config["beta"] * penalty_C).sum()


class Loss(NamedTuple):
    """A registered loss: the function, the per-position inputs it reads, its config keys' defaults."""

    fn: Callable[[Tensor, Mapping[str, Tensor], Mapping[str, float]], Tensor]
    needs: tuple[str, ...]
    defaults: dict[str, float]


_RL = ("logprobs", "advantages")
LOSSES: dict[str, Loss] = {
    "cross_entropy": Loss(cross_entropy, ("weights",), {}),
    "importance_sampling": Loss(importance_sampling, _RL, {}),
    "ppo": Loss(ppo, _RL, {CLIP_LOW: 0.8, CLIP_HIGH: 1.2}),
    "cispo": Loss(cispo, _RL, {CLIP_LOW: 0.0, CLIP_HIGH: 4.0}),
    "dro": Loss(dro, _RL, {"beta": 0.05}),
}


def loss_config(loss: str, config: Mapping[str, float | str] | None = None) -> dict[str, float]:
    """`loss`'s whole config: `config` (a request's `loss_fn_config`) over the loss's defaults.

    Every value must be a finite number >= 0 (an int is taken as a float; a bool or a string is not a
    number), and a clip's low threshold must not exceed its high one.

    Raises:
        LossConfigError: an unknown loss, or one message naming the first unknown key, value that is
            not a number, or value out of range.
    """
    if loss not in LOSSES:
        raise LossConfigError(f"unknown loss {loss!r} (losses: {', '.join(LOSSES)})")
    defaults = LOSSES[loss].defaults
    config = dict(config or {})
    if unknown := sorted(key for key in config if key not in defaults):
        takes = f"takes loss_fn_config keys {sorted(defaults)}" if defaults else "takes no loss_fn_config keys"
        raise LossConfigError(f"loss {loss!r} {takes}, got {unknown}")
    for key, value in config.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise LossConfigError(f"loss_fn_config: {key!r} must be a number, got {value!r}")
        if not math.isfinite(value) or value < 0:
            raise LossConfigError(f"loss_fn_config: {key!r} must be a finite number >= 0, got {value!r}")
    filled = {**defaults, **{key: float(value) for key, value in config.items()}}
    if CLIP_LOW in filled and filled[CLIP_LOW] > filled[CLIP_HIGH]:
        raise LossConfigError(f"loss_fn_config: {CLIP_LOW!r} ({filled[CLIP_LOW]}) must not exceed "
                              f"{CLIP_HIGH!r} ({filled[CLIP_HIGH]})")
    return filled
