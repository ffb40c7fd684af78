"""Tokens of several LoRA adapters in one forward pass: each token's delta from its own adapter.

A batch of many tenants holds sequences of several adapters on one frozen base. `routed(model,
adapter_N, names)` makes every LoRA layer of a PEFT model compute the base layer over all tokens,
then, for each adapter present, one LoRA matmul pair over that adapter's tokens only (grouped, as
vLLM's punica ops do at serving time), added into those tokens' outputs. The choice is per token,
not per row, so packed rows may mix adapters too.

Why it isolates tenants exactly: a token's output is the base's plus its own adapter's delta, as in a
batch of that adapter alone, and the delta's backward reaches an adapter's weights from its own tokens
only (`index_select` / `index_add` route the gradients). Nothing of one tenant enters another's
gradient, NaN included. (PEFT's own mixed-adapter batches pick one adapter per row and refuse to run
in training mode.) LoRA dropout draws random numbers per call, so with dropout > 0 a tenant's masks
depend on the batch it shares: exact isolation needs dropout 0.

Shape suffixes: see graft/__init__.py (N: tokens of the flattened batch).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence

from peft.tuners.lora import LoraLayer
from torch import Tensor, nn

BASE_ONLY = -1  # a token with no adapter (padding, or a request of the base model)


class Route:
    """Which tokens each adapter owns: (adapter name, its token indices into the flattened batch)."""

    def __init__(self, adapter_N: Tensor, names: Sequence[str]) -> None:
        self.tokens = adapter_N.numel()
        self.groups = [(name, indices) for index, name in enumerate(names)
                       if len(indices := (adapter_N.reshape(-1) == index).nonzero().squeeze(-1))]


def _routed_forward(layer: LoraLayer, route: Route, x: Tensor, *args, **kwargs) -> Tensor:
    """`layer`'s output with each token's LoRA delta from its own adapter (module docstring)."""
    result = layer.base_layer(x, *args, **kwargs)
    x_NH = x.reshape(-1, x.shape[-1])
    if len(x_NH) != route.tokens:
        raise ValueError(f"routed forward: the batch has {len(x_NH)} tokens, the route {route.tokens}")
    result_NO = result.reshape(-1, result.shape[-1])
    for name, indices_M in route.groups:
        if name not in layer.lora_A:  # this adapter leaves this module alone (its target_modules)
            continue
        lora_A, lora_B = layer.lora_A[name], layer.lora_B[name]
        x_MH = x_NH.index_select(0, indices_M).to(lora_A.weight.dtype)
        delta_MO = lora_B(lora_A(layer.lora_dropout[name](x_MH))) * layer.scaling[name]
        result_NO = result_NO.index_add(0, indices_M, delta_MO.to(result_NO.dtype))
    return result_NO.view_as(result)


@contextlib.contextmanager
def routed(model: nn.Module, adapter_N: Tensor, names: Sequence[str]) -> Iterator[None]:
    """Within the body, every LoRA layer of `model` routes token n to adapter `names[adapter_N[n]]`
    (`BASE_ONLY`: no adapter). `adapter_N` holds one index per token of the batch the body runs,
    flattened in the input's order ([B, T] -> B * T)."""
    route = Route(adapter_N, names)
    layers = [module for module in model.modules() if isinstance(module, LoraLayer)]
    if merged := [name for layer in layers for name in layer.merged_adapters]:
        raise ValueError(f"routed forward: adapter(s) {sorted(set(merged))} are merged into the base weights, "
                         "so every token would get them; unmerge first")
    for layer in layers:
        layer.forward = functools.partial(_routed_forward, layer, route)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward
