"""The update's memory budget: the micro-batch and LM-head chunk sizes `auto_sizes` derives per update
from auto checkpointing's activation memory (tests/parallel/test_activation_memory.py)."""

import pytest
import torch

from graft.config import load_config
from graft.parallel.activation_memory import ActivationMemory, available_memory_bytes
from graft.parallel.dist import Dist
from graft.train.memory_budget import MIN_AUTO_TOKENS, auto_sizes, cuda_head_chunk_tokens
from graft.train.rollout_batch import RolloutBatch


def _batch(prompt_tokens: int, completion_tokens: int, rows: int = 4) -> RolloutBatch:
    return RolloutBatch([([1] * prompt_tokens, [2] * completion_tokens)] * rows, [[0.0] * completion_tokens] * rows,
                        torch.zeros(1, rows), version=0, seconds=0.0)


def _model_with(memory: ActivationMemory | None) -> torch.nn.Module:
    model = torch.nn.Linear(2, 2)
    if memory is not None:
        model.graft_activation_memory = memory
    return model


def _memory(budget_bytes: int) -> ActivationMemory:
    """4 layers of 100 bytes per token, a head of 1000 bytes per scored token."""
    return ActivationMemory(layer_bytes_per_token=100, head_bytes_per_token=1000, budget_bytes=budget_bytes,
                            layers=[torch.nn.Module() for _ in range(4)])


def test_auto_micro_batch_holds_as_many_tokens_as_the_budget_keeps_unchecked():
    """auto: the largest micro-batch whose every layer and head log-softmax fit the budget — here 400 bytes
    per token for the layers and 1000 x 1/4 for the head (a quarter of the tokens are scored) — and
    micro-batches of it keep every layer; never fewer tokens than before auto."""
    train = load_config(None, []).train
    assert train.max_tokens_per_micro_batch == "auto" and train.logit_chunk_tokens is None
    batch = _batch(prompt_tokens=30, completion_tokens=10)
    for budget_bytes, tokens in [(650 * 100_000, 100_000), (650 * 20_000 + 649, 20_000), (0, MIN_AUTO_TOKENS),
                                 (650 * 100, MIN_AUTO_TOKENS)]:
        memory = _memory(budget_bytes)
        resolved = auto_sizes(_model_with(memory), batch, train, Dist())
        assert resolved.max_tokens_per_micro_batch == tokens
        assert resolved.logit_chunk_tokens is None  # the CPU's 64 MiB chunks
        if tokens > MIN_AUTO_TOKENS:
            assert memory.fit(tokens, tokens // 4) is True
            assert not any(layer.gradient_checkpointing for layer in memory.layers)
    assert train.max_tokens_per_micro_batch == "auto"  # resolved on a copy


def test_auto_micro_batch_without_auto_checkpointing_or_with_a_number_set():
    """Without auto checkpointing's memory model (checkpointing on or off, tensor parallelism) auto is
    the least; a number or null is kept as set."""
    batch = _batch(8, 8)
    for override, expected in [([], MIN_AUTO_TOKENS), (["train.max_tokens_per_micro_batch=512"], 512),
                               (["train.max_tokens_per_micro_batch="], None)]:
        train = load_config(None, override).train
        assert auto_sizes(_model_with(None), batch, train, Dist()).max_tokens_per_micro_batch == expected
    set_to_512 = load_config(None, ["train.max_tokens_per_micro_batch=512"]).train
    assert auto_sizes(_model_with(_memory(10**12)), batch, set_to_512, Dist()).max_tokens_per_micro_batch == 512


class _OtherRankHolds:
    """A `Dist` stand-in whose other rank's budget holds `tokens`: `max` over both ranks."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    def max(self, values: list[float]) -> list[float]:
        return [max(values[0], -self.tokens)]


def test_auto_micro_batch_is_the_smallest_over_the_ranks():
    """Every rank plans every rank's micro-batches, so all take the budget of the rank with the least memory."""
    train, batch, memory = load_config(None, []).train, _batch(30, 10), _memory(650 * 100_000)
    assert auto_sizes(_model_with(memory), batch, train, _OtherRankHolds(50_000)).max_tokens_per_micro_batch == 50_000
    assert auto_sizes(_model_with(memory), batch, train, _OtherRankHolds(10**6)).max_tokens_per_micro_batch == 100_000


def test_cuda_head_chunks_take_a_64th_of_the_free_memory_and_never_fewer_than_the_cpus():
    vocab = 151_936
    assert cuda_head_chunk_tokens(78 * 2**30, vocab) == 2153  # 1.22 GiB of fp32 logits
    assert cuda_head_chunk_tokens(2**30, vocab) == (1 << 24) // vocab == 110  # 16 MiB of logits: the CPU's
    assert cuda_head_chunk_tokens(0, 10**9) == 1


@pytest.mark.gpu
def test_auto_sizes_on_cuda_follow_the_gpus_free_memory(tiny_model_dirs):
    """On a GPU the tiny model's micro-batches hold more than the least and its head chunks are sized by
    the free memory."""
    from graft.parallel.parallelize import parallelize
    from tests.helpers import trained_like_peft_model

    model = parallelize(trained_like_peft_model(tiny_model_dirs["qwen2"]).to("cuda"), Dist(),
                        activation_checkpointing="auto")
    resolved = auto_sizes(model, _batch(30, 10), load_config(None, []).train, Dist())
    free = available_memory_bytes(torch.device("cuda", 0))
    vocab = model.get_output_embeddings().weight.shape[0]
    assert resolved.max_tokens_per_micro_batch > MIN_AUTO_TOKENS
    assert abs(resolved.logit_chunk_tokens - cuda_head_chunk_tokens(free, vocab)) <= 0.05 * resolved.logit_chunk_tokens
