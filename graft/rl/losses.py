"""Policy-gradient losses: PPO-clip, k3 KL, truncated importance weights, GRPO.

The per-token log-probs and entropies they take come from ``graft.rl.logprobs``.

Shape suffixes: ``_B`` batch rows (sequences), ``_T`` tokens. Every ``_BT`` function also works on
packed ``[1, N]`` rows. ``mask_BT`` is True at the tokens that count (completion tokens); masked
positions are selected out with ``torch.where``, so whatever sits at padding (even inf or NaN)
cannot change the loss.
"""

from collections.abc import Callable

import torch
from torch import Tensor

Aggregation = Callable[[Tensor, Tensor, float | None], Tensor]


def _token_mean(values_BT: Tensor, mask_BT: Tensor, divisor: float | None = None) -> Tensor:
    """Mean over all valid tokens of the batch: long sequences weigh more."""
    count = mask_BT.sum().clamp(min=1) if divisor is None else divisor
    return torch.where(mask_BT, values_BT, 0.0).sum() / count


def _seq_mean_token_mean(values_BT: Tensor, mask_BT: Tensor, divisor: float | None = None) -> Tensor:
    """Mean over the valid tokens of each sequence, then over the sequences (all B rows)."""
    per_seq_B = torch.where(mask_BT, values_BT, 0.0).sum(dim=-1) / mask_BT.sum(dim=-1).clamp(min=1)
    return per_seq_B.sum() / (per_seq_B.numel() if divisor is None else divisor)


def _count_tokens(lengths: list[int]) -> float:
    return float(max(1, sum(lengths)))


def _count_sequences(lengths: list[int]) -> float:
    return float(max(1, len(lengths)))


# Loss aggregations by name: (values_BT, mask_BT, divisor) -> scalar. ``divisor`` None divides by what
# this batch holds; a split batch (ranks, micro-batches) passes the whole batch's divisor
# (``AGGREGATION_DIVISORS[name](completion_lengths)``), so the parts' losses and gradients add up to
# exactly those of the whole.
AGGREGATIONS: dict[str, Aggregation] = {
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
}
AGGREGATION_DIVISORS: dict[str, Callable[[list[int]], float]] = {
    "token-mean": _count_tokens,
    "seq-mean-token-mean": _count_sequences,
}


def get_aggregation(name: str) -> Aggregation:
    """Looks up ``AGGREGATIONS[name]``.

    Raises:
        ValueError: If ``name`` is not registered; the message lists the registered names.
    """
    try:
        return AGGREGATIONS[name]
    except KeyError:
        raise ValueError(f"unknown loss aggregation {name!r}; registered: {sorted(AGGREGATIONS)}") from None


def _ppo_clip_terms(
    logprobs_BT: Tensor, old_logprobs_BT: Tensor, advantages_B: Tensor, clip_eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token PPO-clip loss ``-min(r A, clip(r, 1-eps, 1+eps) A)`` with ``r = exp(new - old)``.

    Returns ``(loss_BT, ratio_BT, clipped_BT)``; ``clipped_BT`` is True where the clipped term is the
    active one and has zero gradient (``A > 0, r > 1+eps`` or ``A < 0, r < 1-eps``).
    """
    adv_B1 = advantages_B.unsqueeze(-1)
    ratio_BT = torch.exp(logprobs_BT - old_logprobs_BT.detach())
    unclipped_BT = ratio_BT * adv_B1
    clipped_obj_BT = ratio_BT.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv_B1
    loss_BT = -torch.minimum(unclipped_BT, clipped_obj_BT)
    with torch.no_grad():
        clipped_BT = ((adv_B1 > 0) & (ratio_BT > 1.0 + clip_eps)) | ((adv_B1 < 0) & (ratio_BT < 1.0 - clip_eps))
    return loss_BT, ratio_BT, clipped_BT


def kl_k3(logprobs_BT: Tensor, ref_logprobs_BT: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(policy || ref): ``exp(d) - d - 1`` with ``d = ref - new``.

    Unbiased under samples from the policy, and ``>= 0`` token by token. Written as
    ``expm1(d) - d``: ``expm1`` keeps precision near ``d = 0`` and, faithfully rounded, never falls
    below ``d``, so the result is never a tiny negative number.
    """
    d_BT = ref_logprobs_BT - logprobs_BT
    return torch.expm1(d_BT) - d_BT


def truncated_importance_weights(trainer_logprobs_BT: Tensor, engine_logprobs_BT: Tensor, cap: float) -> Tensor:
    """Truncated importance sampling (TIS): ``min(exp(trainer - engine), cap)``, detached.

    Corrects for the inference engine sampling from a slightly different distribution than the
    trainer computes (kernels, precision, a stale adapter): the weight multiplies the per-token
    policy loss; the cap bounds the variance.

    Raises:
        ValueError: If ``cap`` is not positive.
    """
    if cap <= 0:
        raise ValueError(f"cap must be positive, got {cap}")
    return torch.exp(trainer_logprobs_BT.detach() - engine_logprobs_BT.detach()).clamp(max=cap)


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
) -> tuple[Tensor, dict[str, float]]:
    """GRPO loss: ``agg_t[w_t * ppo_t + kl_coef * k3_t - entropy_coef * H_t]``.

    ``ppo_t = -min(r_t A, clip(r_t, 1-eps, 1+eps) A)`` is the per-token PPO-clip loss with
    ``r_t = exp(logp_t - old_t)`` (at ``r = 1`` its gradient is ``-A * grad(logp)``, aggregated like
    the loss), ``w_t`` the truncated importance weight (1 when ``tis_weights_BT`` is None),
    ``k3_t = kl_k3(logprobs, ref)`` and ``H_t`` the token entropy. A term with coefficient 0 and no
    tensor is left out entirely; with ``kl_coef=0``, no entropy and no weights it is plain PPO-clip.
    ``divisor``: the aggregation's divisor for the whole batch when this is part of it (see
    ``AGGREGATIONS``); None = this batch is the whole.

    Returns:
        ``(loss, stats)``; stats are float token-means over the mask: ``pg_loss``, ``kl``,
        ``entropy`` (0.0 when not given), ``clip_fraction``, ``ratio_mean``.

    Raises:
        ValueError: If ``agg`` is not registered, or a nonzero ``kl_coef``/``entropy_coef`` comes
            without ``ref_logprobs_BT``/``entropy_BT``.
    """
    aggregate = get_aggregation(agg)
    if kl_coef and ref_logprobs_BT is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs_BT")
    if entropy_coef and entropy_BT is None:
        raise ValueError(f"entropy_coef={entropy_coef} needs entropy_BT")

    pg_BT, ratio_BT, clipped_BT = _ppo_clip_terms(logprobs_BT, old_logprobs_BT, advantages_B, clip_eps)
    if tis_weights_BT is not None:
        pg_BT = pg_BT * tis_weights_BT
    loss_BT = pg_BT
    kl_BT = kl_k3(logprobs_BT, ref_logprobs_BT) if ref_logprobs_BT is not None else None
    if kl_BT is not None and kl_coef:
        loss_BT = loss_BT + kl_coef * kl_BT
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
    return aggregate(loss_BT, mask_BT, divisor), stats
