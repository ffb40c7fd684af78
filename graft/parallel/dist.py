"""Where this process stands in a run and what ranks exchange: the process group, the (dp, tp) mesh,
and the collectives (broadcasts of tensors and integers, gathers, the gradient norm).

`torchrun --nproc-per-node N graft train CONFIG` starts N ranks on a 2-D mesh (dp, tp): `dist.tp`
ranks share each decoder layer (tensor parallel) and see the same rows; the N / tp data-parallel
groups split each batch's rows. Rank 0 alone talks to the engines (rollouts, sync, verification)
and writes the run directory; every rank holds a shard of the model (`graft.parallel.parallelize`).
Nothing here knows about losses or LoRA math; the trainer calls these collectives in the same order
on every rank. Without torchrun (`WORLD_SIZE` unset) everything is a no-op on one process. What ranks
exchange travels as tensors, never pickled; the trainer's batch is broadcast by graft.train.batch_broadcast.
"""

from __future__ import annotations

import datetime
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# Rank 0 may wait for a slow rollout or sync while the others block in a collective.
_COLLECTIVE_TIMEOUT = datetime.timedelta(hours=2)


@dataclass(frozen=True)
class Dist:
    """This process's place in the run: `rank` of `world_size`, on the (dp, tp) `mesh` (row-major:
    rank = dp_rank * tp + tp_rank, so the ranks of one TP group are neighbours, e.g. one node's GPUs).

    `mesh` is None on one process, and may be on a pure data-parallel run (`tp` 1: `apply_fsdp`
    then builds a 1-D one); `mesh_dist` builds it.
    """

    rank: int = 0
    world_size: int = 1
    tp: int = 1
    mesh: object = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        assert self.tp == 1 or self.mesh is not None, "tensor parallel needs the (dp, tp) mesh: use mesh_dist"

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: each batch's rows are split over these."""
        return self.world_size // self.tp

    @property
    def dp_rank(self) -> int:
        """Which share of the rows this rank trains on (the same for the ranks of one TP group)."""
        return self.rank // self.tp

    @property
    def is_main(self) -> bool:
        """Rank 0: the only rank that talks to engines and writes files."""
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def device(self) -> torch.device:
        """Where this rank trains: its GPU (one per rank) on one process with CUDA or under NCCL; the
        CPU otherwise. Ranks on gloo train on the CPU even where a GPU is visible: gloo's FSDP2 and TP
        collectives move CPU tensors, and `init_distributed` picks gloo when there are fewer GPUs
        than ranks on a node."""
        on_gpu = mesh_device() == "cuda" if self.active and dist.is_initialized() else torch.cuda.is_available()
        return torch.device("cuda", _local_rank()) if on_gpu else torch.device("cpu")

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over the data-parallel ranks (the ranks of one TP group hold the same
        rows, so the same values: summing over them would count each row `tp` times)."""
        return self._all_reduce(values, dist.ReduceOp.SUM, self._dp_group())

    def max(self, values: list[float]) -> list[float]:
        """Element-wise max over ranks."""
        return self._all_reduce(values, dist.ReduceOp.MAX)

    def _all_reduce(self, values: list[float], op, group=None) -> list[float]:
        if not self.active:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=_comm_device())
        dist.all_reduce(t, op=op, group=group)
        return t.tolist()

    def _dp_group(self):
        """The process group of this rank's data-parallel peers; None (the world) without TP."""
        return self.mesh.get_group("dp") if self.tp > 1 else None

    def barrier(self) -> None:
        if self.active:
            dist.barrier()


