"""How much activation memory a policy's update may keep for the backward, and how auto
checkpointing spends it (`train.activation_checkpointing: auto`, `ActivationMemory`): the activations
kept for the backward — the LM head's log-softmax, then whole decoder layers — take a share of the
memory available, per micro-batch. `parallelize` attaches it to the model; the trainer's size rules
(graft.train.memory_budget) read it to size micro-batches.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from torch import nn

# `train.activation_checkpointing: auto` lets the activations kept for the backward (the LM head's
# log-softmax, then whole decoder layers) take this share of the memory available. On the CPU: of the
# host's available memory when the model is set up (per rank on a shared host). Measured at the
# 24-layer Qwen2.5-0.5B shape (one update of 8 x 384 tokens, ~21 GiB available, `train.host_memory:
# cached`, the second update): a sixth held 5.78 GiB above the model, an eighth 4.94 GiB (both ~60
# CPU-s), a twelfth 4.11 GiB (66 CPU-s), every layer checkpointed 2.82 GiB (80 CPU-s); TRL's update,
# gradient checkpointing and fp32 logits of every completion token, ~4.4 GiB in `graft bench update`
# (docs/benchmarks.md). The host's memory is shared with the engines and everything else on it; a GPU's
# is the trainer's but for what an engine on the same GPU has taken, so on CUDA the share is of the
# memory free at each micro-batch (the driver's free memory and what torch's caching allocator holds
# unused), which counts an engine started after the trainer too. Half: the rest is for what is not
# kept (each layer's transient intermediates, the head's chunk). On one H100 (2026-11-26) the update
# of 64 x (128 + 512/256) tokens at this shape took 2.00 s with every layer checkpointed in 8192-token
# micro-batches, 1.14 s with none in one 32,768-token micro-batch (64.8 GB peak).
AUTO_MEMORY_FRACTION = {"cpu": 1 / 12, "cuda": 1 / 2}
_PROBE_TOKENS = 64


@dataclass
class ActivationMemory:
    """The activation memory `train.activation_checkpointing: auto` spends, and how.

    A checkpointed layer keeps only its input and runs its forward again in the backward (a third
    more of its compute); a kept layer holds `layer_bytes_per_token` per token until its backward.
    The LM head's chunks recompute their logits the same way unless their float32 log-softmax is
    kept (`head_bytes_per_token` per scored token). Per byte, keeping the head saves more compute
    (its matmul is H x V per token; a layer's ~12 H^2 for ~(4 I + 7 H) x 4 bytes), so it goes first.
    """

    layer_bytes_per_token: float
    head_bytes_per_token: int
    budget_bytes: int | None  # None: measured at each micro-batch (CUDA)
    layers: list[nn.Module] = field(default_factory=list)
    device: torch.device = torch.device("cpu")

    @classmethod
    def measure(cls, model: nn.Module) -> ActivationMemory:
        """Bytes one layer saves for the backward per token, counted on a short forward (the tensors
        autograd saves, parameters aside), and the budget: `AUTO_MEMORY_FRACTION` of what is
        available now (on CUDA: at each micro-batch)."""
        device = next(model.parameters()).device
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        saved: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = getattr(tensor, "_local_tensor", tensor).untyped_storage()  # a DTensor: its shard
            if storage.data_ptr() not in params:
                saved[storage.data_ptr()] = storage.nbytes()
            return tensor

        training = model.training
        model.train()  # dropout's masks count; its draws must not move the run's random stream
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model(input_ids=torch.zeros(1, _PROBE_TOKENS, dtype=torch.long, device=device), use_cache=False,
                  logits_to_keep=1)
        model.train(training)
        layers = model.config.num_hidden_layers
        head = model.get_output_embeddings().weight.shape[0] * 4  # float32 log-softmax
        budget = None if device.type == "cuda" else int(available_memory_bytes(device) * AUTO_MEMORY_FRACTION["cpu"])
        return cls(sum(saved.values()) / _PROBE_TOKENS / layers, head, budget, device=device)

    def fit(self, tokens: int, scored_tokens: int) -> bool:
        """Checkpoint the fewest decoder layers (the first ones: the last layers' activations are
        freed first in the backward, before any recomputation) so that a micro-batch of `tokens`
        laid-out tokens, `scored_tokens` of them scored by the head, keeps within the budget; whether
        the head keeps its log-softmax (else it recomputes)."""
        left = self.budget()
        keep_head = scored_tokens * self.head_bytes_per_token <= left
        left -= keep_head * scored_tokens * self.head_bytes_per_token
        kept = min(len(self.layers), int(left // max(tokens * self.layer_bytes_per_token, 1.0)))
        for i, layer in enumerate(self.layers):
            layer.gradient_checkpointing = i < len(self.layers) - kept
        return keep_head

    def budget(self) -> int:
        """The bytes kept activations may take now: fixed at set-up on the CPU, half of what is free
        on CUDA."""
        if self.budget_bytes is not None:
            return self.budget_bytes
        return int(available_memory_bytes(self.device) * AUTO_MEMORY_FRACTION["cuda"])

    def unchecked_tokens(self, scored_fraction: float) -> int:
        """The laid-out tokens of the largest micro-batch whose activations fit the budget with every
        layer and the head's log-softmax kept (`scored_fraction` of its tokens scored by the head)."""
        per_token = len(self.layers) * self.layer_bytes_per_token + scored_fraction * self.head_bytes_per_token
        return int(self.budget() // max(per_token, 1.0))


def available_memory_bytes(device: torch.device) -> int:
    """Free memory of a GPU (the driver's, and what torch's caching allocator holds unused), or the
    host's available memory shared by the ranks on it (`LOCAL_WORLD_SIZE`, torchrun's)."""
    if device.type == "cuda":
        unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + unused
    try:
        with open("/proc/meminfo") as meminfo:
            kib = next(int(line.split()[1]) for line in meminfo if line.startswith("MemAvailable:"))
        available = kib * 1024
    except (OSError, StopIteration):
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return available // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
