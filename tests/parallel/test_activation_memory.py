"""Auto checkpointing's activation memory (`ActivationMemory`): how it spends its budget per
micro-batch, on the CPU a share fixed at set-up, on CUDA a share of what is free at each micro-batch."""

import torch

from graft.parallel import activation_memory
from graft.parallel.activation_memory import ActivationMemory


def test_auto_checkpointing_fits_the_budget():
    """auto: the head keeps its log-softmax first if it fits, then the last layers go unchecked."""
    layers = [torch.nn.Module() for _ in range(4)]
    memory = ActivationMemory(layer_bytes_per_token=100, head_bytes_per_token=1000, budget_bytes=0, layers=layers)
    for budget, keep_head, checkpointed in [(0, False, [True] * 4), (5_000, False, [True, True, True, False]),
                                            (20_000, True, [True, True, False, False]),
                                            (10**9, True, [False] * 4)]:
        memory.budget_bytes = budget
        assert memory.fit(tokens=50, scored_tokens=10) is keep_head
        assert [layer.gradient_checkpointing for layer in layers] == checkpointed


def test_auto_checkpointing_on_cuda_fits_the_memory_free_at_each_micro_batch(monkeypatch):
    """On CUDA the budget is half of what is free when each micro-batch starts (an engine that took
    memory after the trainer was set up is counted), not a share fixed at set-up; so is the micro-batch
    auto sizes for the next update."""
    free = []
    monkeypatch.setattr(activation_memory, "available_memory_bytes", lambda device: free[-1])
    layers = [torch.nn.Module() for _ in range(4)]
    memory = ActivationMemory(layer_bytes_per_token=100, head_bytes_per_token=1000, budget_bytes=None,
                              layers=layers, device=torch.device("cuda", 0))
    for free_bytes, keep_head, kept in [(10**9, True, 4), (2 * 20_000, True, 2), (0, False, 0)]:
        free.append(free_bytes)
        assert memory.fit(tokens=50, scored_tokens=10) is keep_head
        assert [layer.gradient_checkpointing for layer in layers] == [i < 4 - kept for i in range(4)]
    free.append(2 * 650 * 1000)  # 4 x 100 bytes per token and 1000 per scored token, a quarter scored
    assert memory.unchecked_tokens(scored_fraction=0.25) == 1000
