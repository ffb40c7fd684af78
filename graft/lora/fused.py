"""One adapter's LoRA delta added inside the matmul that computes it: `addmm(base, x A^T, B^T, alpha=scaling)`.

PEFT's LoRA layer computes `result + lora_B(lora_A(x)) * scaling`: three output-sized tensors per
layer (B's product, its scaled copy, the sum) forward and one more (the scaled gradient) backward.
At the 24-layer Qwen2.5-0.5B shape on the CPU those elementwise passes were 13.7% of the update's
self CPU time (`graft bench update --profile`). `torch.addmm` accumulates the product into the base
output in the GEMM itself and applies the scaling to the product; its backward scales the rank-sized
gradient instead of an output-sized one. Same sum, computed in one kernel: the results move by fp32
rounding only.

`fused_lora(model)` installs it on every LoRA layer for its body (the update wraps its forward and
backward, so checkpointed layers recompute the same way). A layer falls back to PEFT's own forward
where the fused sum would not be PEFT's: adapters off or merged, several active adapters, PEFT's
mixed-adapter batches, an adapter PEFT runs through a variant (DoRA), and a sharded (tensor-parallel)
output, whose local block the fused GEMM would not see whole.

Shape suffixes: see graft/__init__.py (N: tokens of the flattened batch, R: LoRA rank, O: outputs).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from peft.tuners.lora import LoraLayer
from torch import Tensor, nn

# A tensor-parallel run's LoRA weights and outputs are DTensors (another class), which `addmm` cannot mix
# with plain tensors.
_PLAIN = (Tensor, nn.Parameter)


def _single_adapter(layer: LoraLayer, kwargs: dict) -> str | None:
    """The one adapter whose delta PEFT would add, where PEFT's forward is the vanilla sum; else None."""
    if layer.disable_adapters or layer.merged or "adapter_names" in kwargs or len(layer.active_adapters) != 1:
        return None
    name = layer.active_adapters[0]
    if name not in layer.lora_A or name in getattr(layer, "lora_variant", {}):
        return None
    return name


def _fused_forward(layer: LoraLayer, x: Tensor, *args, **kwargs) -> Tensor:
    """`layer`'s PEFT output, the delta accumulated by `addmm` (module docstring)."""
    name = _single_adapter(layer, kwargs)
    if name is None:
        return type(layer).forward(layer, x, *args, **kwargs)
    result = layer.base_layer(x, *args, **kwargs)
    lora_A, lora_B = layer.lora_A[name], layer.lora_B[name]
    xa = lora_A(layer.lora_dropout[name](x.to(lora_A.weight.dtype)))
    if not all(type(t) in _PLAIN for t in (result, xa, lora_B.weight)):  # sharded: PEFT's own sum
        return (result + lora_B(xa) * layer.scaling[name]).to(result.dtype)
    xa_NR = xa.reshape(-1, xa.shape[-1])
    result_NO = result.reshape(-1, result.shape[-1]).to(xa_NR.dtype)
    summed_NO = torch.addmm(result_NO, xa_NR, lora_B.weight.t(), alpha=layer.scaling[name])
    if lora_B.bias is not None:
        summed_NO = summed_NO + lora_B.bias * layer.scaling[name]
    return summed_NO.view(result.shape).to(result.dtype)


@contextlib.contextmanager
def fused_lora(model: nn.Module) -> Iterator[None]:
    """Within the body, every LoRA linear layer of `model` adds its delta through `addmm`. Nests
    with other per-layer forwards (`graft.lora.routing.routed`): a layer that already has its own is
    left as it is."""
    layers = [module for module in model.modules()
              if isinstance(module, LoraLayer) and isinstance(module.base_layer, nn.Linear)
              and "forward" not in vars(module)]
    installed = [functools.partial(_fused_forward, layer) for layer in layers]
    for layer, forward in zip(layers, installed):
        layer.forward = forward
    try:
        yield
    finally:
        for layer, forward in zip(layers, installed):
            if vars(layer).get("forward") is forward:
                del layer.forward
