"""Importance ratios: the policy ratio's level (token or sequence) and the corrections for samples
drawn by an inference engine whose log-probs differ from the trainer's (train/inference mismatch).

Shape suffixes: see graft/__init__.py. ``mask_BT`` is True at completion tokens; padding may hold
anything (inf, NaN) and never reaches a row's statistics.
"""

from collections.abc import Callable

import torch
from torch import Tensor

from graft.rl.registry import lookup

LogRatio = Callable[[Tensor, Tensor, Tensor], Tensor]


def _masked_row_mean(values_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Mean of each row over its valid tokens, ``[B, 1]`` (0 for a row without any)."""
    return torch.where(mask_BT, values_BT, 0.0).sum(-1, keepdim=True) / mask_BT.sum(-1, keepdim=True).clamp(min=1)


def token_log_ratio(logprobs_BT: Tensor, old_logprobs_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """PPO/GRPO: each token's own ``log r_t = logp_t - old_t``."""
    return logprobs_BT - old_logprobs_BT.detach()


def sequence_log_ratio(logprobs_BT: Tensor, old_logprobs_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """GSPO: the length-normalised sequence ratio ``s = exp(mean_t(logp_t - old_t))`` at every token.

    Written as GSPO-token (Zheng et al. 2025, eq. 13): ``log s_t = sg[log s] + logp_t - sg[logp_t]``.
    Its value is ``log s`` at each token and its gradient ``grad logp_t``, so ``d s_t = s * d logp_t``:
    with the same advantage at every token this is GSPO's sequence gradient
    ``s * mean_t grad logp_t`` under ``seq-mean-token-mean``, and every other aggregation and
    per-token weight (mismatch correction) still acts token by token.
    """
    seq_B1 = _masked_row_mean(logprobs_BT.detach() - old_logprobs_BT.detach(), mask_BT)
    return logprobs_BT - logprobs_BT.detach() + seq_B1


RATIO_LEVELS: dict[str, LogRatio] = {"token": token_log_ratio, "sequence": sequence_log_ratio}


def get_ratio_level(name: str) -> LogRatio:
    """Looks up ``RATIO_LEVELS[name]``. ValueError if it is not registered."""
    return lookup(RATIO_LEVELS, name, "ratio level")


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


# Mismatch corrections by name: (level, what happens to a weight above the cap). The sequence
# level's weight is the geometric mean of the row's token ratios, exp(mean_t(trainer - engine)),
# the same at each of its tokens: bounded by the cap like a token's, whatever the length.
MISMATCH_CORRECTIONS: dict[str, tuple[str, str]] = {
    "token-truncate": ("token", "truncate"),
    "token-mask": ("token", "mask"),
    "sequence-truncate": ("sequence", "truncate"),
    "sequence-mask": ("sequence", "mask"),
}


def mismatch_weights(trainer_logprobs_BT: Tensor, engine_logprobs_BT: Tensor, mask_BT: Tensor,
                     mode: str, cap: float | None) -> tuple[Tensor | None, dict[str, float]]:
    """Importance weights of the policy loss for engine samples, and their statistics.

    ``trainer`` is the old policy's log-probs (before the update), ``engine`` the sampler's. Truncate
    modes weigh by ``min(ratio, cap)``; mask modes by ``ratio`` where ``ratio <= cap`` and 0 where it
    exceeds the cap (the token, or the whole sequence, leaves the policy loss). ``cap`` None: no
    correction (weights None), the statistics are still measured.

    Returns:
        ``(weights_BT or None, stats)``; stats are token-means over the mask: ``tis_weight_mean``
        (1.0 without correction), ``tis_capped_fraction`` (share of tokens whose ratio exceeds the
        cap: truncated or masked) and ``mismatch_kl``, the k3 estimate of KL(engine || trainer) on
        the engine's samples (0 when both agree).

    Raises:
        ValueError: If ``mode`` is not registered or ``cap`` is not positive.
    """
    level, action = lookup(MISMATCH_CORRECTIONS, mode, "mismatch correction")
    with torch.no_grad():
        log_w_BT = trainer_logprobs_BT.detach() - engine_logprobs_BT.detach()
        count = mask_BT.sum().clamp(min=1)
        stats = {"mismatch_kl": (torch.where(mask_BT, torch.expm1(log_w_BT) - log_w_BT, 0.0).sum() / count).item()}
        if cap is None:
            return None, {**stats, "tis_weight_mean": 1.0, "tis_capped_fraction": 0.0}
        if level == "token" and action == "truncate":
            weights_BT = truncated_importance_weights(trainer_logprobs_BT, engine_logprobs_BT, cap)
            ratio_BT = torch.exp(log_w_BT)
        else:
            if cap <= 0:
                raise ValueError(f"cap must be positive, got {cap}")
            if level == "sequence":
                log_w_BT = _masked_row_mean(log_w_BT, mask_BT).expand_as(log_w_BT)
            ratio_BT = torch.exp(log_w_BT)
            weights_BT = ratio_BT.clamp(max=cap) if action == "truncate" else ratio_BT.masked_fill(ratio_BT > cap, 0.0)
        stats["tis_weight_mean"] = (torch.where(mask_BT, weights_BT, 0.0).sum() / count).item()
        stats["tis_capped_fraction"] = ((mask_BT & (ratio_BT > cap)).sum() / count).item()
    return weights_BT, stats
