"""One GRPO policy update of the LoRA adapter from a rollout batch (single optimizer step).

Shape suffixes: `_B` sequences of the batch, `_T` padded token positions, `_P`/`_G` prompts/group.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from graft.config import TrainConfig
from graft.lora.attach import adapter_disabled, lora_parameters
from graft.rl.advantages import group_advantages
from graft.rl.losses import grpo_loss, token_entropy, token_logprobs
from graft.rl.packing import next_token_targets, pad
from graft.train.rollout import RolloutBatch


def _completion_logprobs(model: nn.Module, input_ids_BT, attention_mask_BT) -> tuple[torch.Tensor, torch.Tensor]:
    logits_BTV = model(input_ids=input_ids_BT, attention_mask=attention_mask_BT, use_cache=False).logits
    return token_logprobs(logits_BTV, next_token_targets(input_ids_BT)), logits_BTV


def policy_update(model: nn.Module, optimizer: torch.optim.Optimizer, batch: RolloutBatch, train: TrainConfig,
                  pad_id: int) -> dict:
    """Loss, backward, clipped step. Returns the step's train metrics.

    One optimizer step per rollout batch, so the "old" policy is the current one (ratio 1 at the
    start); `logprob_abs_diff_max` compares the engine's log-probs of the sampled tokens with the
    trainer's before the update — the two must agree for the samples to be on-policy.
    """
    start = time.perf_counter()
    model.train()
    input_ids_BT, attention_mask_BT, mask_BT = pad(batch.sequences, "right", pad_id)
    logprobs_BT, logits_BTV = _completion_logprobs(model, input_ids_BT, attention_mask_BT)
    with torch.no_grad():
        with adapter_disabled(model):
            ref_logprobs_BT, _ = _completion_logprobs(model, input_ids_BT, attention_mask_BT)
        engine_BT = torch.zeros_like(logprobs_BT)
        for b, values in enumerate(batch.engine_logprobs):
            engine_BT[b, mask_BT[b]] = torch.tensor(values, dtype=engine_BT.dtype)
        gap = (engine_BT - logprobs_BT.detach()).abs()[mask_BT].max().item() if mask_BT.any() else 0.0
    # With an entropy bonus the entropy takes part in the gradient; otherwise it is only reported.
    entropy_BT = token_entropy(logits_BTV if train.entropy_coef else logits_BTV.detach())
    advantages_B = group_advantages(batch.rewards_PG).flatten()
    loss, stats = grpo_loss(logprobs_BT, logprobs_BT.detach(), ref_logprobs_BT, advantages_B, mask_BT,
                            clip_eps=train.clip_eps, kl_coef=train.kl_coef,
                            entropy_BT=entropy_BT,
                            entropy_coef=train.entropy_coef, agg=train.loss_agg, tis_weights_BT=None)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(list(lora_parameters(model).values()), train.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    return {"loss": loss.item(), "kl": stats["kl"], "entropy": stats["entropy"], "grad_norm": float(grad_norm),
            "logprob_abs_diff_max": gap, "train_seconds": time.perf_counter() - start}
