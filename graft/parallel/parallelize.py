"""The one place a policy is parallelised: `parallelize` orders the steps, each step's code below it.

Tensor parallelism (`dist.tp`) of a PEFT LoRA model's decoder layers, activation checkpointing, then
FSDP2 over the data-parallel ranks (torchtitan's order; see `parallelize`). `check_tensor_parallel`
is the check a run needs before any process group exists.

The tensor-parallel plan follows Megatron's pairing per decoder layer: attention's q/k/v and the
MLP's gate/up are split column-wise (each TP rank computes its share of the heads and of the MLP
width), o/down row-wise (each rank multiplies its share of the inputs; one all-reduce sums the
partial outputs). Two all-reduces per layer in the forward, two in the backward. Embeddings, norms
and the LM head stay whole on every TP rank (FSDP2 shards them over dp): graft's head runs only at
completion positions, a chunk at a time (`graft.rl.logprobs`), so a vocabulary-parallel head would
save little and need a parallel loss.

LoRA: PEFT has already replaced each target by a `LoraLayer` holding `base_layer`, `lora_A` and
`lora_B` (all `nn.Linear`), so the plan names those, not the target (parallelising only
`base_layer` leaves the LoRA path's shapes wrong). y = base(x) + s * B(A(x)):

- column-wise base (`W` split by output rows): `lora_B` column-wise too (its output rows are the
  same split), `lora_A` replicated (its r-wide output is needed whole by every rank's `lora_B`);
- row-wise base (`W` split by input columns, x arrives split): `lora_A` row-wise (each rank reads
  its share of x; the r-wide output is all-reduced), `lora_B` replicated (adds to the all-reduced,
  replicated base output).

Every LoRA factor is then a DTensor on the tp mesh (replicated ones as `Replicate()`), so the
gradients come out right without a hand-written reduction: DTensor's backward all-reduces the
gradient of each replicated input over tp (the `from_local` of the next sharded layer), which makes
a replicated factor's gradient whole and identical on every TP rank; FSDP2 then sums over dp.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from peft.tuners.lora import LoraLayer
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from graft.config import ALL_LINEAR
from graft.lora.attach import lora_parameters
from graft.lora.fused import fused_lora
from graft.models.loading import model_dtype
from graft.parallel.activation_memory import ActivationMemory
from graft.parallel.dist import Dist, mesh_device


def parallelize(model: nn.Module, ctx: Dist, *, activation_checkpointing: bool | str = False,
                lora_compute_dtype: str = "base", compile_layers: bool = False) -> nn.Module:
    """Parallelise `model` on `ctx`'s mesh, in this order (torchtitan's):

    1. tensor parallelism over the mesh's `tp` dimension (`dist.tp` > 1; `apply_tp`): first, because
       its plan names the PEFT model's modules as they are (each LoRA layer's `base_layer`, `lora_A`,
       `lora_B` are still `nn.Linear`) and turns their weights into tp-sharded DTensors, which FSDP2
       then shards further over dp;
    2. activation checkpointing per decoder layer (`apply_ac`; "auto": as many layers as the memory
       needs, per micro-batch): each layer keeps only its input for the backward and recomputes the
       rest (its TP collectives included); before FSDP2, so each sharded unit is a checkpointed layer
       (auto measures the layers' activations as the update computes its LoRA path: `lora_compute_dtype`);
    3. compile (`train.compile`; `apply_compile`): each decoder layer, checkpointed or not, compiled
       whole; before FSDP2, whose units are then compiled layers (torchtitan's order);
    4. FSDP2 over the mesh's `dp` dimension (`apply_fsdp`): each decoder layer one unit, the rest the
       root (one data-parallel rank: nothing to shard), with the mixed-precision policy of the base's
       dtype (`mixed_precision`). Its parameters become 2-D DTensors (dp, tp); gradients are reduced
       over dp by FSDP2 and over tp by the DTensors' own backward, in the order every rank runs them.
    """
    if ctx.tp > 1:  # 1.
        apply_tp(model, ctx.mesh["tp"])
    if activation_checkpointing:  # 2. auto's choice follows each rank's free memory, and TP ranks must
        # recompute the same layers (the recomputation repeats their collectives): under TP, every layer
        apply_ac(model, True if ctx.tp > 1 else activation_checkpointing, lora_compute_dtype)
    if compile_layers:  # 3.
        apply_compile(model)
    return apply_fsdp(model, ctx)  # 4.


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers (HF's `...DecoderLayer` modules): the units checkpointed, compiled and
    sharded."""
    return [module for module in model.modules() if type(module).__name__.endswith("DecoderLayer")]


# --- 1. tensor parallelism ------------------------------------------------------------------------------

COLWISE, ROWWISE = "colwise", "rowwise"

# model_type -> (projection inside each decoder layer -> how its base weight is split).
PLANS: dict[str, dict[str, str]] = {
    model_type: {"self_attn.q_proj": COLWISE, "self_attn.k_proj": COLWISE, "self_attn.v_proj": COLWISE,
                 "self_attn.o_proj": ROWWISE, "mlp.gate_proj": COLWISE, "mlp.up_proj": COLWISE,
                 "mlp.down_proj": ROWWISE}
    for model_type in ("qwen2", "llama")
}


def check_tensor_parallel(hf_config, tp: int, target_modules: str | Sequence[str] = ALL_LINEAR,
                          lora_dropout: float = 0.0) -> None:
    """Refuse, before any process group work, a `dist.tp` the model cannot be split by.

    Args:
        hf_config: the base model's transformers config (heads, KV heads, MLP width, model_type).
        tp: ranks per tensor-parallel group.
        target_modules: `lora.target_modules`; under TP only the planned projections may carry LoRA.
        lora_dropout: `lora.dropout`, which must be 0: a column-wise layer's lora_A is replicated, so
            every TP rank must feed it the same input, and dropout masks drawn on each rank (whose RNGs
            drift apart: rank 0 alone samples rollouts) would make the replicas' gradients, then
            weights, silently differ.

    Raises:
        ValueError: an architecture without a plan, heads, KV heads or the MLP width not divisible by
            `tp`, a LoRA target outside the plan (e.g. lm_head), or LoRA dropout.
    """
    if tp == 1:
        return
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in PLANS:
        raise ValueError(f"dist.tp={tp}: no tensor-parallel plan for model_type {model_type!r} "
                         f"(plans: {', '.join(sorted(PLANS))}); use dist.tp=1 (FSDP2 only)")
    sizes = {"num_attention_heads": hf_config.num_attention_heads,
             "num_key_value_heads": getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
             "intermediate_size": hf_config.intermediate_size}
    for key, size in sizes.items():
        if size % tp:
            raise ValueError(f"dist.tp={tp} does not divide the model's {key} ({size}): each TP rank must hold "
                             f"whole heads and an equal share of the MLP; choose a dist.tp that divides {size}")
    if lora_dropout:
        raise ValueError(f"lora.dropout ({lora_dropout}) must be 0 with dist.tp={tp}: the tensor-parallel ranks "
                         "would draw different dropout masks for the same LoRA factor")
    if target_modules != ALL_LINEAR:
        planned = {key.rsplit(".", 1)[-1] for key in PLANS[model_type]}
        outside = [t for t in ([target_modules] if isinstance(target_modules, str) else target_modules)
                   if t.rsplit(".", 1)[-1] not in planned]
        if outside:
            raise ValueError(f"dist.tp={tp}: LoRA on {outside[0]!r}, which the tensor-parallel plan does not split; "
                             f"lora.target_modules may name only {', '.join(sorted(planned))} (or all-linear)")


def apply_tp(model: nn.Module, tp_mesh) -> None:
    """Split every planned projection of `model` (a PEFT LoRA model of a planned architecture) over
    `tp_mesh`, LoRA factors with it (see the module docstring). Module and parameter names do not
    change (checkpoints and published adapters keep PEFT's names).

    Raises:
        ValueError: a LoRA factor outside the plan (it would stay a plain tensor beside DTensors).
    """
    layer_plan = PLANS[model.config.model_type]
    split = {COLWISE: ColwiseParallel, ROWWISE: Rowwise}
    plan = {}
    for name, module in model.named_modules():
        how = next((h for suffix, h in layer_plan.items() if name.endswith("." + suffix)), None)
        if how is None or ".layers." not in name:
            continue
        if not isinstance(module, LoraLayer):
            plan[name] = split[how]()
            continue
        plan[f"{name}.base_layer"] = split[how]()
        for adapter in module.lora_A:  # every adapter of the layer (a multi-tenant model: one per tenant)
            plan[f"{name}.lora_A.{adapter}"] = Replicated() if how == COLWISE else Rowwise()
            plan[f"{name}.lora_B.{adapter}"] = ColwiseParallel() if how == COLWISE else Replicated()
    parallelize_module(model, tp_mesh, plan)
    plain = [name for name, param in lora_parameters(model).items() if not hasattr(param, "device_mesh")]
    if plain:
        raise ValueError(f"LoRA parameter {plain[0]} lies outside the tensor-parallel plan; under dist.tp > 1 "
                         "lora.target_modules may name only the decoder layers' projections")


class Replicated(ParallelStyle):
    """A ParallelStyle for a LoRA factor every TP rank holds whole: its weight a `Replicate()` DTensor
    (so the gradient norm and the checkpoint see it once, not tp times), its input taken as
    replicated, its output handed back as a plain tensor like the split layers' outputs."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def to_dtensor(_module, inputs, mesh):
            return tuple(DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
                         if not isinstance(x, DTensor) else x for x in inputs)

        def to_local(_module, output, _mesh):
            return output.to_local() if isinstance(output, DTensor) else output

        # partition_fn None: distribute_module replicates every parameter over the mesh
        return distribute_module(module, device_mesh, None, to_dtensor, to_local)


class Rowwise(RowwiseParallel):
    """torch's `RowwiseParallel` with its output all-reduce waited for at once.

    torch issues it asynchronously (`async_op=True`) and waits at the result's first use. Under
    activation checkpointing the backward's recomputation of a layer stops as soon as it has what the
    backward needs, before anything uses the layer's last all-reduce: that collective was never
    waited for and stayed registered with its output tensor, one per layer per backward (measured on
    gloo: 2 layers, 1 update -> 2 "unwaited collective calls" at exit, 4 updates -> 8), a leak that
    grows for the whole run. Its result is used right away (the residual add), so nothing overlapped.
    """

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if outputs.placements != output_layouts:  # partial sums -> replicated: the all-reduce
            outputs = outputs.redistribute(placements=output_layouts, async_op=False)
        return outputs.to_local() if use_local_output else outputs


# --- 2. activation checkpointing --------------------------------------------------------------------------

def apply_ac(model: nn.Module, mode: bool | str = True, lora_compute_dtype: str = "base") -> None:
    """Checkpoint decoder layers: HF's per-layer hook keeps module and parameter names unchanged
    (PEFT keys, checkpoints); non-reentrant, so LoRA weights inside a layer get gradients although its
    input needs none. `mode` True: every layer; "auto": as many as `ActivationMemory.fit` decides per
    micro-batch (the model's `graft_activation_memory`), measured on the update's forward
    (`graft.lora.fused`; `train.lora_compute_dtype`: at the 2-layer Qwen2.5-0.5B shape in bf16 a layer
    saves 82,048 bytes per token with its LoRA path in fp32, 64,960 in bf16)."""
    memory = None
    if mode == "auto":
        with fused_lora(model, lora_compute_dtype == "base"):
            memory = ActivationMemory.measure(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if memory is not None:
        memory.layers = decoder_layers(model)  # not the model's own flag, which HF sets too and never reads
        model.graft_activation_memory = memory


# --- 3. compile -------------------------------------------------------------------------------------------

def apply_compile(model: nn.Module) -> None:
    """`torch.compile` each decoder layer (its module's call, so hooks, names and HF's per-layer
    checkpointing stay as they are; a checkpointed layer recomputes through the compiled code). The
    layers share one compiled graph per mode: their code is the same and parameters are inputs, and the
    LoRA layers' fused forward is a class attribute with its mode a value (`graft.lora.fused`), not a
    per-layer object Dynamo would guard by identity. New shapes recompile once, then as dynamic."""
    for layer in decoder_layers(model):
        layer.compile()


# --- 4. FSDP2 ---------------------------------------------------------------------------------------------

def mixed_precision(model: nn.Module):
    """FSDP2's `MixedPrecisionPolicy` for `model`: None (full fp32) when the base is fp32; with a
    bf16/fp16 base (`model.dtype`), compute in that dtype and reduce gradients in fp32.

    The stored weights keep their own dtypes: the frozen base in bf16 (half the memory of fp32), the
    LoRA factors in fp32 (PEFT upcasts adapters on a half-precision base), so their gradients
    (reduce-scattered in fp32 into fp32 shards) and AdamW's state are fp32: an update smaller than
    bf16's resolution of a weight is not lost. Each forward all-gathers the LoRA factors cast to the
    base's dtype: every matmul runs in bf16 and no fp32 copy of a layer's input is saved for the
    backward (one process, without FSDP2, PEFT computes the LoRA path in fp32 instead).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = model_dtype(model)
    if dtype == torch.float32:
        return None
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def apply_fsdp(model: nn.Module, ctx: Dist) -> nn.Module:
    """FSDP2 over the data-parallel ranks: each decoder layer is one unit, the rest the root.
    Gradients are summed over ranks, not averaged: the loss of each rank's slice is already divided
    by the whole batch's divisor."""
    if ctx.dp_size == 1:
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = ctx.mesh["dp"] if ctx.mesh is not None else init_device_mesh(mesh_device(), (ctx.world_size,))
    policy = mixed_precision(model) or MixedPrecisionPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):  # neither setter is recursive: every unit
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    # FSDP2 fixes each unit's trainable parameters, and with them the dtype its gradients are cast
    # to, at the first forward. That must not be a reference forward: PEFT's disable_adapter turns
    # the LoRA factors' requires_grad off, and bf16 gradients then reached the fp32 LoRA shards
    # (a RuntimeError at the first backward). One token, adapter on, on every rank, now.
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=ctx.device), use_cache=False)
    reshard(model)
    return model


def reshard(model: nn.Module) -> None:
    """Free the unsharded parameters FSDP2 still holds after a forward without a backward: the root
    unit keeps its own (embeddings, head) after each forward, expecting the backward, so after an
    initialising, probe or verification forward every rank would hold them whole until the next step.
    A no-op on a model that is not sharded."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def reduce_unused_as_zeros(model: nn.Module) -> None:
    """Every FSDP2 unit of `model` reduce-scatters zeros for a parameter without a gradient on this rank,
    so ranks whose passes touched different parameters (tenants absent from one rank's datums) still
    reduce the same ones."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_reduce_scatter_unused_params(True, recurse=False)
