"""The GRPO policy update of the LoRA adapter from one rollout batch.

`train.epochs` passes over the batch, each split into `train.mini_batches` mini-batches, one
optimizer step per mini-batch (PPO-style: the ratio to the policy that started the update is
clipped). The rows are dealt into the mini-batches at random, seeded by the step (TRL's shuffle), or
with `train.shuffle_mini_batches: false` as consecutive whole prompt groups (verl's split). A
mini-batch may be split further over data-parallel ranks (FSDP2; the ranks of one tensor-parallel
group share their rows and hold the same losses) and micro-batches:
every part's loss is divided by the whole mini-batch's divisor (`Aggregation.divisor`), so
gradients summed over parts and ranks equal those of the whole mini-batch on one process, and the
reported metrics are whole-batch values. Which rows go to which rank and micro-batch, and how a
micro-batch is laid out (packed or padded), is `graft.train.micro_batches`'s: the loss sees one row
per sequence either way.

Shape suffixes: see graft/__init__.py.
"""

from __future__ import annotations

import math
import random
import time

import torch
from torch import nn

from graft.config import TrainConfig
from graft.host import host_memory_mode, update_memory_cached
from graft.lora.attach import adapter_disabled, lora_parameters
from graft.lora.fused import fused_lora
from graft.parallel.dist import Dist, clip_grad_norm
from graft.rl.advantages import group_advantages
from graft.rl.aggregations import get_aggregation
from graft.rl.importance import mismatch_weights
from graft.rl.losses import LossInputs, LossOptions, grpo_loss
from graft.rl.shaping import sequence_kl
from graft.train.memory_budget import auto_sizes
from graft.train.micro_batches import Micros, completion_logprobs, equalized, lay_out, plan_by_rank
from graft.train.rollout_batch import RolloutBatch
from graft.train.step_plan import mini_batch_shuffle_seed


class NonFiniteUpdateError(ValueError):
    """An optimizer step's gradient norm is NaN or infinite (`train.on_nonfinite: error`)."""


# Token-weighted statistics, summed over micro-batches and ranks, then divided by the token count.
_TOKEN_STATS = ("kl", "entropy", "clip_fraction", "ratio_mean", "tis_weight_mean", "tis_capped_fraction",
                "mismatch_kl")


def _mini_batches(n_prompts: int, group: int, mini_batches: int, left_out: frozenset[int] = frozenset(),
                  shuffle_seed: int | None = None) -> list[list[int]]:
    """Rows of each mini-batch, as even as possible, less the rows `left_out` of the loss
    (`train.overlong_filter`); a mini-batch left with no rows is dropped.

    `shuffle_seed` None: consecutive whole prompt groups. Otherwise the rows dealt at random (seeded,
    so every rank and a resumed run deal the same), each mini-batch's in batch order. Measured on the
    quickstart task (`graft bench learning`'s setup, seed 0, 150 batches of 32 x 8 in 4 mini-batches):
    each optimizer step then sees about 2 samples of every prompt instead of all 8 of a quarter of
    them, and the run's gradient norm, clip fraction, entropy and training reward follow TRL's
    (mean training reward over batches 126-150: 0.52, whole groups 0.49, TRL 0.52).
    """
    if shuffle_seed is None:
        per, extra = divmod(n_prompts, mini_batches)
        sizes = [(per + (m < extra)) * group for m in range(mini_batches)]
        rows = list(range(n_prompts * group))
    else:
        per, extra = divmod(n_prompts * group, mini_batches)
        sizes = [per + (m < extra) for m in range(mini_batches)]
        rows = random.Random(shuffle_seed).sample(range(n_prompts * group), n_prompts * group)
    out, first = [], 0
    for size in sizes:
        out.append(sorted(r for r in rows[first:first + size] if r not in left_out))
        first += size
    return [mini for mini in out if mini]


