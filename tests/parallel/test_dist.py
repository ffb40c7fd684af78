"""The process group's collectives over CPU ranks (gloo): the gradient norm is the whole one on every
rank, also on a rank that holds no gradient. Every collective runs under a short process-group
timeout, so a hang fails the test instead of stalling it."""

import datetime
import json

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor

from graft.parallel.dist import Dist, auto_backend, clip_grad_norm, mesh_dist
from tests.spawn import spawn_ranks

# A hang fails within this instead of stalling the suite (a 4-rank update takes seconds).
_TIMEOUT = datetime.timedelta(seconds=120)


def init_gloo(rank: int, world: int, init_file) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=_TIMEOUT)


def _grad_norm_rank(rank: int, out_dir) -> None:
    init_gloo(rank, 2, out_dir / "rendezvous")
    try:
        ctx = mesh_dist(1)
        # One row sharded over 2 ranks: rank 1's shard is empty and gets no gradient at all.
        param = torch.nn.Parameter(distribute_tensor(torch.tensor([[3.0, 4.0]]), ctx.mesh["dp"], [Shard(0)]))
        if rank == 0:
            param.grad = distribute_tensor(torch.tensor([[3.0, 4.0]]), ctx.mesh["dp"], [Shard(0)])
        else:  # what the other rank's distribute_tensor above needs; then no gradient here
            distribute_tensor(torch.tensor([[3.0, 4.0]]), ctx.mesh["dp"], [Shard(0)])
        norm = clip_grad_norm([param], 1.0, ctx)
        clipped = param.grad.to_local().norm().item() if param.grad is not None else None
        (out_dir / f"rank{rank}.json").write_text(json.dumps({"norm": norm, "clipped": clipped}))
    finally:
        dist.destroy_process_group()


def test_grad_norm_joins_the_all_reduce_on_a_rank_without_gradients(tmp_path):
    """The seed's hang: torch's clip_grad_norm_ returns early on a rank with no gradients, while the
    others wait in the norm's all-reduce. Here rank 1 holds none, joins, contributes zero, and both
    ranks get the whole norm (5) and clip alike, well within the process group's timeout."""
    spawn_ranks(_grad_norm_rank, (tmp_path,), 2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["norm"] for r in ranks] == pytest.approx([5.0, 5.0])
    assert ranks[0]["clipped"] == pytest.approx(1.0, rel=1e-5) and ranks[1]["clipped"] is None


@pytest.mark.parametrize(("gpus", "local_ranks", "expected"), [(0, 1, "gloo"), (1, 1, "nccl"), (1, 2, "gloo"),
                                                               (4, 2, "nccl"), (2, 4, "gloo")])
def test_auto_backend_takes_nccl_only_with_a_gpu_for_each_rank_of_the_node(monkeypatch, gpus, local_ranks, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_ranks))
    assert auto_backend() == expected


@pytest.mark.parametrize("cuda", [False, True])
def test_one_process_trains_on_the_gpu_when_there_is_one(monkeypatch, cuda):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert Dist().device == (torch.device("cuda", 0) if cuda else torch.device("cpu"))


def _device_rank(rank: int, out_dir) -> None:
    init_gloo(rank, 2, out_dir / "rendezvous")
    try:
        torch.cuda.is_available = lambda: True  # a GPU is visible; the gloo ranks still train on the CPU
        (out_dir / f"rank{rank}.json").write_text(json.dumps({"device": str(mesh_dist(1).device)}))
    finally:
        dist.destroy_process_group()


def test_gloo_ranks_train_on_the_cpu_where_a_gpu_is_visible(tmp_path):
    spawn_ranks(_device_rank, (tmp_path,), nprocs=2)
    assert [json.loads((tmp_path / f"rank{r}.json").read_text())["device"] for r in range(2)] == ["cpu", "cpu"]
