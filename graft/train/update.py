"""The GRPO policy update of the LoRA adapter from one rollout batch.

`train.epochs` passes over the batch, each split into `train.mini_batches` mini-batches of whole
prompt groups, one optimizer step per mini-batch (PPO-style: the ratio to the policy that started
the update is clipped). A mini-batch may be split further over ranks (FSDP2) and micro-batches:
every part's loss is divided by the whole mini-batch's divisor (`AGGREGATION_DIVISORS`), so
gradients summed over parts and ranks equal those of the whole mini-batch on one process, and the
reported metrics are whole-batch values.

Shape suffixes: `_B` sequences of a micro-batch, `_T` padded token positions, `_P`/`_G` prompts/group.
"""

from __future__ import annotations

import math
import time

import torch
from torch import nn

from graft.config import TrainConfig
from graft.lora.attach import adapter_disabled, lora_parameters
from graft.rl.advantages import group_advantages
from graft.rl.importance import mismatch_weights
from graft.rl.logprobs import teacher_forced_logprobs
from graft.rl.losses import AGGREGATION_DIVISORS, LossOptions, grpo_loss
from graft.rl.packing import pad
from graft.train.distributed import Dist, full_tensor
from graft.train.rollout_batch import RolloutBatch


class NonFiniteUpdateError(ValueError):
    """An optimizer step's gradient norm is NaN or infinite (`train.on_nonfinite: error`)."""


# Token-weighted statistics, summed over micro-batches and ranks, then divided by the token count.
_TOKEN_STATS = ("kl", "entropy", "clip_fraction", "ratio_mean", "tis_weight_mean", "tis_capped_fraction",
                "mismatch_kl")


def _padded_on_device(model: nn.Module, batch: RolloutBatch, rows: list[int], pad_id: int):
    """Right-padded `(input_ids_BT, attention_mask_BT, completion_mask_BT)` on the model's device."""
    device = next(model.parameters()).device
    return tuple(t.to(device) for t in pad([batch.sequences[r] for r in rows], "right", pad_id))


def _scored(model: nn.Module, input_ids_BT, attention_mask_BT, mask_BT, train: TrainConfig,
            with_entropy: bool = False):
    """Log-probs (and entropy) at the positions that predict a completion token of any row; the LM
    head never runs over prompt positions before the first completion token."""
    positions_K = mask_BT.any(dim=0).nonzero()[:, 0]
    return teacher_forced_logprobs(model, input_ids_BT, attention_mask_BT, positions_K=positions_K,
                                   with_entropy=with_entropy, chunk_tokens=train.logit_chunk_tokens)


def _micro_batches(rows: list[int], batch: RolloutBatch, train: TrainConfig) -> list[list[int]]:
    """`rows` in consecutive micro-batches: at most `train.micro_batch_size` rows and at most
    `train.max_tokens_per_micro_batch` padded tokens (rows x longest sequence) each; a row longer
    than the budget goes alone. Activation memory scales with the padded tokens of one micro-batch."""
    budget, size = train.max_tokens_per_micro_batch, train.micro_batch_size
    out: list[list[int]] = []
    longest = 0
    for r in rows:
        length = len(batch.sequences[r][0]) + len(batch.sequences[r][1])
        if out and (size is None or len(out[-1]) < size) and \
                (budget is None or (len(out[-1]) + 1) * max(longest, length) <= budget):
            out[-1].append(r)
            longest = max(longest, length)
        else:
            out.append([r])
            longest = length
    return out


Micros = list[tuple[list[int], float]]  # (micro-batch rows, loss weight)


def _equalized(rows_by_rank: list[list[int]], stand_in: int, batch: RolloutBatch,
               train: TrainConfig) -> list[Micros]:
    """Each rank's micro-batches of its rows, as many as the rank with the most, so FSDP2's
    collectives (one all-gather per forward, one reduce-scatter per backward) line up: a rank with
    fewer runs stand-in micro-batches of the one row `stand_in`, whose loss counts zero."""
    per_rank = [_micro_batches(rows, batch, train) for rows in rows_by_rank]
    count = max(1, *(len(micros) for micros in per_rank))
    return [[(rows, 1.0) for rows in micros] + [([stand_in], 0.0)] * (count - len(micros)) for micros in per_rank]


def _rows_by_rank(mini: list[int], ctx: Dist) -> list[list[int]]:
    return [[mini[i] for i in Dist(rank, ctx.world_size).rows(len(mini))] for rank in range(ctx.world_size)]