class _LogprobCache:
    """Each row's completion-token log-probs that stay fixed through the update, computed once before
    the first optimizer step: the engine's, the reference's (adapter disabled) when the KL is in the
    loss, and the old policy's when more than one optimizer step needs them. With one step and no KL
    there is no extra forward pass at all: the loss's own forward gives the old policy (see
    `note_gap`)."""

    def __init__(self, model: nn.Module, batch: RolloutBatch, plans_by_rank: list[list[Micros]],
                 train: TrainConfig, pad_id: int, rank: int, old_needed: bool) -> None:
        self.ref, self.engine, self.old = {}, {}, {}
        self.counted = {}  # multi-turn rows: True at the model's own tokens (RolloutBatch.loss_masks)
        self.gap = 0.0
        device = next(model.parameters()).device
        # Every row a rank's plan touches (stand-ins too), all at once in micro-batches, as many as
        # every other rank's.
        rows_by_rank = [list(dict.fromkeys(r for micros in plan for rows, _ in micros for r in rows))
                        for plan in plans_by_rank]
        parts = [rows for rows, _ in equalized(rows_by_rank, rows_by_rank[0][0], batch, train)[rank]]
        for r in {r for rows in parts for r in rows}:
            self.engine[r] = torch.tensor(batch.engine_logprobs[r], dtype=torch.float32, device=device)
            if batch.loss_masks is not None:
                self.counted[r] = torch.tensor(batch.loss_masks[r], dtype=torch.bool, device=device)
        ref_needed = bool(train.kl_coef)
        if not (ref_needed or old_needed):
            return
        with torch.no_grad():
            for part in parts:
                micro = lay_out(model, batch, part, pad_id, train)
                if ref_needed:
                    with adapter_disabled(model):
                        self._keep(self.ref, micro, completion_logprobs(model, micro, train)[0])
                if old_needed:
                    self._keep(self.old, micro, completion_logprobs(model, micro, train)[0])
                    for r in part:
                        self.note_gap(r, self.old[r])

    @staticmethod
    def _keep(which: dict, micro, values_BC: torch.Tensor) -> None:
        for b, (r, n) in enumerate(zip(micro.rows, micro.completion_lens)):
            which[r] = values_BC[b, :n]

    def note_gap(self, row: int, policy_logprobs: torch.Tensor) -> None:
        """Track the largest |engine - trainer| log-prob gap, trainer log-probs before any update (at the
        model's own tokens: the engine gives none for an environment's)."""
        gap_C = (self.engine[row] - policy_logprobs).abs()
        if row in self.counted:
            gap_C = gap_C[self.counted[row]]
        if len(gap_C):
            self.gap = max(self.gap, gap_C.max().item())

    def counted_mask(self, row: int) -> torch.Tensor:
        """True at the completion tokens of `row` the loss counts."""
        return self.counted[row] if row in self.counted else torch.ones_like(self.engine[row], dtype=torch.bool)

    def rows(self, which: dict, rows: list[int], mask_BC: torch.Tensor) -> torch.Tensor:
        """`rows`' cached values as `[B, C]` rows (the layout of `completion_logprobs`' results)."""
        out_BC = torch.zeros(mask_BC.shape, dtype=torch.float32, device=mask_BC.device)
        return out_BC.masked_scatter(mask_BC, torch.cat([which[r] for r in rows])) if rows else out_BC


def policy_update(model: nn.Module, optimizer: torch.optim.Optimizer, batch: RolloutBatch, train: TrainConfig,
                  pad_id: int, ctx: Dist = Dist(), step: int = 0) -> dict:
    """`epochs x mini_batches` clipped optimizer steps on this rank's rows. Returns the train metrics.
    `step` seeds the deal of rows into mini-batches (with `train.shuffle_mini_batches`).

    The "old" policy is the one before the update: with a single step the ratio is 1 throughout.
    With `train.tis_cap` the loss is weighted by truncated importance weights
    `min(exp(old - engine), cap)` (or masked, per `train.tis_mode`; `mismatch_weights`): the
    correction for samples from a stale version or an engine whose numerics differ; `mismatch_kl`
    measures that gap every step. `logprob_abs_diff_max` compares the engine's log-probs of the sampled
    tokens with the trainer's before the update — they agree when the samples are on-policy.
    Every LoRA layer adds its delta inside its matmul (`fused_lora`: PEFT's sum, fewer passes over
    the outputs), forward, backward and recompute alike, in the base's dtype unless
    `train.lora_compute_dtype` says float32. On the CPU the update's freed blocks stay in
    the process for its next blocks and the next update (`train.host_memory`, `update_memory_cached`).
    """
    device = next(model.parameters()).device
    in_base_dtype = train.lora_compute_dtype == "base"
    with fused_lora(model, in_base_dtype), update_memory_cached(host_memory_mode(train.host_memory, device)):
        return _update(model, optimizer, batch, train, pad_id, ctx, step)


