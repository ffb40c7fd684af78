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
import functools
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Protocol, TypeVar, runtime_checkable

import torch
from torch import nn

from graft.lora.adapter_io import AdapterWeights, adapter_layout, adapter_weights
from graft.lora.attach import lora_parameters
from graft.lora.merge import iter_merged_weights
from graft.rl.logprobs import sequence_logprobs

T = TypeVar("T")


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

    async def read(self, read: Callable[[], T]) -> T:
        """`read()` (a function of this source's reads) where this source's policy can be read: here and
        now for a model held as it is; `SnapshotSource` hands it to the thread that owns the model."""
        ...


Policy = nn.Module | PolicySource
"""What the sync entry points accept: a model in this process, or a source. Each entry point
(`PolicySync`, a `SyncMode`'s `sync`, `verify_delivery`) makes it a source once (`policy_source`)
and hands that down; nothing below them takes a model."""


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

    async def read(self, read: Callable[[], T]) -> T:
        return read()


class SnapshotSource(ModelSource):
    """A one-process policy as it was when a version was published, read after the model moved on.

    Why: the delivery check of version N reads the trainer's log-probs once the engine has answered
    its probe, and the next update may be running by then. Waiting for the check before that update
    cost the quickstart's overlapped step 19% (`graft bench verify`); instead every read of this
    source is one job handed to `run` (the trainer's model thread, which runs one job at a time, so
    never beside an update or a checkpoint), with version N's LoRA values copied into the model for
    the job and the model's own copied back after it (bit-exact both ways; the optimizer's state and
    the gradients are not touched).
    """

    def __init__(self, model: nn.Module, run: Callable[[Callable[[], T]], Awaitable[T]]) -> None:
        super().__init__(model)
        self._run = run
        self._lora = {name: tensor.clone() for name, tensor in adapter_layout(model).lora_tensors().items()}

    async def read(self, read: Callable[[], T]) -> T:
        return await self._run(functools.partial(self._as_published, read))

    def _as_published(self, read: Callable[[], T]) -> T:
        with swapped_in(adapter_layout(self.model).lora_tensors(), self._lora):
            return read()


def policy_source(policy: Policy) -> PolicySource:
    """`policy` as a source: a model is read in this process."""
    return ModelSource(policy) if isinstance(policy, nn.Module) else policy


@contextlib.contextmanager
def swapped_in(tensors: dict[str, torch.Tensor], values: dict[str, torch.Tensor]) -> Iterator[None]:
    """Each of `tensors` holding `values[name]` for the body, which runs without autograd, and its own
    values again after, however the body ends (bit-exact copies both ways): how a source reads the
    policy as it was published while the live LoRA tensors have moved on."""
    now = {name: tensor.clone() for name, tensor in tensors.items()}
    with torch.no_grad():
        for name, tensor in tensors.items():
            tensor.copy_(values[name])
        try:
            yield
        finally:
            for name, tensor in tensors.items():
                tensor.copy_(now[name])


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
