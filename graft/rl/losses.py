"""Policy-gradient losses: PPO-clip (symmetric, asymmetric, dual-clip) on a token or sequence ratio,
a KL penalty by estimator, importance weights, GRPO.

The per-token log-probs and entropies they take come from ``graft.rl.logprobs``; the aggregations
live in ``graft.rl.aggregations``, the KL estimators in ``graft.rl.kl``, the ratio levels and
mismatch corrections in ``graft.rl.importance``.

Shape suffixes: ``_B`` batch rows (sequences), ``_T`` tokens. Every ``_BT`` function also works on
packed ``[1, N]`` rows. ``mask_BT`` is True at the tokens that count (completion tokens); masked
positions are selected out with ``torch.where``, so whatever sits at padding (even inf or NaN)
cannot change the loss.
"""

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from graft.rl.aggregations import AGGREGATION_DIVISORS, AGGREGATIONS, _token_mean, get_aggregation
from graft.rl.importance import get_ratio_level, truncated_importance_weights
from graft.rl.kl import get_kl_estimator, kl_k3

__all__ = ["AGGREGATIONS", "AGGREGATION_DIVISORS", "LossOptions", "get_aggregation", "grpo_loss", "kl_k3",
           "truncated_importance_weights"]


@dataclass(frozen=True)
class LossOptions:
    """The objective's variants beyond ``grpo_loss``'s arguments; the defaults are plain GRPO.

    ``clip_eps_low``/``clip_eps_high``: the clip range ``[1 - low, 1 + high]`` (None = ``clip_eps``;
    DAPO's clip-higher raises ``high``). ``dual_clip_c``: for negative advantages the loss is capped at
    ``-c * A`` (dual-clip PPO), None = off. ``ratio_level``: a name in ``RATIO_LEVELS``.
    ``kl_estimator``: a name in ``KL_ESTIMATORS``; ``kl_bias_correction`` multiplies the KL term by
    the ratio to the old policy (the samples come from the old policy, not the current one).
    ``norm_tokens``: the constant length of ``seq-mean-token-sum-norm``.
    """

    clip_eps_low: float | None = None
    clip_eps_high: float | None = None
    dual_clip_c: float | None = None
    ratio_level: str = "token"
    kl_estimator: str = "k3"
    kl_bias_correction: bool = False
    norm_tokens: int | None = None

    @classmethod
    def from_config(cls, train: Any) -> "LossOptions":
        """The options a ``TrainConfig`` selects (duck-typed: ``graft.rl`` stays below the config)."""
        return cls(clip_eps_low=train.clip_eps_low, clip_eps_high=train.clip_eps_high, dual_clip_c=train.dual_clip_c,
                   ratio_level=train.ratio_level, kl_estimator=train.kl_estimator,
                   kl_bias_correction=train.kl_bias_correction, norm_tokens=train.loss_norm_tokens)


def _ppo_clip_terms(ratio_BT: Tensor, advantages_B: Tensor, eps_low: float, eps_high: float,
                    dual_clip_c: float | None) -> tuple[Tensor, Tensor]:
    """Per-token PPO-clip loss ``-min(r A, clip(r, 1-low, 1+high) A)``, for ``A < 0`` capped at ``-c A``.

    Returns ``(loss_BT, clipped_BT)``; ``clipped_BT`` is True where a clipped term is the active one
    and has zero gradient (``A > 0, r > 1+high``; ``A < 0, r < 1-low``; with dual-clip ``A < 0, r > c``).
    """
    adv_B1 = advantages_B.unsqueeze(-1)
    unclipped_BT = ratio_BT * adv_B1
    clipped_obj_BT = ratio_BT.clamp(1.0 - eps_low, 1.0 + eps_high) * adv_B1
    loss_BT = -torch.minimum(unclipped_BT, clipped_obj_BT)
    if dual_clip_c is not None:
        loss_BT = torch.where(adv_B1 < 0, torch.minimum(loss_BT, -dual_clip_c * adv_B1), loss_BT)
    with torch.no_grad():
        clipped_BT = ((adv_B1 > 0) & (ratio_BT > 1.0 + eps_high)) | ((adv_B1 < 0) & (ratio_BT < 1.0 - eps_low))
        if dual_clip_c is not None:
            clipped_BT = clipped_BT | ((adv_B1 < 0) & (ratio_BT > dual_clip_c))
    return loss_BT, clipped_BT