def _update(model: nn.Module, optimizer: torch.optim.Optimizer, batch: RolloutBatch, train: TrainConfig,
            pad_id: int, ctx: Dist, step: int) -> dict:
    start = time.perf_counter()
    train = auto_sizes(model, batch, train, ctx)  # the micro-batch's tokens and the head's chunk, by memory
    n_prompts, group = batch.rewards_PG.shape
    lengths = [batch.loss_tokens(r) for r in range(len(batch.sequences))]  # the tokens each row's loss counts
    leave_out_truncated = train.overlong_filter or batch.mask_truncated
    left_out = frozenset(r for r, cut in enumerate(batch.truncated) if cut) if leave_out_truncated else frozenset()
    shuffle_seed = mini_batch_shuffle_seed(train.seed, step, train.shuffle_mini_batches)
    minis = _mini_batches(n_prompts, group, train.mini_batches, left_out, shuffle_seed)
    if not minis:  # every completion left out of the loss: nothing to learn from this batch
        return {"loss": math.nan, **dict.fromkeys(_TOKEN_STATS, None), "grad_norm": math.nan, "optimizer_steps": 0,
                "skipped_nonfinite_steps": 0, "logprob_abs_diff_max": 0.0, "loss_rows": 0,
                "train_seconds": time.perf_counter() - start}
    model.train()
    plans_by_rank = plan_by_rank(minis, batch, train, ctx.dp_size)  # the ranks of a TP group share rows
    single_step = train.epochs * len(minis) == 1
    cache, advantages, shaping = _before_the_first_step(model, batch, plans_by_rank, train, pad_id, ctx, single_step)
    params = list(lora_parameters(model).values())
    losses, grad_norms, tokens, sums, skipped = [], [], 0.0, dict.fromkeys(_TOKEN_STATS, 0.0), 0
    aggregation = get_aggregation(train.loss_agg)
    for _ in range(train.epochs):
        for mini, micros in zip(minis, plans_by_rank[ctx.dp_rank]):
            divisor = aggregation.divisor([lengths[r] for r in mini], train.loss_norm_tokens)
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
            grad_norm = _optimizer_step(optimizer, params, train, loss_sum, ctx)
            grad_norms += [grad_norm] if math.isfinite(grad_norm) else []
            skipped += not math.isfinite(grad_norm)
            losses.append(loss_sum)
    model.eval()
    totals = ctx.sum([*losses, tokens, *sums.values()])
    losses, tokens, stat_sums = totals[:len(losses)], totals[len(losses)], totals[len(losses) + 1:]
    (gap,) = ctx.max([cache.gap])
    stats = {k: s / max(tokens, 1.0) for k, s in zip(_TOKEN_STATS, stat_sums)}
    if not train.kl_coef:
        stats["kl"] = None  # no reference forward pass was run (see _LogprobCache)
    return {"loss": sum(losses) / len(losses), **stats, **shaping, "loss_rows": sum(map(len, minis)),
            "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else math.nan,
            "optimizer_steps": len(losses) - skipped, "skipped_nonfinite_steps": skipped,
            "logprob_abs_diff_max": gap, "train_seconds": time.perf_counter() - start}


def _before_the_first_step(model: nn.Module, batch: RolloutBatch, plans_by_rank: list[list[Micros]],
                           train: TrainConfig, pad_id: int, ctx: Dist, single_step: bool
                           ) -> tuple[_LogprobCache, torch.Tensor, dict]:
    """The log-prob cache, each row's advantage (on the model's device) and the reward-shaping metrics.
    The KL in the reward needs every row's sampling-policy and reference log-probs before the advantages
    (rows the overlong filter leaves out of the loss too: their rewards are in the group baselines)."""
    kl_in_reward = bool(train.kl_coef) and train.kl_in == "reward"
    whole = plan_by_rank([list(range(len(batch.sequences)))], batch, train, ctx.dp_size) if kl_in_reward else None
    cache = _LogprobCache(model, batch, [a + b for a, b in zip(plans_by_rank, whole)] if whole else plans_by_rank,
                          train, pad_id, ctx.dp_rank, old_needed=not single_step or kl_in_reward)
    rewards_PG, shaping = (_rewards_with_kl(batch.rewards_PG, cache, whole[ctx.dp_rank], train, ctx) if whole
                           else (batch.rewards_PG, {}))
    advantages = group_advantages(rewards_PG, normalize_std=train.normalize_adv_std, std=train.adv_std,
                                  baseline=train.adv_baseline).flatten()
    return cache, advantages.to(next(model.parameters()).device), shaping


