"""Policy-gradient losses: PPO-clip (symmetric, asymmetric, dual-clip) on a token or sequence ratio,
a KL penalty by estimator, importance weights, GRPO.

The per-token log-probs and entropies they take come from ``graft.rl.logprobs``; the aggregations
live in ``graft.rl.aggregations``, the KL estimators in ``graft.rl.kl``, the ratio levels and
mismatch corrections in ``graft.rl.importance``. Callers build one ``LossInputs`` (the tensors and
the ``LossOptions``) and hand it to ``grpo_loss``.

Shape suffixes: see graft/__init__.py. Every ``_BT`` function also works on packed ``[1, N]`` rows.
``mask_BT`` is True at the tokens that count (completion tokens); masked positions are selected out
with ``torch.where``, so whatever sits at padding (even inf or NaN) cannot change the loss.
"""

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from graft.rl.aggregations import get_aggregation, token_mean
from graft.rl.importance import get_ratio_level
from graft.rl.kl import get_kl_estimator


@dataclass(frozen=True)
class LossOptions:
    """The objective's settings; the defaults are ``TrainConfig``'s, plain GRPO.

    ``clip_eps``: the PPO clip range; ``clip_eps_low``/``clip_eps_high`` set its sides apart,
    ``[1 - low, 1 + high]`` (None = ``clip_eps``; DAPO's clip-higher raises ``high``). ``dual_clip_c``:
    for negative advantages the loss is capped at ``-c * A`` (dual-clip PPO), None = off.
    ``ratio_level``: a name in ``RATIO_LEVELS``. ``kl_coef``: the weight of the KL term of the loss.
    ``kl_estimator``: a name in ``KL_ESTIMATORS``; ``kl_bias_correction`` multiplies the KL term by
    the ratio to the old policy (the samples come from the old policy, not the current one).
    ``entropy_coef``: the weight of the entropy bonus. ``agg``: a name in ``AGGREGATIONS``;
    ``norm_tokens``: the constant length of ``seq-mean-token-sum-norm``.
    """

    clip_eps: float = 0.2
    clip_eps_low: float | None = None
    clip_eps_high: float | None = None
    dual_clip_c: float | None = None
    ratio_level: str = "token"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_bias_correction: bool = False
    entropy_coef: float = 0.0
    agg: str = "token-mean"
    norm_tokens: int | None = None

    @classmethod
    def from_config(cls, train: Any) -> "LossOptions":
        """The options a ``TrainConfig`` selects (duck-typed: ``graft.rl`` stays below the config). With
        ``train.kl_in: reward`` the KL acts through the rewards, so the loss has no KL term."""
        return cls(clip_eps=train.clip_eps, clip_eps_low=train.clip_eps_low, clip_eps_high=train.clip_eps_high,
                   dual_clip_c=train.dual_clip_c, ratio_level=train.ratio_level,
                   kl_coef=train.kl_coef if train.kl_in == "loss" else 0.0, kl_estimator=train.kl_estimator,
                   kl_bias_correction=train.kl_bias_correction, entropy_coef=train.entropy_coef,
                   agg=train.loss_agg, norm_tokens=train.loss_norm_tokens)


@dataclass(frozen=True)
class LossInputs:
    """Everything ``grpo_loss`` reads: one (micro-)batch's per-token tensors and the options.

    Attributes:
        logprobs_BT: The current policy's log-probs of the sampled tokens (the gradient flows here).
        old_logprobs_BT: The old policy's (the one that started the update): the ratio's denominator.
        advantages_B: One advantage per row.
        mask_BT: True at the tokens the loss counts.
        ref_logprobs_BT: The reference's, for the KL term and its metric; None = no KL.
        entropy_BT: Token entropies, for the bonus and its metric; None = neither.
        tis_weights_BT: Importance weights of the engine's samples (``mismatch_weights``); None = 1.
        divisor: The aggregation's divisor for the whole batch when this is part of it
            (``Aggregation.divisor``); None = this batch is the whole.
        options: The objective's settings.
    """

    logprobs_BT: Tensor
    old_logprobs_BT: Tensor
    advantages_B: Tensor
    mask_BT: Tensor
    ref_logprobs_BT: Tensor | None = None
    entropy_BT: Tensor | None = None
    tis_weights_BT: Tensor | None = None
    divisor: float | None = None
    options: LossOptions = LossOptions()


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


