"""How much memory an update may spend: the train's size rules (`train.max_tokens_per_micro_batch:
auto`, `train.logit_chunk_tokens: null`) resolved once per update from the activation memory model
(graft.parallel.activation_memory): the micro-batch as large as its share holds with no layer
checkpointed, and on a GPU the head's chunks as large as its free memory allows.
"""

from __future__ import annotations

from torch import nn

from graft.config import TrainConfig
from graft.parallel.activation_memory import available_memory_bytes
from graft.parallel.dist import Dist
from graft.rl.logprobs import DEFAULT_CHUNK_ELEMENTS
from graft.train.rollout_batch import RolloutBatch

# `train.max_tokens_per_micro_batch: auto` never goes below this (the fixed default before auto). On the
# CPU auto checkpointing's budget (a twelfth of the host's memory: graft/parallel/activation_memory.py)
# holds fewer tokens at real shapes (~700 at the 24-layer Qwen2.5-0.5B shape in fp32), so the CPU keeps
# 8192-token micro-batches and auto checkpointing fits them; a GPU's half of its free memory holds more,
# and the first H100 run measured fewer, larger micro-batches without recomputation as the faster update
# (the comment on AUTO_MEMORY_FRACTION there).
MIN_AUTO_TOKENS = 8192
# `train.logit_chunk_tokens: null` on CUDA: positions whose float32 logits take this share of the memory
# free at the update's start (a 64 MiB chunk is 110 positions at a 151,936-token vocabulary: each chunk's
# few kernels are too small to fill a GPU). The forward and backward hold about four such buffers at
# once, within the half that auto checkpointing leaves to what is not kept. Not yet measured on a GPU.
CUDA_HEAD_CHUNK_FRACTION = 1 / 64


def auto_sizes(model: nn.Module, batch: RolloutBatch, train: TrainConfig, ctx: Dist) -> TrainConfig:
    """`train` with `max_tokens_per_micro_batch: auto` and `logit_chunk_tokens: null` resolved for
    this update on this device. The token budget is the same on every rank (the smallest), since
    every rank plans every rank's micro-batches; the head's chunk is each rank's own."""
    update = {}
    if train.max_tokens_per_micro_batch == "auto":
        tokens = MIN_AUTO_TOKENS
        memory = getattr(model, "graft_activation_memory", None)
        if memory is not None:  # the same condition on every rank: the collective runs on all or none
            tokens = int(-ctx.max([-memory.unchecked_tokens(_scored_fraction(batch))])[0])
        update["max_tokens_per_micro_batch"] = max(MIN_AUTO_TOKENS, tokens)
    device = next(model.parameters()).device
    if train.logit_chunk_tokens is None and device.type == "cuda":
        vocab = model.get_output_embeddings().weight.shape[0]
        update["logit_chunk_tokens"] = cuda_head_chunk_tokens(available_memory_bytes(device), vocab)
    return train.model_copy(update=update)


def cuda_head_chunk_tokens(free_bytes: int, vocab: int) -> int:
    """Positions per LM-head chunk on a GPU with `free_bytes` free: `CUDA_HEAD_CHUNK_FRACTION` of it in
    float32 logits, never fewer than the CPU's 64 MiB chunk."""
    return max(DEFAULT_CHUNK_ELEMENTS // vocab, int(free_bytes * CUDA_HEAD_CHUNK_FRACTION) // (4 * vocab), 1)


def _scored_fraction(batch: RolloutBatch) -> float:
    """The share of the batch's tokens the LM head scores (its completion tokens)."""
    completion = sum(len(c) for _, c in batch.sequences)
    return completion / max(1, completion + sum(len(p) for p, _ in batch.sequences))
