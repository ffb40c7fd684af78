"""Rank 0's rollout batch on every rank: the one collective that knows the trainer's batch type, so
graft.parallel (below the trainer) knows none. The batch travels as flat tensors, never pickled.
"""

from __future__ import annotations

import torch

from graft.parallel.dist import Dist, broadcast_tensor
from graft.train.rollout_batch import RolloutBatch


def broadcast_batch(batch: RolloutBatch | None, ctx: Dist) -> RolloutBatch:
    """Rank 0's batch on every rank (as flat tensors: lengths, token ids, log-probs, rewards, truncation,
    and the loss masks of multi-turn episodes)."""
    if not ctx.active:
        assert batch is not None
        return batch
    if ctx.is_main:
        assert batch is not None
        lengths = [n for prompt, completion in batch.sequences for n in (len(prompt), len(completion))]
        flags = (batch.loss_masks is not None) + 2 * batch.mask_truncated
        header = torch.tensor([len(batch.sequences), *batch.rewards_PG.shape, batch.version, sum(lengths), flags],
                              dtype=torch.long)
    else:
        header = torch.zeros(6, dtype=torch.long)
    header = broadcast_tensor(header)
    n_seq, n_prompts, group, version, n_tokens, flags = header.tolist()
    if ctx.is_main:
        lengths_t = torch.tensor(lengths, dtype=torch.long)
        ids_t = torch.tensor([t for p, c in batch.sequences for t in (*p, *c)], dtype=torch.long)
        logprobs_t = torch.tensor([x for lp in batch.engine_logprobs for x in lp], dtype=torch.float64)
        rewards_t = batch.rewards_PG.to(torch.float32).contiguous()
        truncated_t = torch.tensor(batch.truncated or [False] * n_seq, dtype=torch.long)
    else:
        lengths_t = torch.zeros(2 * n_seq, dtype=torch.long)
        ids_t = torch.zeros(n_tokens, dtype=torch.long)
        rewards_t = torch.zeros(n_prompts, group, dtype=torch.float32)
        truncated_t = torch.zeros(n_seq, dtype=torch.long)
    lengths_t, ids_t, rewards_t, truncated_t = (broadcast_tensor(t) for t in (lengths_t, ids_t, rewards_t, truncated_t))
    n_completion = int(lengths_t[1::2].sum())
    if not ctx.is_main:
        logprobs_t = torch.zeros(n_completion, dtype=torch.float64)
    logprobs_t = broadcast_tensor(logprobs_t)
    if flags & 1:
        masks_t = broadcast_tensor(torch.tensor([m for mask in batch.loss_masks for m in mask], dtype=torch.long)
                             if ctx.is_main else torch.zeros(n_completion, dtype=torch.long))
    if ctx.is_main:
        return batch
    sequences, logprobs, at, at_lp = [], [], 0, 0
    for p_len, c_len in lengths_t.view(-1, 2).tolist():
        sequences.append((ids_t[at:at + p_len].tolist(), ids_t[at + p_len:at + p_len + c_len].tolist()))
        logprobs.append(logprobs_t[at_lp:at_lp + c_len].tolist())
        at, at_lp = at + p_len + c_len, at_lp + c_len
    masks = None
    if flags & 1:
        flat, masks = [bool(m) for m in masks_t.tolist()], []
        for _, completion in sequences:
            masks.append(flat[:len(completion)])
            flat = flat[len(completion):]
    return RolloutBatch(sequences, logprobs, rewards_t, version, seconds=0.0,
                        truncated=tuple(bool(t) for t in truncated_t.tolist()), loss_masks=masks,
                        mask_truncated=bool(flags & 2))
