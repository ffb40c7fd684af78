"""vLLM-CPU's LoRA matmuls, grouped by adapter: installed in the servers graft launches
(graft.rollout.vllm.server.entry), in every process of the server.

vLLM's PyTorch-native punica ops (`vllm.lora.ops.torch_ops`, what vLLM-CPU runs) gather a whole
adapter matrix per token — `weights[indices]`, a [tokens, out, in] copy — and then take one
matrix-vector product per token. An RL rollout serves one adapter to the whole batch, so the same
products are one matrix product per adapter in the batch, without the copy. Measured on 2 cores
(the quickstart's model, hidden 128, 2 layers, LoRA r=8 on every linear layer; 32 prompts x 8
samples x 8 tokens, one call, medians of 10): 0.70 s through vLLM's ops, 0.42 s through these,
0.29-0.32 s through the base weights; `graft bench rollout` measures the two side by side.

Same arguments and results as vLLM's (the same dot products, summed in another order: results
agree to float rounding, ~1e-7 relative in fp32), but for tokens whose index is -1 ("no LoRA"):
vLLM's `weights[-1]` reads the last slot there, so a base-model request sharing a step with adapter
requests got the adapter of slot `max_loras - 1` whenever one was loaded there (a base request
served beside two adapters gave other tokens than transformers in the test suite); here they get
no LoRA, as vLLM's GPU kernels and its own comment ("-1 means no lora") intend.

Installed only on vLLM-CPU (a CUDA vLLM runs its Triton punica kernels, which never call these ops:
see `PATCHES` in graft.rollout.vllm.server.entry) and only over the version measured (the three
ops' signatures); `GRAFT_VLLM_LORA_OPS=vllm` in the server's environment (`VllmServerConfig.lora_ops`)
keeps vLLM's own.

Shape suffixes: see graft/__init__.py (``N`` the tokens of a step, ``S`` adapter slots).
"""

from __future__ import annotations

import inspect
import os

import torch

from graft.rollout.vllm.server import lora_cpu_linear
from graft.rollout.vllm.server.environment import LORA_OPS_ENV

_PARAMETERS = {  # the measured version's signatures; another version keeps its own ops
    "bgmv_shrink": ["inputs", "lora_b_weights", "output_tensor", "lora_indices_tensor", "scaling"],
    "bgmv_expand": ["inputs", "lora_b_weights", "output_tensor", "lora_indices_tensor", "add_inputs"],
    "bgmv_expand_slice": ["inputs", "lora_b_weights", "output_tensor", "lora_indices_tensor", "slice_offset",
                          "slice_size", "add_inputs"],
}


def lora_matvec(inputs_NI: torch.Tensor, weights_SOI: torch.Tensor, indices_N: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    """outputs_NO[t] = weights_SOI[indices_N[t]] @ inputs_NI[t] (0 where the index is -1), one matrix
    product per adapter used."""
    if weights_SOI.dim() == 4:  # [S, 1, O, I]
        weights_SOI = weights_SOI.squeeze(1)
    inputs_NI = inputs_NI.to(dtype)
    slots = torch.unique(indices_N)
    if slots.numel() == 1 and slots[0] >= 0:
        return inputs_NI @ weights_SOI[slots[0]].to(dtype).T
    outputs_NO = inputs_NI.new_zeros(inputs_NI.shape[0], weights_SOI.shape[1])  # -1: no adapter, adds 0
    for slot in slots[slots >= 0]:
        rows = indices_N == slot
        outputs_NO[rows] = inputs_NI[rows] @ weights_SOI[slot].to(dtype).T
    return outputs_NO


def bgmv_shrink(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0):
    outputs = lora_matvec(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, :outputs.shape[1]] = scaling * outputs


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs: bool = True):
    outputs = lora_matvec(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    # As vLLM's: one output row broadcasts; adapter and model may pad the features differently.
    limit = 1 if outputs.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
    common = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :common] += outputs[:limit, :common]
    else:
        output_tensor[:, :common] = outputs[:limit, :common]


def bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset: int,
                      slice_size: int, add_inputs: bool = True):
    outputs = lora_matvec(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset:slice_offset + slice_size] += outputs
    else:
        output_tensor[:, slice_offset:slice_offset + slice_size] = outputs


def install() -> bool:
    """Put the grouped ops in place of vLLM's torch ops (and of the names vLLM-CPU's punica wrapper
    imported), and graft's linear-layer add in place of the wrapper's (lora_cpu_linear); False where
    vLLM is absent, another version, or `GRAFT_VLLM_LORA_OPS=vllm`."""
    if os.environ.get(LORA_OPS_ENV) == "vllm":
        return False
    try:
        from vllm.lora.ops.torch_ops import lora_ops
        from vllm.lora.punica_wrapper import punica_cpu
    except ImportError:
        return False
    ours = {"bgmv_shrink": bgmv_shrink, "bgmv_expand": bgmv_expand, "bgmv_expand_slice": bgmv_expand_slice}
    for name, parameters in _PARAMETERS.items():
        if list(inspect.signature(getattr(lora_ops, name)).parameters) != parameters:
            return False
    for name, op in ours.items():
        setattr(lora_ops, name, op)  # the sgmv_* (prefill) ops call these through the module
        if hasattr(punica_cpu, name):
            setattr(punica_cpu, name, op)
    return lora_cpu_linear.install()
