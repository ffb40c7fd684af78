"""vLLM-CPU's LoRA linear layers in two matrix products per layer and step: graft's
`PunicaWrapperCPU.add_lora_linear`, installed with the grouped ops (graft.rollout.vllm.server.lora_cpu).

vLLM's wrapper shrinks and expands each slice of a layer (q, k, v; gate, up) separately, into fresh
fp32 buffers, through ops that convert dtypes and work out the slots of the step's tokens again at
every call: about 20 tensor ops per slice. Measured inside the server (docs/rollout-profile.md), that
per-call work, not the LoRA products, was the adapter's extra time. Here a layer's slices share one
shrink (their A matrices side by side) and one expand (their B matrices block-diagonal, added into
the layer's output in place), the stacked weights are built in the compute dtype once per adapter
load, and the grouping of the step's tokens by slot is computed once per step. On one thread the
two products and the add are one call of graft's kernel (lora_kernel, bf16 and fp32: every token
through its own slot, whatever the mix); elsewhere torch's products, batched over the slots used. Its
`add_lora_logits` skips the logits LoRA where no sampled row's adapter has an lm_head module.

Results equal vLLM's to float rounding (the same products; the slices' sums in another order), but
for tokens whose index is -1: no LoRA, as in lora_cpu.

Shape suffixes: see graft/__init__.py (``N`` the tokens of a step, ``S`` adapter slots, ``I``/``O``
input/output features; here ``K`` the slots a step uses, ``M`` the most tokens one of them has,
``R`` the rank times the layer's slices).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from graft.rollout.vllm.server import lora_kernel

# The measured version's signature (vLLM 0.32); another version keeps its own wrapper.
_PARAMETERS = ["self", "y", "x", "lora_a_stacked", "lora_b_stacked", "scale", "output_slices", "buffer", "kwargs"]
_LOGITS_PARAMETERS = ["self", "y", "x", "lora_a_stacked", "lora_b_stacked", "scale", "buffer", "kwargs"]
VLLM_ADD_LORA_LINEAR = None  # vLLM's own, once `install` replaced it (what a test fault puts back)
VLLM_ADD_LORA_LOGITS = None


@dataclass(frozen=True)
class StepSlots:
    """The adapter slots of one step's tokens, grouped for the batched products.

    Attributes:
        slot: The slot every token uses; None where tokens use several, or some none.
        slots_K: The slots used (ascending), where tokens use several or some use none; else None.
        rows_KM: Row of each slot's tokens in the step, padded with row 0 to `M` per slot (the padded
            positions' products are never read back).
        positions_N: Each token's position in the flattened `rows_KM` (0 for a token without one).
        none_N1: True for tokens without an adapter; None where every token has one.
        rows_N: The rows of the tokens with an adapter, by slot (the kernel's order).
        row_slots_N: The slot of each of `rows_N` (what the kernel reads, beside the rows it checks them
            with: never vLLM's buffer, which a later step rewrites).
    """

    slot: int | None
    slots_K: torch.Tensor | None = None
    rows_KM: torch.Tensor | None = None
    positions_N: torch.Tensor | None = None
    none_N1: torch.Tensor | None = None
    rows_N: torch.Tensor | None = None
    row_slots_N: torch.Tensor | None = None

    @property
    def no_lora(self) -> bool:
        return self.slot is None and self.slots_K is None


NO_LORA = StepSlots(None)


def group_slots(indices_N: torch.Tensor) -> StepSlots:
    """Group the step's tokens by slot; -1 ("no LoRA") tokens belong to none."""
    used_N = indices_N >= 0
    slots_K, counts_K = torch.unique(indices_N[used_N], return_counts=True)
    if slots_K.numel() == 0:
        return NO_LORA
    if slots_K.numel() == 1 and bool(used_N.all()):
        rows_N = torch.arange(indices_N.numel())
        return StepSlots(int(slots_K[0]), rows_N=rows_N, row_slots_N=torch.full_like(rows_N, int(slots_K[0])))
    rows = torch.argsort(indices_N, stable=True)[int((~used_N).sum()):]  # by slot, -1 rows dropped
    starts_K = torch.cumsum(counts_K, 0) - counts_K
    slot_of = torch.repeat_interleave(torch.arange(slots_K.numel()), counts_K)
    position = torch.arange(rows.numel()) - starts_K[slot_of]
    rows_KM = torch.zeros(slots_K.numel(), int(counts_K.max()), dtype=torch.long)
    rows_KM[slot_of, position] = rows
    positions_N = torch.zeros_like(indices_N)
    positions_N[rows] = slot_of * rows_KM.shape[1] + position
    none_N1 = None if bool(used_N.all()) else (~used_N).unsqueeze(1)
    return StepSlots(None, slots_K, rows_KM, positions_N, none_N1, rows, indices_N[rows])


def step_slots(wrapper) -> StepSlots:
    """The grouping of the wrapper's current token indices, computed once per step (`_per_step`)."""
    return _per_step(wrapper, "_graft_step_slots", wrapper.token_lora_indices, group_slots)


def _per_step(wrapper, attribute: str, indices_N: torch.Tensor, build: Callable):
    """`build(indices_N)` cached on the wrapper as `attribute`, keyed by the indices buffer's version
    (vLLM copies each step's mapping into it in place), address and length: once per step."""
    key = (indices_N._version, indices_N.data_ptr(), indices_N.numel())
    cached = getattr(wrapper, attribute, None)
    if cached is None or cached[0] != key:
        cached = (key, build(indices_N))
        setattr(wrapper, attribute, cached)
    return cached[1]


def stacked_weights(lora_a_stacked: tuple[torch.Tensor, ...], lora_b_stacked: tuple[torch.Tensor, ...],
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's slices as one shrink and one expand matrix per slot, in `dtype`: A_SRI, the slices'
    A side by side ([S, slices x rank, I]), and B_SOR, their B block-diagonal ([S, sum of O, slices x
    rank]). Built once per adapter load: cached on the first A tensor, keyed by every slice's
    version (vLLM writes an adapter into its slot in place)."""
    key = (dtype, *(t._version for t in lora_a_stacked + lora_b_stacked))
    cached = getattr(lora_a_stacked[0], "_graft_stacked", None)
    if cached is not None and cached[0] == key:
        return cached[1], cached[2]
    a_SRI = torch.cat([a.flatten(1, 2) for a in lora_a_stacked], dim=1).to(dtype)  # [S, 1, r, I] each
    rank = lora_a_stacked[0].shape[2]
    b_SOR = a_SRI.new_zeros(a_SRI.shape[0], sum(b.shape[2] for b in lora_b_stacked), a_SRI.shape[1])
    offset = 0
    for index, b in enumerate(lora_b_stacked):  # [S, 1, O, r] each
        b_SOR[:, offset:offset + b.shape[2], index * rank:(index + 1) * rank] = b.flatten(1, 2)
        offset += b.shape[2]
    lora_a_stacked[0]._graft_stacked = (key, a_SRI, b_SOR)
    return a_SRI, b_SOR


def slot_products(a_SRI: torch.Tensor, b_SOR: torch.Tensor, slot: int) -> tuple[Callable, Callable]:
    """One slot's shrink (x_NI -> x_NI @ A_RI.T) and expand (shrunk_NR -> shrunk_NR @ B_OR.T) through
    vLLM-CPU's oneDNN matmul with the weights packed once per adapter load (cached on `a_SRI`, which
    `stacked_weights` rebuilds on a load), as vLLM runs the model's own linear layers. Measured on one
    thread at the bench's and SmolLM2's layer shapes (64 tokens, r=8, bf16): 139 and 262 us a layer
    for the two products and the add, 210 and 312 us through torch's matmul, the same values."""
    products = getattr(a_SRI, "_graft_products", None)
    if products is None:
        products = a_SRI._graft_products = {}
    if slot not in products:
        products[slot] = (_matmul(a_SRI[slot]), _matmul(b_SOR[slot]))
    return products[slot]


def _matmul(weight_OI: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """inputs_NI -> inputs_NI @ weight_OI.T: vLLM-CPU's oneDNN matmul over the packed weight, or
    torch's where vLLM has no oneDNN."""
    ops = _vllm_ops()
    if ops is None:
        return lambda inputs_NI: inputs_NI @ weight_OI.T
    handler = ops.create_onednn_mm(weight_OI.T, 32)  # packs a copy: [I, O] in, its own layout out
    return lambda inputs_NI: ops.onednn_mm(handler, inputs_NI, None)


@functools.cache
def _vllm_ops():
    """vLLM's custom ops module where it has the oneDNN matmul (x86 and Arm CPUs), else None."""
    try:
        from vllm import _custom_ops
    except ImportError:
        return None
    return _custom_ops if getattr(_custom_ops, "_supports_onednn", False) else None


def add_lora_linear(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked: tuple[torch.Tensor, ...],
                    lora_b_stacked: tuple[torch.Tensor, ...], scale: float, output_slices: tuple[int, ...], *,
                    buffer: tuple[torch.Tensor, ...] | None = None, **kwargs) -> None:
    """y[:, slices] += x @ A[slot].T @ B[slot].T * scale for each token's slot, in place; the same
    arguments as vLLM's (`buffer` is not needed: the shrink's result is a fresh tensor)."""
    assert len(lora_a_stacked) == len(lora_b_stacked) == len(output_slices)
    assert sum(output_slices) == sum(b.shape[2] for b in lora_b_stacked) <= y.shape[-1]
    slots = step_slots(self)
    if slots.no_lora:
        return
    a_SRI, b_SOR = stacked_weights(lora_a_stacked, lora_b_stacked, x.dtype)
    y_NO = y.view(-1, y.shape[-1])[:, :b_SOR.shape[1]]
    x_NI = x.view(-1, x.shape[-1])
    if lora_kernel.add(y_NO, x_NI, a_SRI, b_SOR, slots.rows_N, slots.row_slots_N, output_slices, scale):
        return
    if slots.slot is not None:
        shrink, expand = slot_products(a_SRI, b_SOR, slots.slot)
        y_NO.add_(expand(shrink(x_NI)), alpha=scale)
        return
    a_KRI, b_KOR = step_weights(lora_a_stacked[0], a_SRI, b_SOR, slots)
    rows = slots.rows_KM.view(-1)
    inputs_KMI = x_NI.index_select(0, rows).view(*slots.rows_KM.shape, -1)
    shrunk_KMR = torch.bmm(inputs_KMI, a_KRI.transpose(1, 2))  # padded rows: computed, never gathered back
    expanded_KMO = torch.bmm(shrunk_KMR, b_KOR.transpose(1, 2)).to(y.dtype)
    # Back in the tokens' order by a gather, not index_add_ (a scatter: 200 us a call at SmolLM2's
    # gate/up with 8 slots, more than the two products).
    expanded_NO = expanded_KMO.flatten(0, 1).index_select(0, slots.positions_N)
    if slots.none_N1 is not None:
        expanded_NO.masked_fill_(slots.none_N1, 0)
    y_NO.add_(expanded_NO, alpha=scale)


def step_weights(first_a: torch.Tensor, a_SRI: torch.Tensor, b_SOR: torch.Tensor,
                 slots: StepSlots) -> tuple[torch.Tensor, torch.Tensor]:
    """The stacked weights of the slots a mixed step uses, gathered once per step and layer (the two
    gathers took about as long as the layer's two products, measured at SmolLM2's q/k/v with 8 slots):
    cached on the layer's first A tensor beside its stacked weights."""
    cached = getattr(first_a, "_graft_step_weights", None)
    if cached is None or cached[0] is not slots or cached[1] is not a_SRI:
        cached = (slots, a_SRI, a_SRI.index_select(0, slots.slots_K), b_SOR.index_select(0, slots.slots_K))
        first_a._graft_step_weights = cached
    return cached[2], cached[3]


def add_lora_logits(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked: torch.Tensor,
                    lora_b_stacked: torch.Tensor, scale, *, buffer: torch.Tensor | None = None, **kwargs) -> None:
    """vLLM's logits LoRA (y += x @ A[slot].T @ B[slot].T * scale per sampled row), skipped where no
    sampled row's slot holds an lm_head LoRA: vLLM calls it at every step of a model whose lm_head it
    wraps (SmolLM2's, for one), and an adapter without an lm_head module (PEFT's all-linear never
    targets it) sits there as zeros, through which vLLM's path still expanded a [rows, vocab] fp32
    product and added it to the logits."""
    if not bool(live_slots(lora_b_stacked)[sampled_slots(self)].any()):
        return None
    return VLLM_ADD_LORA_LOGITS(self, y, x, lora_a_stacked, lora_b_stacked, scale, buffer=buffer, **kwargs)


def sampled_slots(wrapper) -> torch.Tensor:
    """The slots (>= 0) of the step's sampled rows, computed once per step (`_per_step`)."""
    return _per_step(wrapper, "_graft_sampled_slots", wrapper.sampler_indices,
                     lambda indices_N: torch.unique(indices_N[indices_N >= 0]))


def live_slots(lora_b_stacked: torch.Tensor) -> torch.Tensor:
    """live_S[slot]: the slot's B is not all zero (vLLM zeroes a slot before writing an adapter into it,
    in place); cached on the tensor, keyed by its version."""
    cached = getattr(lora_b_stacked, "_graft_live_slots", None)
    if cached is None or cached[0] != lora_b_stacked._version:
        cached = (lora_b_stacked._version, lora_b_stacked.flatten(1).ne(0).any(dim=1))
        lora_b_stacked._graft_live_slots = cached
    return cached[1]


def install() -> bool:
    """Put `add_lora_linear` and `add_lora_logits` in place of vLLM-CPU's punica wrapper's; False where
    vLLM is absent or another version."""
    try:
        from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU
    except ImportError:
        return False
    global VLLM_ADD_LORA_LINEAR, VLLM_ADD_LORA_LOGITS
    if PunicaWrapperCPU.add_lora_linear is add_lora_linear:
        return True
    if list(inspect.signature(PunicaWrapperCPU.add_lora_linear).parameters) != _PARAMETERS or \
            list(inspect.signature(PunicaWrapperCPU.add_lora_logits).parameters) != _LOGITS_PARAMETERS:
        return False
    VLLM_ADD_LORA_LINEAR, VLLM_ADD_LORA_LOGITS = PunicaWrapperCPU.add_lora_linear, PunicaWrapperCPU.add_lora_logits
    PunicaWrapperCPU.add_lora_linear, PunicaWrapperCPU.add_lora_logits = add_lora_linear, add_lora_logits
    lora_kernel.load()  # built (or its absence logged) as the server starts, not in its first step
    return True
