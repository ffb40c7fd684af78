"""Where this process stands in a run and what ranks exchange: the process group, the (dp, tp) mesh,
and the collectives (batch broadcast, gathers, the gradient norm).

`torchrun --nproc-per-node N graft train CONFIG` starts N ranks on a 2-D mesh (dp, tp): `dist.tp`
ranks share each decoder layer (tensor parallel) and see the same rows; the N / tp data-parallel
groups split each batch's rows. Rank 0 alone talks to the engines (rollouts, sync, verification)
and writes the run directory; every rank holds a shard of the model (`graft.train.parallelize`).
Nothing here knows about losses or LoRA math; the trainer calls these collectives in the same order
on every rank. Without torchrun (`WORLD_SIZE` unset) everything is a no-op on one process. Batches
travel as tensors, never pickled.
"""

from __future__ import annotations

import datetime
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from graft.train.rollout_batch import RolloutBatch

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


def broadcast_batch(batch: RolloutBatch | None, ctx: Dist) -> RolloutBatch:
    """Rank 0's batch on every rank (as flat tensors: lengths, token ids, log-probs, rewards, truncation,
    and the loss masks of multi-turn episodes)."""
    if not ctx.active:
        assert batch is not None
        return batch
    if ctx.is_main:
        assert batch is not None
        lengths = [n for prompt, completion in batch.sequences for n in (len(prompt), len(completion))]
        flags = (batch.loss_masks is not None) + 2 * batch.mask_truncated
        header = torch.tensor([len(batch.sequences), *batch.rewards_PG.shape, batch.version, sum(lengths), flags],
                              dtype=torch.long)
    else:
        header = torch.zeros(6, dtype=torch.long)
    header = _broadcast(header)
    n_seq, n_prompts, group, version, n_tokens, flags = header.tolist()
    if ctx.is_main:
        lengths_t = torch.tensor(lengths, dtype=torch.long)
        ids_t = torch.tensor([t for p, c in batch.sequences for t in (*p, *c)], dtype=torch.long)
        logprobs_t = torch.tensor([x for lp in batch.engine_logprobs for x in lp], dtype=torch.float64)
        rewards_t = batch.rewards_PG.to(torch.float32).contiguous()
        truncated_t = torch.tensor(batch.truncated or [False] * n_seq, dtype=torch.long)
    else:
        lengths_t = torch.zeros(2 * n_seq, dtype=torch.long)
        ids_t = torch.zeros(n_tokens, dtype=torch.long)
        rewards_t = torch.zeros(n_prompts, group, dtype=torch.float32)
        truncated_t = torch.zeros(n_seq, dtype=torch.long)
    lengths_t, ids_t, rewards_t, truncated_t = (_broadcast(t) for t in (lengths_t, ids_t, rewards_t, truncated_t))
    n_completion = int(lengths_t[1::2].sum())
    if not ctx.is_main:
        logprobs_t = torch.zeros(n_completion, dtype=torch.float64)
    logprobs_t = _broadcast(logprobs_t)
    if flags & 1:
        masks_t = _broadcast(torch.tensor([m for mask in batch.loss_masks for m in mask], dtype=torch.long)
                             if ctx.is_main else torch.zeros(n_completion, dtype=torch.long))
    if ctx.is_main:
        return batch
    sequences, logprobs, at, at_lp = [], [], 0, 0
    for p_len, c_len in lengths_t.view(-1, 2).tolist():
        sequences.append((ids_t[at:at + p_len].tolist(), ids_t[at + p_len:at + p_len + c_len].tolist()))
        logprobs.append(logprobs_t[at_lp:at_lp + c_len].tolist())
        at, at_lp = at + p_len + c_len, at_lp + c_len
    masks = None
    if flags & 1:
        flat, masks = [bool(m) for m in masks_t.tolist()], []
        for _, completion in sequences:
            masks.append(flat[:len(completion)])
            flat = flat[len(completion):]
    return RolloutBatch(sequences, logprobs, rewards_t, version, seconds=0.0,
                        truncated=tuple(bool(t) for t in truncated_t.tolist()), loss_masks=masks,
                        mask_truncated=bool(flags & 2))


def _broadcast(tensor: torch.Tensor) -> torch.Tensor:
    """Rank 0's `tensor` on every rank, back on the CPU."""
    on_device = tensor.to(_comm_device())
    dist.broadcast(on_device, src=0)
    return on_device.cpu()


def broadcast_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Rank 0's `tensor` on every rank (the others pass one of its shape and dtype), on the CPU."""
    return _broadcast(tensor)


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
