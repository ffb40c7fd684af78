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


def _fused_forward(layer: LoraLayer, in_base_dtype: bool, x: Tensor, *args, **kwargs) -> Tensor:
    """`layer`'s PEFT output, the delta accumulated by `addmm` (module docstring); with
    `in_base_dtype`, the LoRA matmuls in the base output's dtype (`fused_lora`)."""
    name = _single_adapter(layer, kwargs)
    if name is None:
        return layer.peft_forward(x, *args, **kwargs)
    result = layer.base_layer(x, *args, **kwargs)
    lora_A, lora_B = layer.lora_A[name], layer.lora_B[name]
    plain = all(type(t) in _PLAIN for t in (result, lora_A.weight, lora_B.weight))
    dropped = layer.lora_dropout[name]
    if in_base_dtype and plain:  # the factors cast (differentiably: their gradients arrive in fp32)
        weight_A, weight_B = lora_A.weight.to(result.dtype), lora_B.weight.to(result.dtype)
        xa = nn.functional.linear(dropped(x.to(result.dtype)), weight_A)
    else:
        weight_B = lora_B.weight
        xa = lora_A(dropped(x.to(lora_A.weight.dtype)))
    if not (plain and type(xa) in _PLAIN):  # sharded: PEFT's own sum
        return (result + lora_B(xa) * layer.scaling[name]).to(result.dtype)
    xa_NR = xa.reshape(-1, xa.shape[-1])
    result_NO = result.reshape(-1, result.shape[-1]).to(xa_NR.dtype)
    summed_NO = torch.addmm(result_NO, xa_NR, weight_B.t(), alpha=layer.scaling[name])
    if lora_B.bias is not None:
        summed_NO = summed_NO + lora_B.bias.to(summed_NO.dtype) * layer.scaling[name]
    return summed_NO.view(result.shape).to(result.dtype)


def _switchable_forward(layer: LoraLayer, x: Tensor, *args, **kwargs) -> Tensor:
    """The forward of a layer `fused_lora` has seen: the fused sum while `layer.graft_fused` holds its
    mode, PEFT's own forward otherwise."""
    if layer.graft_fused is None:
        return layer.peft_forward(x, *args, **kwargs)
    return _fused_forward(layer, layer.graft_fused, x, *args, **kwargs)


_SWITCHABLE: dict[type, type] = {}


def _make_switchable(layer: LoraLayer) -> None:
    """Give `layer` a subclass of its PEFT class whose forward is `_switchable_forward`, once.

    A class attribute, not a forward installed on each layer: a compiled decoder layer
    (`train.compile`) guards on its modules' forwards, by identity for one held by the instance, by
    type for the class's. Per-layer forwards compiled every layer apart and again at every update
    (each update installed new ones); a shared class and a mode held as a value compile once."""
    cls = type(layer)
    if cls in _SWITCHABLE.values():
        return
    if cls not in _SWITCHABLE:  # same name and module: PEFT's repr and isinstance checks are unchanged
        _SWITCHABLE[cls] = type(cls.__name__, (cls,), {
            "forward": _switchable_forward, "peft_forward": cls.forward, "graft_fused": None,
            "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    layer.__class__ = _SWITCHABLE[cls]


@contextlib.contextmanager
def fused_lora(model: nn.Module, in_base_dtype: bool = False) -> Iterator[None]:
    """Within the body, every LoRA linear layer of `model` adds its delta through `addmm`. Nests
    with other per-layer forwards (`graft.lora.routing.routed`): a layer that already has its own is
    left as it is. The layers keep a class that switches between the two (`_make_switchable`).

    `in_base_dtype`: on a half-precision base, the LoRA path computes in the base's dtype (its fp32
    factors cast in each forward, their gradients and the optimizer's state still fp32), as FSDP2's
    mixed precision already does on several ranks and the engines' LoRA kernels do; otherwise PEFT's
    one-process way, which copies each LoRA layer's input and output to fp32 (and keeps the input's
    fp32 copy for the backward). A no-op on an fp32 base."""
    layers = [module for module in model.modules()
              if isinstance(module, LoraLayer) and isinstance(module.base_layer, nn.Linear)
              and "forward" not in vars(module)]
    for layer in layers:
        _make_switchable(layer)
        layer.graft_fused = in_base_dtype
    try:
        yield
    finally:
        for layer in layers:
            layer.graft_fused = None
