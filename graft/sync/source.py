"""What a sync reads of the trainer's policy: a `PolicySource`.

A sync publishes a version (the adapter's tensors and config, or the merged weights), refuses a
non-finite one (LoRA tensors, then a probe forward) and verifies delivery (teacher-forced log-probs
of the engine's tokens). In one process all of that reads the model itself (`ModelSource`). In an
FSDP2 run the model is sharded over the ranks and rank 0 holds its shard plus the LoRA tensors
gathered after the step, never a whole copy of the model: there `graft.train.ranks.ShardedSource`
implements the same interface, its forwards and its merged stream being collectives that the other
ranks join. Sync code never asks which one it has.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from graft.lora.adapter_io import AdapterWeights, adapter_layout, adapter_weights
from graft.lora.attach import lora_parameters
from graft.lora.merge import iter_merged_weights
from graft.rl.logprobs import sequence_logprobs


@runtime_checkable
class PolicySource(Protocol):
    """The policy a sync publishes, checks and verifies (see the module docstring)."""

    model: nn.Module  # the module tree (sharded in an FSDP2 run): configs, names, LoRA hyper-parameters

    def lora_tensors(self) -> dict[str, torch.Tensor]:
        """Every LoRA tensor whole, by training parameter name."""
        ...

    def adapter(self) -> AdapterWeights:
        """The adapter as the trainer holds it now: PEFT names, the dtype to serve, the PEFT config."""
        ...

    def merged_weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """The plain HF model's weights, LoRA merged in (`graft.lora.merge.iter_merged_weights`)."""
        ...

    def logprobs(self, prompt: Sequence[int], completion: Sequence[int]) -> list[float]:
        """Teacher-forced log-probs of `completion` after `prompt` (`graft.rl.logprobs.sequence_logprobs`)."""
        ...

    def probe_logits_finite(self, probe: Sequence[int]) -> bool:
        """Whether the logits of one eval-mode forward over `probe` are all finite."""
        ...


Policy = nn.Module | PolicySource
"""What the sync entry points accept: a model in this process, or a source."""


class ModelSource:
    """A `PolicySource` reading a model that this process holds whole (one-process runs, tests, benches)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def lora_tensors(self) -> dict[str, torch.Tensor]:
        return {name: param.detach() for name, param in lora_parameters(self.model).items()}

    def adapter(self) -> AdapterWeights:
        layout = adapter_layout(self.model)
        return adapter_weights(layout.lora_tensors(), layout)

    def merged_weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        return iter_merged_weights(self.model, dtype)

    def logprobs(self, prompt: Sequence[int], completion: Sequence[int]) -> list[float]:
        return sequence_logprobs(self.model, prompt, completion)

    def probe_logits_finite(self, probe: Sequence[int]) -> bool:
        return probe_logits_finite(self.model, probe)


def policy_source(policy: Policy) -> PolicySource:
    """`policy` as a source: a model is read in this process."""
    return ModelSource(policy) if isinstance(policy, nn.Module) else policy


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """`model` in eval mode (no dropout, no RNG drawn) for the body, its own mode again after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def probe_logits_finite(model: nn.Module, probe: Sequence[int]) -> bool:
    """One eval-mode forward of `model` over `probe`: are all logits finite? (Finite LoRA weights can
    still overflow: what lr 1e30 gives.) On an FSDP2 model every rank runs it with the same `probe`."""
    device = next(model.parameters()).device
    with eval_mode(model), torch.no_grad():
        logits = model(input_ids=torch.tensor([list(probe)], device=device), use_cache=False).logits
    return bool(torch.isfinite(logits).all())