def _comm_device() -> torch.device:
    """NCCL moves only GPU tensors; gloo CPU ones."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_world_size(world_size: int, tp: int) -> None:
    """Before any process group exists: a mesh of `world_size` ranks with TP groups of `tp`.

    Raises:
        ValueError: `world_size` is not a multiple of `tp`.
    """
    if world_size % tp:
        raise ValueError(f"dist.tp={tp} does not divide the world size {world_size} (torchrun's ranks): the "
                         f"data-parallel size is world size / dist.tp; launch a multiple of {tp} ranks")


def init_distributed(backend: str = "auto", tp: int = 1) -> Dist:
    """Join the torchrun process group if there is one (gloo on CPU, NCCL on GPU for `auto`), on a
    (world size / tp, tp) mesh.

    Raises:
        ValueError: `nccl` asked for without CUDA, or a world size `tp` does not divide (both before
            any process group work).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    check_world_size(world_size, tp)
    if world_size == 1:
        return Dist()
    if backend == "auto":
        backend = auto_backend()
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("dist.backend 'nccl' needs CUDA GPUs; use 'gloo' (or 'auto') on CPU")
    if not dist.is_initialized():
        if backend == "nccl":
            torch.cuda.set_device(_local_rank())
        dist.init_process_group(backend=backend, timeout=_COLLECTIVE_TIMEOUT)
    return mesh_dist(tp)


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def auto_backend() -> str:
    """`dist.backend: auto`: NCCL when this node has a GPU for each of its ranks, else gloo (on the
    CPU). NCCL cannot put two ranks on one GPU ("Duplicate GPU detected"), so a node with fewer GPUs
    than ranks, e.g. a test spawning 2 ranks on a one-GPU machine, trains on the CPU."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks else "gloo"


def mesh_dist(tp: int = 1) -> Dist:
    """This process's `Dist` in the initialised default process group, with its (dp, tp) DeviceMesh.
    A collective (the mesh creates the dp and tp groups): every rank calls it, in the same order.

    Raises:
        ValueError: `tp` does not divide the world size.
    """
    from torch.distributed.device_mesh import init_device_mesh

    rank, world_size = dist.get_rank(), dist.get_world_size()
    check_world_size(world_size, tp)
    mesh = init_device_mesh(mesh_device(), (world_size // tp, tp), mesh_dim_names=("dp", "tp"))
    return Dist(rank, world_size, tp, mesh)


def mesh_device() -> str:
    """The device type of this process group's meshes: NCCL's GPUs or gloo's CPU."""
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def shutdown_distributed(ctx: Dist) -> None:
    if ctx.active and dist.is_initialized():
        dist.destroy_process_group()


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float, ctx: Dist) -> float:
    """Scale the gradients of `params` to a global norm of at most `max_norm`; the global norm (the
    one-process norm of the whole gradients, on every rank).

    Sharded, every rank joins ONE all-reduce of its local shards' squared norms over the whole mesh,
    each weighted by how many ranks hold the same elements (a tp-replicated lora_A counts once), also
    when it holds no gradient at all (it adds zero). torch's `clip_grad_norm_` returns early on a rank
    without gradients — the others then wait forever in its all-reduce — and cannot stack the norms of
    DTensors on different meshes (the 2-D LoRA factors beside 1-D ones).
    """
    params = list(params)
    if not ctx.active:
        return torch.nn.utils.clip_grad_norm_(params, max_norm).item()
    from torch.distributed.tensor import DTensor

    squares = torch.zeros((), dtype=torch.float64, device=_comm_device())
    for param in params:
        if param.grad is None:  # contributes zero; the all-reduce below is joined all the same
            continue
        grad = param.grad
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        squares += local.detach().double().pow(2).sum().to(squares.device) * _replication_weight(grad, ctx)
    dist.all_reduce(squares)
    norm = squares.sqrt().item()
    coef = max_norm / (norm + 1e-6)  # torch's clip coefficient
    if coef < 1.0:
        for param in params:
            if param.grad is not None:
                param.grad.mul_(coef)
    return norm


def _replication_weight(grad: torch.Tensor, ctx: Dist) -> float:
    """1 / the number of ranks that hold each element of `grad`: a DTensor's shards split its elements
    over the mesh dimensions it is sharded on and repeat them over the rest of the world."""
    placements = getattr(grad, "placements", None)
    if placements is None:  # a plain tensor: the same on every rank
        return 1.0 / ctx.world_size
    assert not any(p.is_partial() for p in placements), f"a partial gradient: {placements}"
    shards = math.prod(grad.device_mesh.size(i) for i, p in enumerate(placements) if not p.is_replicate())
    return shards / ctx.world_size


def _broadcast(tensor: torch.Tensor) -> torch.Tensor:
    """Rank 0's `tensor` on every rank, back on the CPU."""
    on_device = tensor.to(_comm_device())
    dist.broadcast(on_device, src=0)
    return on_device.cpu()


def broadcast_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Rank 0's `tensor` on every rank (the others pass one of its shape and dtype), on the CPU."""
    return _broadcast(tensor)


def all_reduce_sum(tensor: torch.Tensor) -> None:
    """`tensor` summed element-wise over every rank of the world, in place, on its own device (a
    collective; `Dist.sum` sums over the data-parallel ranks only)."""
    dist.all_reduce(tensor)


def all_reduce_max(tensor: torch.Tensor) -> None:
    """`tensor` maxed element-wise over every rank of the world, in place, on its own device (a collective)."""
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a possibly FSDP2-sharded (DTensor) one; a collective on DTensors."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`full` laid out like `like`: this rank's shard of it when `like` is an FSDP2 DTensor (a collective:
    every rank calls it with the same `full`), else `full` itself. The inverse of `full_tensor`."""
    if not hasattr(like, "device_mesh"):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, like.device_mesh, like.placements)


def broadcast_ints(values: list[int] | None, n: int) -> list[int]:
    """Rank 0's `n` integers on every rank (`values` is None on the others): commands and token ids,
    as tensors, never pickled."""
    tensor = torch.tensor(list(values), dtype=torch.long) if values is not None else torch.zeros(n, dtype=torch.long)
    assert tensor.numel() == n, (tensor.numel(), n)
    return _broadcast(tensor).tolist()
