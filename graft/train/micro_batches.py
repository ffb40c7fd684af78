"""Where each row of a mini-batch goes (rank, micro-batch) and how a micro-batch is laid out.

A mini-batch's rows are split over ranks by tokens (longest first, to the rank with the fewest
tokens so far: the slowest rank sets the pace of every collective), then into micro-batches of at
most `train.max_tokens_per_micro_batch` tokens. Every rank runs the same number of micro-batches
(FSDP2's collectives line up), padding its plan with zero-weight stand-ins.

A micro-batch is laid out packed (`train.pack_sequences`: sequences back to back in rows as long
as its longest sequence, position ids restarting per sequence, attention kept inside each sequence)
or right-padded (one row per sequence). Rows no longer than the longest sequence keep attention
and its block-diagonal mask (`R x L x L`) within padding's cost: one row of all 8192 tokens
computed 1.5x the layers' CPU time of padding and kept an `[N, N]` float mask per layer for the
backward (docs/benchmarks.md). Either way the scores come back as one row per sequence
(`graft.rl.packing.completion_rows`), so the loss and the log-prob cache never see the layout.

Shape suffixes: see graft/__init__.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from graft.config import TrainConfig
from graft.rl.logprobs import teacher_forced_logprobs
from graft.rl.packing import (
    completion_rows,
    completion_rows_mask,
    first_fit_rows,
    pack_rows,
    pack_shared_prompts,
    pad,
)
from graft.train.memory_budget import MIN_AUTO_TOKENS
from graft.train.rollout_batch import RolloutBatch

Micros = list[tuple[list[int], float]]  # (micro-batch rows, loss weight)
# Tokens of one prompt's shared unit (its prefix and as many of its rows' branches as fit): rows as
# long as the longest unit keep attention's R x L x L within ~1M mask entries per row.
SHARED_UNIT_TOKENS = 1024


def _length(batch: RolloutBatch, row: int) -> int:
    return len(batch.sequences[row][0]) + len(batch.sequences[row][1])


def _fits(lengths: list[int], packed: bool, budget: int) -> bool:
    """Whether the token positions the forward computes — rows x longest, rows packed
    (`first_fit_rows` into rows as long as the longest sequence) or one per sequence (padded) — are
    within `budget`. Packing never needs more rows than padding, so the packed layout is only
    computed when the padded one is over budget (measured: first fit on every candidate took 1.5 of
    a quickstart update's 2.6 CPU-seconds)."""
    longest = max(lengths)
    if longest * len(lengths) <= budget:
        return True
    return packed and longest * len(first_fit_rows(lengths, longest)) <= budget


def micro_batches(rows: list[int], batch: RolloutBatch, train: TrainConfig) -> list[list[int]]:
    """`rows` in consecutive micro-batches: at most `train.micro_batch_size` rows and at most
    `train.max_tokens_per_micro_batch` laid-out tokens each (`_fits`: padding counts, and
    packing needs fewer rows); a row longer than the budget goes alone. Activation memory scales
    with the laid-out tokens of one micro-batch. An unresolved "auto" budget (`memory_budget.auto_sizes`
    resolves it per update) counts as its least, `MIN_AUTO_TOKENS`."""
    budget, size = train.max_tokens_per_micro_batch, train.micro_batch_size
    budget = MIN_AUTO_TOKENS if budget == "auto" else budget
    out: list[list[int]] = []
    lengths: list[int] = []
    for r in rows:
        candidate = [*lengths, _length(batch, r)]
        if out and (size is None or len(out[-1]) < size) and \
                (budget is None or _fits(candidate, train.pack_sequences, budget)):
            out[-1].append(r)
            lengths = candidate
        else:
            out.append([r])
            lengths = candidate[-1:]
    return out


def equalized(rows_by_rank: list[list[int]], stand_in: int, batch: RolloutBatch,
               train: TrainConfig) -> list[Micros]:
    """Each rank's micro-batches of its rows, as many as the rank with the most, so FSDP2's
    collectives (one all-gather per forward, one reduce-scatter per backward) line up: a rank with
    fewer runs stand-in micro-batches of the one row `stand_in`, whose loss counts zero."""
    per_rank = [micro_batches(rows, batch, train) for rows in rows_by_rank]
    count = max(1, *(len(micros) for micros in per_rank))
    return [[(rows, 1.0) for rows in micros] + [([stand_in], 0.0)] * (count - len(micros)) for micros in per_rank]


def _rows_by_rank(mini: list[int], batch: RolloutBatch, world_size: int) -> list[list[int]]:
    """`mini`'s rows split over ranks by tokens: longest first, each to the rank with the fewest
    tokens so far (ties: the lower rank), so ragged lengths do not leave one rank doing most of the
    work while the others wait in the collectives. Each rank keeps its rows in batch order; with
    fewer rows than ranks the last ranks get none (they run stand-ins)."""
    tokens, out = [0] * world_size, [[] for _ in range(world_size)]
    for r in sorted(mini, key=lambda r: (-_length(batch, r), r)):
        rank = min(range(world_size), key=lambda k: (tokens[k], k))
        tokens[rank] += _length(batch, r)
        out[rank].append(r)
    return [sorted(rows) for rows in out]


def plan_by_rank(minis: list[list[int]], batch: RolloutBatch, train: TrainConfig, world_size: int
                 ) -> list[list[Micros]]:
    """Every rank's micro-batches of every mini-batch (`[rank][mini]`), computed once: each rank
    needs the others' micro-batch counts (equalized) and the rows they touch (the log-prob cache)."""
    by_mini = [equalized(_rows_by_rank(mini, batch, world_size), mini[0], batch, train) for mini in minis]
    return [[plans[rank] for plans in by_mini] for rank in range(world_size)]


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch's model inputs on the model's device, packed or padded.

    Attributes:
        rows: Batch rows, in the order of the result rows of `scored` (packed: layout order).
        input_ids_xT: `[B, T]` right-padded or `[R, L]` packed rows.
        attention_mask_xT: 1/0 mask when padded; None when packed (the position ids delimit); a
            boolean `[R, 1, L, L]` mask (True = attend) when prompts are shared.
        position_ids_xT: Restarting per sequence when packed; None when padded (HF's arange).
        completion_mask_xT: True where the next token is a completion token.
        mask_BC: True at each sequence's completion tokens in the `[B, C]` result rows.
        loss_mask_BC: True at the completion tokens the loss counts: `mask_BC` itself, less environment
            and template tokens in multi-turn episodes (`RolloutBatch.loss_masks`).
    """

    rows: list[int]
    input_ids_xT: Tensor
    attention_mask_xT: Tensor | None
    position_ids_xT: Tensor | None
    completion_mask_xT: Tensor
    mask_BC: Tensor
    loss_mask_BC: Tensor

    @property
    def completion_lens(self) -> list[int]:
        return self.mask_BC.sum(dim=1).tolist()


def lay_out(model: nn.Module, batch: RolloutBatch, rows: list[int], pad_id: int, train: TrainConfig) -> MicroBatch:
    """`rows` right-padded, or packed (`train.pack_sequences`) into rows as long as the longest
    sequence (`graft.rl.packing.pack_rows`) — or, with `train.share_prompts` and a prompt that
    several rows share, into rows where each prompt's rows compute it once
    (`graft.rl.packing.pack_shared_prompts`: a 4-D attention mask keeps each completion to its
    prompt and itself; sdpa attention only, else packed as without). Packed, the result's `rows`
    are in layout order. On the model's device."""
    device = next(model.parameters()).device
    sequences = [batch.sequences[r] for r in rows]
    if not train.pack_sequences:
        mask_BC = completion_rows_mask([len(c) for _, c in sequences], device)
        input_ids_BT, attention_mask_BT, mask_BT = (t.to(device) for t in pad(sequences, "right", pad_id))
        return MicroBatch(rows, input_ids_BT, attention_mask_BT, None, mask_BT, mask_BC,
                          _loss_mask(batch, rows, mask_BC))
    attention_mask = None
    if train.share_prompts and _attention(model) == "sdpa" and len({tuple(p) for p, _ in sequences}) < len(sequences):
        p = pack_shared_prompts(sequences, SHARED_UNIT_TOKENS, pad_id)
        attention_mask = p.allowed_RLL[:, None].to(device)  # sdpa's boolean mask: True = attend
    else:
        p = pack_rows(sequences, max(len(q) + len(c) for q, c in sequences), pad_id)
    rows = [rows[i] for i in p.order]
    mask_BC = completion_rows_mask([len(batch.sequences[r][1]) for r in rows], device)
    return MicroBatch(rows, p.input_ids_RL.to(device), attention_mask, p.position_ids_RL.to(device),
                      p.completion_mask_RL.to(device), mask_BC, _loss_mask(batch, rows, mask_BC))


def _attention(model: nn.Module) -> str | None:
    """The model's attention implementation: shared prompts need a custom 4-D mask, which sdpa takes
    as a boolean mask (whatever the compute dtype); eager would add it, flash-attention refuses it."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def _loss_mask(batch: RolloutBatch, rows: list[int], mask_BC: Tensor) -> Tensor:
    """`mask_BC` where every completion token counts (single turn: the same tensor), else True only at
    the model's tokens of each row (`RolloutBatch.loss_masks`)."""
    if batch.loss_masks is None:
        return mask_BC
    flat = torch.tensor([m for r in rows for m in batch.loss_masks[r]], dtype=torch.bool, device=mask_BC.device)
    return torch.zeros_like(mask_BC).masked_scatter(mask_BC, flat)


def completion_logprobs(model: nn.Module, micro: MicroBatch, train: TrainConfig, with_entropy: bool = False
           ) -> tuple[Tensor, Tensor]:
    """`(logprobs_BC, entropy_BC)`: each sequence's completion-token log-probs (and entropies) as
    one row, whatever the layout. The LM head runs only at the positions that predict a completion
    token (padded rows too: the columns are shared, the head skips other rows' positions). With
    gradients and `train.activation_checkpointing: auto`, the layers checkpointed and whether the head
    recomputes its logits are fitted to this micro-batch (`graft.train.memory_budget.ActivationMemory`)."""
    positions_K = micro.completion_mask_xT.any(dim=0).nonzero()[:, 0]
    memory = getattr(model, "graft_activation_memory", None)
    recompute_head = True
    if memory is not None and torch.is_grad_enabled():
        recompute_head = not memory.fit(micro.input_ids_xT.numel(), int(micro.completion_mask_xT.sum()))
    logprobs_xT, entropy_xT = teacher_forced_logprobs(
        model, micro.input_ids_xT, micro.attention_mask_xT, positions_K=positions_K, with_entropy=with_entropy,
        chunk_tokens=train.logit_chunk_tokens, position_ids_BT=micro.position_ids_xT,
        score_mask_BT=micro.completion_mask_xT, recompute_head=recompute_head)
    lens = micro.completion_lens
    return (completion_rows(logprobs_xT, micro.completion_mask_xT, lens),
            completion_rows(entropy_xT, micro.completion_mask_xT, lens))