def grpo_loss(inputs: LossInputs) -> tuple[Tensor, dict[str, float]]:
    """GRPO loss: ``agg_t[w_t * ppo_t + kl_coef * c_t * kl_t - entropy_coef * H_t]``.

    ``ppo_t = -min(r_t A, clip(r_t, 1-eps, 1+eps) A)`` is the per-token PPO-clip loss with
    ``r_t = exp(logp_t - old_t)`` (at ``r = 1`` its gradient is ``-A * grad(logp)``, aggregated like
    the loss; the options pick the sequence ratio, asymmetric or dual clipping), ``w_t`` the
    importance weight of the engine's samples (1 when ``tis_weights_BT`` is None), ``kl_t`` the
    KL estimate to the reference (k3 by default), ``c_t`` 1 or, with ``kl_bias_correction``, ``r_t``,
    and ``H_t`` the token entropy. A term with coefficient 0 and no tensor is left out entirely;
    with ``kl_coef=0``, no entropy and no weights it is plain PPO-clip.

    Returns:
        ``(loss, stats)``; stats are float token-means over the mask: ``pg_loss``, ``kl``,
        ``entropy`` (0.0 when not given), ``clip_fraction``, ``ratio_mean``.

    Raises:
        ValueError: If the aggregation, the ratio level or the KL estimator is not registered, or a
            nonzero ``kl_coef``/``entropy_coef`` comes without ``ref_logprobs_BT``/``entropy_BT``.
    """
    # Defaults (TrainConfig's, = LossOptions()): clip_eps 0.2 both sides, token-level ratio, no dual
    # clip; kl_coef 0 (no reference forward pass; when on: the k3 estimator, in the loss, no bias
    # correction); entropy_coef 0; loss_agg token-mean; tis_cap null (no importance weights). The
    # advantages arrive made: each reward less its group's mean, over the group's population std
    # (normalize_adv_std true, adv_std population, adv_baseline mean).
    options, mask_BT = inputs.options, inputs.mask_BT
    ref_BT, entropy_BT = inputs.ref_logprobs_BT, inputs.entropy_BT
    aggregate = get_aggregation(options.agg)
    log_ratio = get_ratio_level(options.ratio_level)
    kl_estimate = get_kl_estimator(options.kl_estimator)
    if options.kl_coef and ref_BT is None:
        raise ValueError(f"kl_coef={options.kl_coef} needs ref_logprobs_BT")
    if options.entropy_coef and entropy_BT is None:
        raise ValueError(f"entropy_coef={options.entropy_coef} needs entropy_BT")

    ratio_BT = torch.exp(log_ratio(inputs.logprobs_BT, inputs.old_logprobs_BT, mask_BT))
    eps_low = options.clip_eps if options.clip_eps_low is None else options.clip_eps_low
    eps_high = options.clip_eps if options.clip_eps_high is None else options.clip_eps_high
    pg_BT, clipped_BT = _ppo_clip_terms(ratio_BT, inputs.advantages_B, eps_low, eps_high, options.dual_clip_c)
    if inputs.tis_weights_BT is not None:
        pg_BT = pg_BT * inputs.tis_weights_BT
    loss_BT = pg_BT
    kl_BT = kl_estimate(inputs.logprobs_BT, ref_BT) if ref_BT is not None else None
    if kl_BT is not None and options.kl_coef:
        loss_BT = loss_BT + options.kl_coef * (kl_BT * ratio_BT if options.kl_bias_correction else kl_BT)
    if entropy_BT is not None and options.entropy_coef:
        loss_BT = loss_BT - options.entropy_coef * entropy_BT

    with torch.no_grad():
        stats = {
            "pg_loss": token_mean(pg_BT, mask_BT).item(),
            "kl": token_mean(kl_BT, mask_BT).item() if kl_BT is not None else 0.0,
            "entropy": token_mean(entropy_BT, mask_BT).item() if entropy_BT is not None else 0.0,
            "clip_fraction": token_mean(clipped_BT.float(), mask_BT).item(),
            "ratio_mean": token_mean(ratio_BT, mask_BT).item(),
        }
    return aggregate.reduce(loss_BT, mask_BT, inputs.divisor, options.norm_tokens), stats