def _optimizer_step(optimizer: torch.optim.Optimizer, params: list, train: TrainConfig, loss_sum: float,
                    ctx: Dist) -> float:
    """Clip, step (unless the gradient norm is not finite) and zero the gradients; the global norm
    (over the whole mesh, every rank joining: `clip_grad_norm`)."""
    grad_norm = clip_grad_norm(params, train.grad_clip, ctx)
    if math.isfinite(grad_norm):  # the same global norm on every rank: one decision everywhere
        optimizer.step()
    elif train.on_nonfinite == "error":
        raise NonFiniteUpdateError(
            f"the gradient norm is {grad_norm} (loss {loss_sum}): the update is not applied and "
            "nothing is published, the engines keep serving the last good version; lower train.lr, "
            "or set train.on_nonfinite=skip to skip such optimizer steps")
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def _rewards_with_kl(rewards_PG: torch.Tensor, cache: _LogprobCache, whole_plan: list[Micros], train: TrainConfig,
                     ctx: Dist) -> tuple[torch.Tensor, dict]:
    """`train.kl_in: reward`: each completion's reward less `kl_coef` x its summed KL estimate between the
    policy that sampled it (the update's old policy) and the reference. Each row is scored by the one
    rank `whole_plan` (this rank's share of all rows) gives it for real, not as a stand-in, and summed
    over ranks. Also `reward_kl_penalty`, the mean penalty."""
    kl_B = [0.0] * rewards_PG.numel()
    for r in {r for micros in whole_plan for rows, weight in micros if weight for r in rows}:
        kl_B[r] = sequence_kl(cache.old[r], cache.ref[r], cache.counted_mask(r), train.kl_estimator).item()
    penalty_PG = train.kl_coef * torch.tensor(ctx.sum(kl_B), dtype=rewards_PG.dtype,
                                              device=rewards_PG.device).view_as(rewards_PG)
    return rewards_PG - penalty_PG, {"reward_kl_penalty": penalty_PG.mean().item()}


def _micro_batch_loss(model: nn.Module, batch: RolloutBatch, rows: list[int], advantages: torch.Tensor,
                      train: TrainConfig, pad_id: int, divisor: float, cache: _LogprobCache,
                      single_step: bool) -> tuple[torch.Tensor, dict]:
    """Loss of the micro-batch `rows` (divided by their mini-batch's `divisor`) and its token-mean stats."""
    micro = lay_out(model, batch, rows, pad_id, train)
    rows, mask_BC = micro.rows, micro.mask_BC  # in layout order: the order of the [B, C] results
    loss_mask_BC = micro.loss_mask_BC  # mask_BC less environment tokens: what the loss and its stats count
    logprobs_BC, entropy_BC = completion_logprobs(model, micro, train, with_entropy=True)
    if single_step:
        old_BC = logprobs_BC.detach()
        for b, (r, n) in enumerate(zip(rows, micro.completion_lens)):
            cache.note_gap(r, old_BC[b, :n])
    else:
        old_BC = cache.rows(cache.old, rows, mask_BC)
    ref_BC = cache.rows(cache.ref, rows, mask_BC) if train.kl_coef else None
    tis_BC, mismatch = mismatch_weights(old_BC, cache.rows(cache.engine, rows, mask_BC), loss_mask_BC,
                                        train.tis_mode, train.tis_cap)
    # With an entropy bonus the entropy takes part in the gradient; otherwise it is only reported.
    entropy_BC = entropy_BC if train.entropy_coef else entropy_BC.detach()
    # With the KL in the reward the loss has no KL term (LossOptions.from_config); the reference
    # log-probs still give the KL metric.
    loss, stats = grpo_loss(LossInputs(
        logprobs_BT=logprobs_BC, old_logprobs_BT=old_BC, advantages_B=advantages[rows], mask_BT=loss_mask_BC,
        ref_logprobs_BT=ref_BC, entropy_BT=entropy_BC, tis_weights_BT=tis_BC, divisor=divisor,
        options=LossOptions.from_config(train)))
    stats.update(mismatch)
    return loss, stats