def _mini_batches(n_prompts: int, group: int, mini_batches: int) -> list[list[int]]:
    """Rows of each mini-batch: consecutive whole prompt groups, as even as possible."""
    per, extra = divmod(n_prompts, mini_batches)
    out, first = [], 0
    for m in range(mini_batches):
        n = per + (1 if m < extra else 0)
        out.append(list(range(first * group, (first + n) * group)))
        first += n
    return [rows for rows in out if rows]


class _LogprobCache:
    """Each row's completion-token log-probs that stay fixed through the update, computed once before
    the first optimizer step: the engine's, the reference's (adapter disabled) when the KL is in the
    loss, and the old policy's when more than one optimizer step needs them. With one step and no KL
    there is no extra forward pass at all: the loss's own forward gives the old policy (see
    `note_gap`)."""

    def __init__(self, model: nn.Module, batch: RolloutBatch, plans_by_rank: list[list[Micros]],
                 train: TrainConfig, pad_id: int, rank: int, old_needed: bool) -> None:
        self.ref, self.engine, self.old = {}, {}, {}
        self.gap = 0.0
        device = next(model.parameters()).device
        # Every row a rank's plan touches (stand-ins too), all at once in micro-batches, as many as
        # every other rank's.
        rows_by_rank = [list(dict.fromkeys(r for micros in plan for rows, _ in micros for r in rows))
                        for plan in plans_by_rank]
        parts = [rows for rows, _ in _equalized(rows_by_rank, rows_by_rank[0][0], batch, train)[rank]]
        for r in {r for rows in parts for r in rows}:
            self.engine[r] = torch.tensor(batch.engine_logprobs[r], dtype=torch.float32, device=device)
        ref_needed = bool(train.kl_coef)
        if not (ref_needed or old_needed):
            return
        with torch.no_grad():
            for part in parts:
                input_ids_BT, attention_mask_BT, mask_BT = _padded_on_device(model, batch, part, pad_id)
                if ref_needed:
                    with adapter_disabled(model):
                        ref_BT, _ = _scored(model, input_ids_BT, attention_mask_BT, mask_BT, train)
                if old_needed:
                    policy_BT, _ = _scored(model, input_ids_BT, attention_mask_BT, mask_BT, train)
                for b, r in enumerate(part):
                    if ref_needed:
                        self.ref[r] = ref_BT[b, mask_BT[b]]
                    if old_needed:
                        self.old[r] = policy_BT[b, mask_BT[b]]
                        self.note_gap(r, self.old[r])

    def note_gap(self, row: int, policy_logprobs: torch.Tensor) -> None:
        """Track the largest |engine - trainer| log-prob gap, trainer log-probs before any update."""
        if len(self.engine[row]):
            self.gap = max(self.gap, (self.engine[row] - policy_logprobs).abs().max().item())

    def padded(self, which: dict, rows: list[int], mask_BT: torch.Tensor) -> torch.Tensor:
        out_BT = torch.zeros(mask_BT.shape, dtype=torch.float32, device=mask_BT.device)
        for b, r in enumerate(rows):
            out_BT[b, mask_BT[b]] = which[r]
        return out_BT