def grpo_loss(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    ref_logprobs_BT: Tensor | None,
    advantages_B: Tensor,
    mask_BT: Tensor,
    *,
    clip_eps: float,
    kl_coef: float,
    entropy_BT: Tensor | None,
    entropy_coef: float,
    agg: str,
    tis_weights_BT: Tensor | None,
    divisor: float | None = None,
    options: LossOptions = LossOptions(),
) -> tuple[Tensor, dict[str, float]]:
    """GRPO loss: ``agg_t[w_t * ppo_t + kl_coef * c_t * kl_t - entropy_coef * H_t]``.

    ``ppo_t = -min(r_t A, clip(r_t, 1-eps, 1+eps) A)`` is the per-token PPO-clip loss with
    ``r_t = exp(logp_t - old_t)`` (at ``r = 1`` its gradient is ``-A * grad(logp)``, aggregated like
    the loss; ``options`` picks the sequence ratio, asymmetric or dual clipping), ``w_t`` the
    importance weight of the engine's samples (1 when ``tis_weights_BT`` is None), ``kl_t`` the
    KL estimate to the reference (k3 by default), ``c_t`` 1 or, with ``kl_bias_correction``, ``r_t``,
    and ``H_t`` the token entropy. A term with coefficient 0 and no tensor is left out entirely;
    with ``kl_coef=0``, no entropy and no weights it is plain PPO-clip. ``divisor``: the aggregation's
    divisor for the whole batch when this is part of it (see ``AGGREGATIONS``); None = this batch
    is the whole.

    Returns:
        ``(loss, stats)``; stats are float token-means over the mask: ``pg_loss``, ``kl``,
        ``entropy`` (0.0 when not given), ``clip_fraction``, ``ratio_mean``.

    Raises:
        ValueError: If ``agg``, the ratio level or the KL estimator is not registered, or a nonzero
            ``kl_coef``/``entropy_coef`` comes without ``ref_logprobs_BT``/``entropy_BT``.
    """
    aggregate = get_aggregation(agg)
    log_ratio = get_ratio_level(options.ratio_level)
    kl_estimate = get_kl_estimator(options.kl_estimator)
    if kl_coef and ref_logprobs_BT is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs_BT")
    if entropy_coef and entropy_BT is None:
        raise ValueError(f"entropy_coef={entropy_coef} needs entropy_BT")

    ratio_BT = torch.exp(log_ratio(logprobs_BT, old_logprobs_BT, mask_BT))
    eps_low = clip_eps if options.clip_eps_low is None else options.clip_eps_low
    eps_high = clip_eps if options.clip_eps_high is None else options.clip_eps_high
    pg_BT, clipped_BT = _ppo_clip_terms(ratio_BT, advantages_B, eps_low, eps_high, options.dual_clip_c)
    if tis_weights_BT is not None:
        pg_BT = pg_BT * tis_weights_BT
    loss_BT = pg_BT
    kl_BT = kl_estimate(logprobs_BT, ref_logprobs_BT) if ref_logprobs_BT is not None else None
    if kl_BT is not None and kl_coef:
        loss_BT = loss_BT + kl_coef * (kl_BT * ratio_BT if options.kl_bias_correction else kl_BT)
    if entropy_BT is not None and entropy_coef:
        loss_BT = loss_BT - entropy_coef * entropy_BT

    with torch.no_grad():
        stats = {
            "pg_loss": _token_mean(pg_BT, mask_BT).item(),
            "kl": _token_mean(kl_BT, mask_BT).item() if kl_BT is not None else 0.0,
            "entropy": _token_mean(entropy_BT, mask_BT).item() if entropy_BT is not None else 0.0,
            "clip_fraction": _token_mean(clipped_BT.float(), mask_BT).item(),
            "ratio_mean": _token_mean(ratio_BT, mask_BT).item(),
        }
    return aggregate(loss_BT, mask_BT, divisor, options.norm_tokens), stats
