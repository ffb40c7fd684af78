"""A forward and backward whose every row computes what it would in any other batch: `batch_invariant`.

A tenant trained in a shared pass sees the base's kernels run on the whole batch, whose shape the
other tenants set (rows, the longest row). Measured on this repo's CPU (torch 2.13 fp32, MKL +
oneDNN, AVX-512, 2 threads):

- `F.linear` / `matmul`: a row of `x @ W.T` is NOT the same bits for every M (rows in the call):
  M = 1 and M = 7 give other bits than M >= 16, at every (K, N) tried (256..1024 x 256..49,152);
  among M = 16..1500 (and a row's offset inside the block) all agreed. The input gradient `g @ W`
  agreed for M = 16..1000. So: the frozen base's linear layers (the LM head included) run in blocks
  of `BLOCK_ROWS` rows, the last one zero-padded: one GEMM shape, whatever the batch.
- `scaled_dot_product_attention`: the same bits for a row whatever the batch size at a fixed
  length (forward, and the backward's dq), but NOT across padded lengths: a 12-token row padded to
  16 or 64 (masked) differs by up to 3.6e-7 from its unpadded self, 40 padded to 300 by 1.8e-7
  (the kernel's key blocks follow the length). So attention runs one call per row, over that row's
  own tokens, causal (`row_attention`): the row's shape is its own.
- RMSNorm (`x * rsqrt(mean(x^2))`), `log_softmax` and `logsumexp` over a 49,152 vocabulary, a sum
  over a row's elements: per row, the same bits for 1..1000 rows.
- Elementwise ops and the LoRA factors (routed per tenant, graft.lora.routing: M is that tenant's
  own tokens, the same alone) need nothing.

Shape suffixes: see graft/__init__.py.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface

BLOCK_ROWS = 64  # rows per base GEMM (>= 16: the smallest row count measured row-invariant above)
ROW_ATTENTION = "graft_row_attention"
_LENGTHS = contextvars.ContextVar[Sequence[int]]("row_lengths")  # each row's tokens, set by `batch_invariant`


def _blocks(x_NK: Tensor, fn, width: int) -> Tensor:
    """`fn` over `x_NK` in blocks of `BLOCK_ROWS` rows (the last zero-padded), `[N, width]`."""
    n = len(x_NK)
    padded = -(-n // BLOCK_ROWS) * BLOCK_ROWS
    if padded != n:
        x_NK = F.pad(x_NK, (0, 0, 0, padded - n))
    out_NW = x_NK.new_empty(padded, width)
    for start in range(0, padded, BLOCK_ROWS):
        out_NW[start:start + BLOCK_ROWS] = fn(x_NK[start:start + BLOCK_ROWS])
    return out_NW[:n]


class _BlockedLinear(torch.autograd.Function):
    """`F.linear` of a frozen weight in row blocks, forward and input gradient (module docstring)."""

    @staticmethod
    def forward(ctx, x_NI: Tensor, weight_OI: Tensor, bias_O: Tensor | None) -> Tensor:
        ctx.save_for_backward(weight_OI)
        return _blocks(x_NI, lambda block: F.linear(block, weight_OI, bias_O), weight_OI.shape[0])

    @staticmethod
    def backward(ctx, grad_NO: Tensor):
        (weight_OI,) = ctx.saved_tensors
        return _blocks(grad_NO.contiguous(), lambda block: block @ weight_OI, weight_OI.shape[1]), None, None


def _blocked_forward(linear: nn.Linear, x: Tensor) -> Tensor:
    assert not linear.weight.requires_grad, "only the frozen base runs in blocks: its weights get no gradient"
    x_NI = x.reshape(-1, x.shape[-1]).contiguous()
    return _BlockedLinear.apply(x_NI, linear.weight, linear.bias).view(*x.shape[:-1], linear.out_features)


def row_attention(module: nn.Module, query_BHTD: Tensor, key_BhTD: Tensor, value_BhTD: Tensor,
                  attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  sliding_window: int | None = None, **kwargs) -> tuple[Tensor, None]:
    """Causal attention one row at a time over its own tokens (a transformers attention function):
    row b's first `lengths[b]` positions (`batch_invariant`'s), the rest right padding, which gets
    zeros (only padded positions read them). `attention_mask` is not read: transformers builds none
    for an attention function it does not know."""
    assert dropout == 0.0, "attention dropout draws random numbers per call: no batch-invariant result"
    b, heads, t, _ = query_BHTD.shape
    assert sliding_window is None or sliding_window >= t, "row_attention has no sliding window"
    lengths_B = _LENGTHS.get()
    assert len(lengths_B) == b and max(lengths_B) <= t, (lengths_B, query_BHTD.shape)
    repeat = heads // key_BhTD.shape[1]
    rows = []
    for row, n in enumerate(lengths_B):
        q, k, v = (part[row:row + 1, :, :n].contiguous() for part in (query_BHTD, key_BhTD, value_BhTD))
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out_1HnD = F.scaled_dot_product_attention(q, k, v, is_causal=n > 1, scale=scaling)
        rows.append(F.pad(out_1HnD, (0, 0, 0, t - n)))
    return torch.cat(rows).transpose(1, 2).contiguous(), None


AttentionInterface.register(ROW_ATTENTION, row_attention)


@contextlib.contextmanager
def batch_invariant(model: nn.Module, lengths_B: Sequence[int]) -> Iterator[None]:
    """Within the body, `model`'s frozen linear layers run in row blocks and its attention one row at
    a time (module docstring), so each right-padded row's outputs and input gradients are the same
    bits in any batch. The body runs `model` on rows of `lengths_B` tokens each, right-padded. The
    backward may run after the body: it reads neither setting."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and not m.weight.requires_grad]
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None
               and hasattr(c, "_attn_implementation")}.values()
    previous = [(config, config._attn_implementation) for config in configs]
    for linear in linears:
        linear.forward = _blocked_forward.__get__(linear)
    for config, _ in previous:
        config._attn_implementation = ROW_ATTENTION
    token = _LENGTHS.set(list(lengths_B))
    try:
        yield
    finally:
        _LENGTHS.reset(token)
        for linear in linears:
            del linear.forward
        for config, implementation in previous:
            config._attn_implementation = implementation