def policy_update(model: nn.Module, optimizer: torch.optim.Optimizer, batch: RolloutBatch, train: TrainConfig,
                  pad_id: int, ctx: Dist = Dist()) -> dict:
    """`epochs x mini_batches` clipped optimizer steps on this rank's rows. Returns the train metrics.

    The "old" policy is the one before the update: with a single step the ratio is 1 throughout.
    With `train.tis_cap` the loss is weighted by truncated importance weights
    `min(exp(old - engine), cap)` (or masked, per `train.tis_mode`; `mismatch_weights`): the
    correction for samples from a stale version or an engine whose numerics differ; `mismatch_kl`
    measures that gap every step. `logprob_abs_diff_max` compares the engine's log-probs of the sampled
    tokens with the trainer's before the update — they agree when the samples are on-policy.
    """
    start = time.perf_counter()
    model.train()
    n_prompts, group = batch.rewards_PG.shape
    advantages = group_advantages(batch.rewards_PG, normalize_std=train.normalize_adv_std, std=train.adv_std,
                                  baseline=train.adv_baseline).flatten()
    advantages = advantages.to(next(model.parameters()).device)
    lengths = [len(completion) for _, completion in batch.sequences]
    minis = _mini_batches(n_prompts, group, train.mini_batches)
    by_mini = [_equalized(_rows_by_rank(mini, ctx), mini[0], batch, train) for mini in minis]
    plans_by_rank = [[plans[rank] for plans in by_mini] for rank in range(ctx.world_size)]
    plan = plans_by_rank[ctx.rank]
    single_step = train.epochs * len(minis) == 1
    cache = _LogprobCache(model, batch, plans_by_rank, train, pad_id, ctx.rank, old_needed=not single_step)
    params = list(lora_parameters(model).values())
    losses, grad_norms, tokens, sums, skipped = [], [], 0.0, dict.fromkeys(_TOKEN_STATS, 0.0), 0
    for _ in range(train.epochs):
        for mini, micros in zip(minis, plan):
            divisor = AGGREGATION_DIVISORS[train.loss_agg]([lengths[r] for r in mini], train.loss_norm_tokens)
            loss_sum = 0.0
            for part, weight in micros:
                loss, stats = _micro_batch_loss(model, batch, part, advantages, train, pad_id, divisor, cache,
                                                single_step)
                (loss * weight).backward()
                part_tokens = weight * sum(lengths[r] for r in part)
                loss_sum += weight * loss.item()
                tokens += part_tokens
                for key in _TOKEN_STATS:
                    sums[key] += stats[key] * part_tokens
            grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(params, train.grad_clip)).item()
            if math.isfinite(grad_norm):  # the same global norm on every rank: one decision everywhere
                optimizer.step()
            elif train.on_nonfinite == "skip":
                skipped += 1
            else:
                raise NonFiniteUpdateError(
                    f"the gradient norm is {grad_norm} (loss {loss_sum}): the update is not applied and "
                    "nothing is published, the engines keep serving the last good version; lower train.lr, "
                    "or set train.on_nonfinite=skip to skip such optimizer steps")
            optimizer.zero_grad(set_to_none=True)
            grad_norms += [grad_norm] if math.isfinite(grad_norm) else []
            losses.append(loss_sum)
    model.eval()
    totals = ctx.sum([*losses, tokens, *sums.values()])
    losses, tokens, stat_sums = totals[:len(losses)], totals[len(losses)], totals[len(losses) + 1:]
    (gap,) = ctx.max([cache.gap])
    stats = {k: s / max(tokens, 1.0) for k, s in zip(_TOKEN_STATS, stat_sums)}
    if not train.kl_coef:
        stats["kl"] = None  # no reference forward pass was run (see _LogprobCache)
    return {"loss": sum(losses) / len(losses), **stats,
            "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else math.nan, "optimizer_steps": len(losses) - skipped,
            "skipped_nonfinite_steps": skipped,
            "logprob_abs_diff_max": gap, "train_seconds": time.perf_counter() - start}


def _micro_batch_loss(model: nn.Module, batch: RolloutBatch, rows: list[int], advantages: torch.Tensor,
                      train: TrainConfig, pad_id: int, divisor: float, cache: _LogprobCache,
                      single_step: bool) -> tuple[torch.Tensor, dict]:
    """Loss of the micro-batch `rows` (divided by their mini-batch's `divisor`) and its token-mean stats."""
    input_ids_BT, attention_mask_BT, mask_BT = _padded_on_device(model, batch, rows, pad_id)
    logprobs_BT, entropy_BT = _scored(model, input_ids_BT, attention_mask_BT, mask_BT, train, with_entropy=True)
    if single_step:
        old_BT = logprobs_BT.detach()
        for b, r in enumerate(rows):
            cache.note_gap(r, old_BT[b, mask_BT[b]])
    else:
        old_BT = cache.padded(cache.old, rows, mask_BT)
    ref_BT = cache.padded(cache.ref, rows, mask_BT) if train.kl_coef else None
    tis_BT, mismatch = mismatch_weights(old_BT, cache.padded(cache.engine, rows, mask_BT), mask_BT, train.tis_mode,
                                        train.tis_cap)
    # With an entropy bonus the entropy takes part in the gradient; otherwise it is only reported.
    entropy_BT = entropy_BT if train.entropy_coef else entropy_BT.detach()
    loss, stats = grpo_loss(logprobs_BT, old_BT, ref_BT, advantages[rows], mask_BT,
                            clip_eps=train.clip_eps, kl_coef=train.kl_coef, entropy_BT=entropy_BT,
                            entropy_coef=train.entropy_coef, agg=train.loss_agg, tis_weights_BT=tis_BT,
                            divisor=divisor, options=LossOptions.from_config(train))
    stats.update(mismatch)
    return loss, stats
