"""Tensor-parallel LoRA on a 2-D (dp, tp) mesh over CPU ranks (gloo) gives the single-process update:
tp=2 on 2 ranks and dp=2 x tp=2 on 4 ranks, 3 updates with mini-batches, micro-batches, KL, entropy
and TIS: the same losses, grad norms, stats and LoRA weights (<= 1e-5), also when a data-parallel
rank has no rows. Every collective runs under a short process-group timeout, so a hang (the seed's
deadlocks) fails the test instead of stalling it."""

import datetime
import json

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from graft.models.tiny import build_tiny_model
from graft.train.distributed import Dist, mesh_dist
from tests.train.test_distributed import _COMPARED, _updates

# A hang fails within this instead of stalling the suite (a 4-rank update takes seconds).
_TIMEOUT = datetime.timedelta(seconds=120)


@pytest.fixture(scope="module")
def tp_model_dirs(tmp_path_factory) -> dict[str, object]:
    """arch -> a tiny fp32 model TP can split by 2: hidden 128 (4 heads, 2 KV heads, MLP 384), 2 layers."""
    root = tmp_path_factory.mktemp("tiny-tp")
    return {arch: build_tiny_model(root / arch, arch=arch, hidden=128, layers=2, seed=0) for arch in ("qwen2", "llama")}


def init_gloo(rank: int, world: int, init_file) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=_TIMEOUT)


def _rank_main(rank: int, world: int, tp: int, model_dir, out_dir, n_prompts, group, overrides) -> None:
    init_gloo(rank, world, out_dir / "rendezvous")
    try:
        metrics, weights = _updates(model_dir, mesh_dist(tp), n_prompts, group, overrides)
        if rank == 0:
            (out_dir / "metrics.json").write_text(json.dumps(metrics))
            safetensors.torch.save_file(weights, out_dir / "lora.safetensors")
    finally:
        dist.destroy_process_group()


def _assert_mesh_like_one(model_dir, tmp_path, world, tp, n_prompts, group, overrides) -> None:
    mp.spawn(_rank_main, args=(world, tp, model_dir, tmp_path, n_prompts, group, overrides), nprocs=world, join=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank: same kernels, same rounding
    try:
        single_metrics, single_weights = _updates(model_dir, Dist(), n_prompts, group, overrides)
    finally:
        torch.set_num_threads(threads)
    sharded_metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert len(sharded_metrics) == len(single_metrics)
    for single, sharded in zip(single_metrics, sharded_metrics):
        for key in _COMPARED:
            assert sharded[key] == pytest.approx(single[key], rel=1e-5, abs=1e-6), key
    assert all(m["grad_norm"] > 0 for m in single_metrics)
    sharded_weights = safetensors.torch.load_file(tmp_path / "lora.safetensors")
    assert sharded_weights.keys() == single_weights.keys()
    for name, weight in single_weights.items():
        torch.testing.assert_close(sharded_weights[name], weight, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


# Adam lr 1e-3 (not 1e-2): see the weight tolerance in test_distributed.py.
_MENU = ["train.mini_batches=2", "train.tis_cap=2.0", "train.max_tokens_per_micro_batch=16", "train.lr=1e-4"]


@pytest.mark.parametrize("arch, n_prompts, group, overrides", [
    ("qwen2", 4, 2, _MENU),
    ("llama", 3, 3, [*_MENU, "train.pack_sequences=false", "train.activation_checkpointing=false"]),
])
def test_tp2_on_two_ranks_updates_like_one(tp_model_dirs, tmp_path, arch, n_prompts, group, overrides):
    _assert_mesh_like_one(tp_model_dirs[arch], tmp_path, 2, 2, n_prompts, group, overrides)


@pytest.mark.parametrize("n_prompts, group, overrides", [
    (4, 2, _MENU),
    (1, 1, ["train.max_tokens_per_micro_batch=4", "train.tis_cap=2.0", "train.lr=1e-4"]),  # dp rank 1 (ranks 2, 3) has no rows
])
def test_dp2_tp2_on_four_ranks_updates_like_one(tp_model_dirs, tmp_path, n_prompts, group, overrides):
    _assert_mesh_like_one(tp_model_dirs["qwen2"], tmp_path, 4, 2, n_prompts, group, overrides)
