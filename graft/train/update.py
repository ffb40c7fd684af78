"""One GRPO policy update of the LoRA adapter from a rollout batch (one optimizer step).

The batch may be split over ranks (FSDP2) and micro-batches: every part's loss is divided by the
whole batch's divisor (`AGGREGATION_DIVISORS`), so gradients summed over parts and ranks equal the
gradient of the whole batch on one process, and reported metrics are whole-batch values.

Shape suffixes: `_B` sequences of a micro-batch, `_T` padded token positions, `_P`/`_G` prompts/group.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from graft.config import TrainConfig
from graft.lora.attach import adapter_disabled, lora_parameters
from graft.rl.advantages import group_advantages
from graft.rl.losses import AGGREGATION_DIVISORS, grpo_loss, token_entropy, token_logprobs, truncated_importance_weights
from graft.rl.packing import next_token_targets, pad
from graft.train.distributed import Dist, full_tensor
from graft.train.rollout import RolloutBatch

# Token-weighted statistics, summed over micro-batches and ranks, then divided by the token count.
_TOKEN_STATS = ("kl", "entropy", "clip_fraction", "ratio_mean", "tis_weight_mean")


def _completion_logprobs(model: nn.Module, input_ids_BT, attention_mask_BT) -> tuple[torch.Tensor, torch.Tensor]:
    logits_BTV = model(input_ids=input_ids_BT, attention_mask=attention_mask_BT, use_cache=False).logits
    return token_logprobs(logits_BTV, next_token_targets(input_ids_BT)), logits_BTV


def _micro_batches(rows: list[int], size: int | None) -> list[list[int]]:
    size = size or len(rows)
    return [rows[i:i + size] for i in range(0, len(rows), size)]


def policy_update(model: nn.Module, optimizer: torch.optim.Optimizer, batch: RolloutBatch, train: TrainConfig,
                  pad_id: int, ctx: Dist = Dist()) -> dict:
    """Loss over this rank's rows, backward, clipped optimizer step. Returns the step's train metrics.

    One optimizer step per rollout batch, so the "old" policy is the current one (ratio 1 at the
    start). With `train.tis_cap` the loss is weighted by truncated importance weights
    `min(exp(trainer - engine), cap)`: the correction for samples from a stale version or an engine
    whose numerics differ. `logprob_abs_diff_max` compares the engine's log-probs of the sampled
    tokens with the trainer's before the update — they agree when the samples are on-policy.
    """
    start = time.perf_counter()
    model.train()
    lengths = [len(completion) for _, completion in batch.sequences]
    divisor = AGGREGATION_DIVISORS[train.loss_agg](lengths)
    advantages = group_advantages(batch.rewards_PG, normalize_std=train.normalize_adv_std).flatten()
    rows, weight = list(ctx.rows(len(batch.sequences))), 1.0
    if not rows:  # fewer sequences than ranks: FSDP2 still needs this rank in forward and backward
        rows, weight = [0], 0.0
    loss_sum, gap, tokens, sums = 0.0, 0.0, 0.0, dict.fromkeys(_TOKEN_STATS, 0.0)
    for part in _micro_batches(rows, train.micro_batch_size):
        loss, stats, part_gap = _part_loss(model, batch, part, advantages, train, pad_id, divisor)
        (loss * weight).backward()
        part_tokens = weight * sum(lengths[r] for r in part)
        loss_sum += weight * loss.item()
        gap = max(gap, part_gap)
        tokens += part_tokens
        for key in _TOKEN_STATS:
            sums[key] += stats[key] * part_tokens
    params = list(lora_parameters(model).values())
    grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(params, train.grad_clip)).item()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    loss_sum, tokens, *stat_sums = ctx.sum([loss_sum, tokens, *sums.values()])
    (gap,) = ctx.max([gap])
    return {"loss": loss_sum, **{k: s / max(tokens, 1.0) for k, s in zip(_TOKEN_STATS, stat_sums)},
            "grad_norm": grad_norm, "logprob_abs_diff_max": gap, "train_seconds": time.perf_counter() - start}


def _part_loss(model: nn.Module, batch: RolloutBatch, rows: list[int], advantages: torch.Tensor, train: TrainConfig,
               pad_id: int, divisor: float) -> tuple[torch.Tensor, dict, float]:
    """Loss of `rows` of the batch (divided by the whole batch's `divisor`), stats, engine gap."""
    input_ids_BT, attention_mask_BT, mask_BT = pad([batch.sequences[r] for r in rows], "right", pad_id)
    logprobs_BT, logits_BTV = _completion_logprobs(model, input_ids_BT, attention_mask_BT)
    with torch.no_grad():
        with adapter_disabled(model):  # the reference policy: reported always, penalised with kl_coef
            ref_logprobs_BT, _ = _completion_logprobs(model, input_ids_BT, attention_mask_BT)
        engine_BT = torch.zeros_like(logprobs_BT)
        for b, r in enumerate(rows):
            engine_BT[b, mask_BT[b]] = torch.tensor(batch.engine_logprobs[r], dtype=engine_BT.dtype)
        gap = (engine_BT - logprobs_BT).abs()[mask_BT].max().item() if mask_BT.any() else 0.0
        tis_BT = truncated_importance_weights(logprobs_BT, engine_BT, train.tis_cap) if train.tis_cap else None
    # With an entropy bonus the entropy takes part in the gradient; otherwise it is only reported.
    entropy_BT = token_entropy(logits_BTV if train.entropy_coef else logits_BTV.detach())
    loss, stats = grpo_loss(logprobs_BT, logprobs_BT.detach(), ref_logprobs_BT, advantages[rows], mask_BT,
                            clip_eps=train.clip_eps, kl_coef=train.kl_coef, entropy_BT=entropy_BT,
                            entropy_coef=train.entropy_coef, agg=train.loss_agg, tis_weights_BT=tis_BT,
                            divisor=divisor)
    stats["tis_weight_mean"] = tis_BT[mask_BT].mean().item() if tis_BT is not None and mask_BT.any() else 1.0
    return loss, stats, gap
