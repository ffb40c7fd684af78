"""Loss aggregations: how per-token losses become the batch loss, each with its whole-batch divisor.

Shape suffixes: see graft/__init__.py. ``mask_BT`` is True at the tokens that count; masked
positions are selected out with ``torch.where`` (padding may hold inf or NaN).

Every aggregation is ``sum over the batch of per-row terms / divisor``. A batch split over ranks and
micro-batches passes each part the whole batch's divisor (``get_aggregation(name).divisor(lengths)``),
so the parts' losses and gradients add up to exactly those of the whole.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from graft.rl.registry import lookup


@dataclass(frozen=True)
class Aggregation:
    """One registered aggregation: how it reduces and what it divides a whole batch by.

    Attributes:
        reduce: ``(values_BT, mask_BT, divisor=None, norm_tokens=None) -> scalar``, the batch loss;
            ``divisor`` None = this batch is the whole, else the whole batch's divisor.
        divisor: ``(lengths, norm_tokens=None) -> float``, that divisor for a whole batch whose rows
            count ``lengths`` tokens.
    """

    reduce: Callable[..., Tensor]
    divisor: Callable[..., float]


def token_mean(values_BT: Tensor, mask_BT: Tensor, divisor: float | None = None,
               norm_tokens: int | None = None) -> Tensor:
    """Mean over all valid tokens of the batch: long sequences weigh more (DAPO's token-level loss)."""
    count = mask_BT.sum().clamp(min=1) if divisor is None else divisor
    return torch.where(mask_BT, values_BT, 0.0).sum() / count


def _seq_mean_token_mean(values_BT: Tensor, mask_BT: Tensor, divisor: float | None = None,
                         norm_tokens: int | None = None) -> Tensor:
    """Mean over the valid tokens of each sequence, then over the sequences (all B rows)."""
    per_seq_B = torch.where(mask_BT, values_BT, 0.0).sum(dim=-1) / mask_BT.sum(dim=-1).clamp(min=1)
    return per_seq_B.sum() / (per_seq_B.numel() if divisor is None else divisor)


def _seq_mean_token_sum(values_BT: Tensor, mask_BT: Tensor, divisor: float | None = None,
                        norm_tokens: int | None = None) -> Tensor:
    """Sum over the valid tokens of each sequence, mean over the sequences: a sequence's weight grows
    with its length, and the loss scale with the lengths too."""
    per_seq_B = torch.where(mask_BT, values_BT, 0.0).sum(dim=-1)
    return per_seq_B.sum() / (per_seq_B.numel() if divisor is None else divisor)


def _seq_mean_token_sum_norm(values_BT: Tensor, mask_BT: Tensor, divisor: float | None = None,
                             norm_tokens: int | None = None) -> Tensor:
    """Dr. GRPO: token sums over ``B x norm_tokens``, a constant length, so neither a sequence's length
    nor the batch's token count rescales its tokens' gradient. ``norm_tokens`` None = the longest
    sequence of the batch (then the scale is no longer constant across batches)."""
    per_seq_B = torch.where(mask_BT, values_BT, 0.0).sum(dim=-1)
    if divisor is None:
        longest = int(mask_BT.sum(dim=-1).max().item()) if mask_BT.numel() else 1
        divisor = per_seq_B.numel() * max(1, norm_tokens or longest)
    return per_seq_B.sum() / divisor


def _count_tokens(lengths: list[int], norm_tokens: int | None = None) -> float:
    return float(max(1, sum(lengths)))


def _count_sequences(lengths: list[int], norm_tokens: int | None = None) -> float:
    return float(max(1, len(lengths)))


def _count_sequences_times_norm(lengths: list[int], norm_tokens: int | None = None) -> float:
    return float(max(1, len(lengths)) * max(1, norm_tokens or max(lengths, default=1)))


AGGREGATIONS: dict[str, Aggregation] = {
    "token-mean": Aggregation(token_mean, _count_tokens),
    "seq-mean-token-mean": Aggregation(_seq_mean_token_mean, _count_sequences),
    "seq-mean-token-sum": Aggregation(_seq_mean_token_sum, _count_sequences),
    "seq-mean-token-sum-norm": Aggregation(_seq_mean_token_sum_norm, _count_sequences_times_norm),
}


def get_aggregation(name: str) -> Aggregation:
    """Looks up ``AGGREGATIONS[name]``. ValueError if it is not registered."""
    return lookup(AGGREGATIONS, name, "loss aggregation")
