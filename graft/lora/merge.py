"""Merge LoRA into base weights without drift: new tensors, fp32 math (fp64 on a GPU), one rounding.

PEFT merges in place (`W += s·B@A`) and unmerges by subtracting; in bf16 each step rounds, so the
base drifts a little more with every sync cycle. Here the base is only read: every merged weight is
a new tensor `round(W + s·B@A)` with the sum formed in fp32 and rounded once to the output dtype,
on the device the base weight lives on (the LoRA factors are moved to it), so any number of merges
leaves the base bit-identical and every merge gives the same result.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

import peft
import torch
from peft.tuners.lora import LoraLayer
from torch import nn

from graft.lora.attach import ADAPTER_NAME
from graft.models.loading import model_dtype

Gather = Callable[[torch.Tensor], torch.Tensor]
"""A weight -> its whole tensor (under FSDP2 a collective that every rank calls, in the same order)."""


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """The default `Gather`: one process holds every weight whole."""
    return tensor

# Module merges run on this many threads: torch's intra-op parallelism barely speeds up the rank-r
# GEMM and the mixed-dtype add, while two modules merged side by side take half the time (measured
# on the bench model, 2 cores: 142 ms sequential vs 63 ms on 2 threads).
_MERGE_THREADS = 2
_LOOKAHEAD = 4

# Rows merged per step: the fp32 delta of a chunk stays in cache, and the chunked GEMM with rank-r
# inner dimension runs ~1.5x faster here than one big one (measured on the bench model, 2 cores).
_ROWS_PER_CHUNK = 256


# On a GPU the merge runs where the weight lives, in row chunks of at most this many bytes of fp64.
_DEVICE_CHUNK_BYTES = 64 << 20


def merge_weight(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
    """`weight + scaling · lora_B @ lora_A` as a new tensor of `dtype` (default weight's dtype), on
    `weight`'s device: the LoRA factors are moved there (they are small), the weight never moves.

    Shapes: weight [out, in], lora_A [r, in], lora_B [out, r]. On the CPU the delta is formed in fp32
    and added to `weight` in fp32 (torch.add computes in the promoted dtype); elsewhere see
    `_merge_on_device`. Either way the sum is rounded once, when stored into the output, and
    `weight` is only read.

    Raises:
        NotImplementedError: a LoRA factor is on the `meta` device while the weight is not (no data
            to move; torch's own error).
    """
    if weight.device.type != "cpu":
        return _merge_on_device(weight, lora_A, lora_B, scaling, dtype)
    out_features = weight.shape[0]
    merged = torch.empty(weight.shape, dtype=dtype or weight.dtype, device=weight.device)
    scaled_A = lora_A.to(device=weight.device, dtype=torch.float32) * scaling
    lora_B = lora_B.to(device=weight.device, dtype=torch.float32)
    delta = torch.empty(min(_ROWS_PER_CHUNK, out_features), weight.shape[1])
    for start in range(0, out_features, _ROWS_PER_CHUNK):
        stop = min(start + _ROWS_PER_CHUNK, out_features)
        delta_chunk = delta[: stop - start]
        torch.mm(lora_B[start:stop], scaled_A, out=delta_chunk)
        torch.add(weight[start:stop], delta_chunk, out=merged[start:stop])
    return merged


def _merge_on_device(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float,
                     dtype: torch.dtype | None) -> torch.Tensor:
    """`merge_weight` on an accelerator: `W + s·B@A` formed in fp64 (one fused addmm per row chunk)
    and rounded once into the output.

    Not fp32: cuBLAS runs fp32 matmuls in TF32 (a 10-bit mantissa) whenever
    `torch.backends.cuda.matmul.allow_tf32` or `torch.set_float32_matmul_precision("high")` is on,
    switches that are process-wide (the merge threads cannot turn them off for themselves alone) and
    that a training script may well set. fp64 never uses TF32, so the merge does not depend on them,
    and its result is at least as close to the exact sum as the CPU's fp32 one. The rank-r GEMM is
    memory-bound, so fp64 costs little.
    """
    device = weight.device
    out_features, in_features = weight.shape
    merged = torch.empty(weight.shape, dtype=dtype or weight.dtype, device=device)
    scaled_A = lora_A.to(device=device, dtype=torch.float64) * scaling
    lora_B = lora_B.to(device=device, dtype=torch.float64)
    rows = max(1, _DEVICE_CHUNK_BYTES // (8 * max(in_features, 1)))
    for start in range(0, out_features, rows):
        stop = min(start + rows, out_features)
        merged[start:stop] = torch.addmm(weight[start:stop].double(), lora_B[start:stop], scaled_A)
    return merged


def _merge_inputs(module: LoraLayer, gather: Gather) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """(weight, lora_A, lora_B, scaling) of one LoRA module, each gathered whole."""
    base = module.get_base_layer()
    assert not module.fan_in_fan_out, "Conv1D-style (fan_in_fan_out) layers are not supported"
    return (gather(base.weight.detach()), gather(module.lora_A[ADAPTER_NAME].weight.detach()),
            gather(module.lora_B[ADAPTER_NAME].weight.detach()), module.scaling[ADAPTER_NAME])


def _storage_key(tensor: torch.Tensor) -> int:
    """Where a tensor's data lives (a sharded tensor: its local shard), to spot tied weights."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.untyped_storage().data_ptr()


def _weights(model: nn.Module) -> Iterator[tuple[str, LoraLayer | None, torch.Tensor]]:
    """(HF name, LoRA layer or None, stored tensor) for every weight of the plain HF model, in order;
    for a LoRA layer the tensor is its base weight. Tied tensors appear once, under their first name."""
    inner = model.get_base_model() if isinstance(model, peft.PeftModel) else model
    lora_layers = {name: m for name, m in inner.named_modules() if isinstance(m, LoraLayer)}
    seen_storage: set[int] = set()
    for key, tensor in inner.state_dict(keep_vars=True).items():
        if ".lora_" in key:
            continue
        module_name, _, leaf = key.rpartition(".")
        owner = module_name.removesuffix(".base_layer")
        if owner in lora_layers and leaf == "weight":
            yield f"{owner}.{leaf}", lora_layers[owner], tensor.detach()
            continue
        tensor = tensor.detach()
        if _storage_key(tensor) in seen_storage:
            continue
        seen_storage.add(_storage_key(tensor))
        yield f"{owner}.{leaf}", None, tensor


def _out_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    return dtype if tensor.is_floating_point() else tensor.dtype


def merged_layout(model: nn.Module, dtype: torch.dtype | None = None) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of every tensor `iter_merged_weights(model, dtype)` yields, in order, read
    from the module tree alone (no weight is gathered or merged): a writer can lay out its files
    before the first tensor arrives and then write each one as it comes."""
    dtype = dtype or model_dtype(model)
    return [(name, tuple(tensor.shape), _out_dtype(tensor, dtype)) for name, _, tensor in _weights(model)]


def _merge_plan(model: nn.Module, dtype: torch.dtype, gather: Gather = _whole
                ) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """(HF name, thunk producing the tensor) for every weight of the plain HF model, in order.

    The inputs of each thunk are gathered while the plan is walked (in the walker's thread, one
    weight after the other), so under FSDP2 every rank walking the plan runs the same gathers in
    the same order; only the thunks (the merge arithmetic) run on other threads.
    """
    for name, lora_layer, tensor in _weights(model):
        if lora_layer is not None:
            yield name, partial(merge_weight, *_merge_inputs(lora_layer, gather), dtype)
        else:
            tensor = gather(tensor)
            yield name, partial(tensor.to, _out_dtype(tensor, dtype))


def run_merge_gathers(model: nn.Module, dtype: torch.dtype, gather: Gather) -> None:
    """The gathers of `iter_merged_weights(model, dtype, gather=gather)` without the merges: what the
    other ranks of an FSDP2 run execute while rank 0 merges and writes (each gathered weight is
    dropped at once, so a rank holds one module's weight at a time)."""
    for _ in _merge_plan(model, dtype, gather):
        pass


def iter_merged_weights(model: nn.Module, dtype: torch.dtype | None = None, *, gather: Gather = _whole
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` for every weight of the plain HF model, LoRA merged in, in order.

    Names are what `AutoModelForCausalLM` and vLLM expect (no `base_model.model.`, no `base_layer`).
    Merges run on a small thread pool at most `_LOOKAHEAD` modules ahead of the consumer, so extra
    memory is bounded by a few modules. Tensors shared with an earlier one (tied embeddings) are
    skipped, as `save_pretrained` does. Non-LoRA tensors are yielded as they are when already in `dtype`.
    Each tensor is on the device its weight lives on (a GPU's tensors stay there): whoever serializes
    them moves them to the CPU (`graft.lora.export`, `graft.lora.stream_write`).

    Args:
        model: a PeftModel (LoRA merged in) or a plain HF model (its weights as they are: full mode).
        dtype: output dtype; default the base model's dtype.
        gather: a weight -> its whole tensor; on an FSDP2-sharded model
            `graft.parallel.dist.full_tensor`, and then every other rank must call
            `run_merge_gathers` meanwhile (the gathers are collectives, one module at a time).
    """
    dtype = dtype or model_dtype(model)
    pending: deque[tuple[str, Future]] = deque()
    with ThreadPoolExecutor(max_workers=_MERGE_THREADS, thread_name_prefix="graft-merge") as pool:
        for name, make in _merge_plan(model, dtype, gather):
            pending.append((name, pool.submit(make)))
            if len(pending) > _LOOKAHEAD:
                name, future = pending.popleft()
                yield name, future.result()
        while pending:
            name, future = pending.popleft()
            yield name, future.result()
