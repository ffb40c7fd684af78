"""Mixed precision (`model.dtype: bfloat16`): the frozen base in bf16; the LoRA factors, their
gradients and AdamW's state in fp32, on one process and on 2 FSDP2 ranks; the LoRA path computed in
bf16 on both (`train.lora_compute_dtype: base`; FSDP2 also reduces gradients in fp32), in fp32 on one
process with `lora_compute_dtype: float32`."""

import json
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

import graft.lora.fused as fused_module
from graft.config import load_config
from graft.lora.attach import attach_lora, lora_parameters
from graft.models.loading import load_model
from graft.parallel.dist import Dist
from graft.parallel.parallelize import mixed_precision, parallelize
from graft.train.batch_broadcast import broadcast_batch
from graft.train.update import policy_update
from tests.helpers import randomize_lora
from tests.parallel.test_parallelize import _batch
from tests.spawn import spawn_ranks

WORLD = 2
_OVERRIDES = ["train.kl_coef=0.05", "train.entropy_coef=0.01", "train.lr=1e-2", "train.tis_cap=2.0"]


def _policy(model_dir, dtype: str):
    model = attach_lora(load_model(model_dir, dtype=dtype), rank=8, alpha=16, seed=0)
    randomize_lora(model, 1)
    return model


def _update_recording_dtypes(model_dir, dtype: str, ctx: Dist, overrides: tuple[str, ...] = (),
                             device: str = "cpu") -> dict:
    """Two updates of a `dtype` policy; the dtypes of the LoRA path's matmuls in the forward (the
    factor `lora_B` as the fused sum multiplies it, or as its module runs where the sum is PEFT's: tensor
    parallel), of the factors' gradients at the optimizer step, and of the AdamW state; the metrics."""
    train = load_config(None, [*_OVERRIDES, *overrides]).train
    model = parallelize(_policy(model_dir, dtype).to(device), ctx)
    params = lora_parameters(model)
    optimizer = torch.optim.AdamW(params.values(), lr=train.lr)
    seen = {"forward": set(), "grad": set()}
    real_addmm = torch.addmm

    def addmm(result, xa, weight_B, **kwargs):
        seen["forward"].add(str(weight_B.dtype))
        return real_addmm(result, xa, weight_B, **kwargs)

    for name, module in model.named_modules():
        if name.endswith("lora_B.default"):
            module.register_forward_pre_hook(lambda module, _: seen["forward"].add(str(module.weight.dtype)))
    optimizer.register_step_pre_hook(
        lambda *_: seen["grad"].update(str(p.grad.dtype) for p in params.values() if p.grad is not None))
    metrics = []
    for step in range(2):
        batch = broadcast_batch(_batch(3, 3, seed=step) if ctx.is_main else None, ctx)
        with mock.patch.object(fused_module.torch, "addmm", addmm):
            metrics.append(policy_update(model, optimizer, batch, train, pad_id=0, ctx=ctx))
    base = {str(p.dtype) for name, p in model.named_parameters() if name not in params}
    stored = {str(p.dtype) for p in params.values()}
    state = {str(v.dtype) for s in optimizer.state.values() for v in s.values() if v.is_floating_point() and v.dim()}
    return {**{k: sorted(v) for k, v in seen.items()}, "base": sorted(base), "lora": sorted(stored),
            "adamw": sorted(state), "metrics": [{k: m[k] for k in ("loss", "grad_norm", "kl")} for m in metrics]}


def test_policy_of_the_base_dtype():
    """fp32 base: FSDP2's default (no casts); bf16 base: compute in bf16, reduce gradients in fp32."""
    fp32, bf16 = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).to(torch.bfloat16)
    assert mixed_precision(fp32) is None
    assert mixed_precision(bf16) == MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


@pytest.mark.parametrize("lora_compute_dtype", ["base", "float32"])
def test_one_process_bf16_base_trains_fp32_lora_close_to_fp32(tiny_model_dirs, lora_compute_dtype):
    model_dir = tiny_model_dirs["qwen2"]
    bf16 = _update_recording_dtypes(model_dir, "bfloat16", Dist(), (f"train.lora_compute_dtype={lora_compute_dtype}",))
    fp32 = _update_recording_dtypes(model_dir, "float32", Dist())
    assert bf16["base"] == ["torch.bfloat16"]
    assert fp32["forward"] == ["torch.float32"]
    assert bf16["forward"] == ["torch.bfloat16" if lora_compute_dtype == "base" else "torch.float32"]
    for key in ("lora", "grad", "adamw"):
        assert bf16[key] == ["torch.float32"], key
    for a, b in zip(fp32["metrics"], bf16["metrics"]):
        for key in ("loss", "grad_norm", "kl"):  # bf16 rounding of the base path, not a different update
            assert b[key] == pytest.approx(a[key], rel=0.05, abs=1e-3), key


@pytest.mark.gpu
def test_on_cuda_a_bf16_base_computes_the_lora_path_in_bf16_and_updates_as_on_the_cpu(tiny_model_dirs):
    model_dir = tiny_model_dirs["qwen2"]
    cuda = _update_recording_dtypes(model_dir, "bfloat16", Dist(), device="cuda")
    cpu = _update_recording_dtypes(model_dir, "bfloat16", Dist())
    assert cuda["forward"] == ["torch.bfloat16"]
    for key in ("lora", "grad", "adamw"):
        assert cuda[key] == ["torch.float32"], key
    for a, b in zip(cpu["metrics"], cuda["metrics"]):
        for key in ("loss", "grad_norm", "kl"):  # different bf16 kernels, the same update
            assert b[key] == pytest.approx(a[key], rel=0.05, abs=1e-3), key


def _rank_main(rank: int, model_dir, out_dir, init_file) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        recorded = _update_recording_dtypes(model_dir, "bfloat16", Dist(rank, WORLD))
        (out_dir / f"rank{rank}.json").write_text(json.dumps(recorded))
    finally:
        dist.destroy_process_group()


def test_two_ranks_compute_in_bf16_and_keep_fp32_lora_gradients_and_state(tiny_model_dirs, tmp_path):
    model_dir = tiny_model_dirs["qwen2"]
    spawn_ranks(_rank_main, (model_dir, tmp_path, tmp_path / "rendezvous"), WORLD)
    single = _update_recording_dtypes(model_dir, "float32", Dist())
    for rank in range(WORLD):
        sharded = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert sharded["forward"] == ["torch.bfloat16"]  # all-gathered cast to the compute dtype
        assert sharded["base"] == ["torch.bfloat16"]
        for key in ("lora", "grad", "adamw"):
            assert sharded[key] == ["torch.float32"], (rank, key)
        for a, b in zip(single["metrics"], sharded["metrics"]):
            for key in ("loss", "grad_norm", "kl"):
                assert b[key] == pytest.approx(a[key], rel=0.05, abs=1e-3), (rank, key)
