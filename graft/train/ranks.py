"""The rank protocol of a sharded run: rank 0 drives, the other ranks follow its announced collectives.

No rank holds the model whole. Rank 0 keeps its shard and the LoRA tensors gathered after each step
(megabytes); that is all adapter publishing needs. Every collective outside the update's own is
announced by one small broadcast (`Op` and its integer arguments), and the followers (`follow`) run
the same function as rank 0 on their shard. The order of collectives is therefore the same on every
rank by construction, whatever rank 0's control flow decides (verification on or off, a pool that
dropped a member verifies on fewer engines, a refused version stops before publishing).

What rank 0 announces: the policy's updates and checkpoints (`graft.train.policy.PolicyState`), and
the sync's reads of the sharded model (`ShardedSource`), which need base weights and so are
collectives every rank runs:

- merged publishing streams module by module: every rank gathers each module's base weight (and its
  LoRA factors) whole with `full_tensor`, rank 0 merges it (graft's fp32 zero-drift merge, the
  one-process code on the same whole tensors, so the bytes are the one-process run's) and writes it;
- the non-finite guard and delivery verification run their forward on the sharded model: rank 0
  broadcasts the tokens (the probe; the engine's greedy completion of it, known only after the sync),
  every rank runs the forward, rank 0 compares. Verification thus still checks the policy just
  published, after every sync and before any rollout uses it, on the model the next step trains.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from enum import IntEnum
from typing import Protocol

import torch
from torch import nn

from graft.lora.adapter_io import AdapterWeights, adapter_layout, adapter_weights
from graft.lora.merge import iter_merged_weights, run_merge_gathers
from graft.parallel.dist import Dist, broadcast_ints, full_tensor
from graft.parallel.parallelize import reshard
from graft.rl.logprobs import sequence_logprobs
from graft.sync.source import probe_logits_finite
from graft.train.rollout_batch import RolloutBatch

# Merged weights travel in one of these (its index is the command's argument).
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_ARGS = 3  # integer arguments of every command


class Op(IntEnum):
    """What rank 0 asks the other ranks to join next."""

    STOP = 0  # the run is over: leave `follow`
    LEARN = 1  # (step): `PolicyState.learn`
    CHECKPOINT = 2  # (step): `PolicyState.maybe_checkpoint`
    MERGED = 3  # (dtype index): the gathers of the merged stream
    LOGPROBS = 4  # (prompt length, completion length): a teacher-forced forward
    PROBE = 5  # (probe length): the guard's forward


def announce(op: Op, *args: int) -> None:
    """Rank 0: tell the other ranks which collective comes next."""
    broadcast_ints([int(op), *args, *[0] * (_ARGS - len(args))], 1 + _ARGS)


def next_command() -> tuple[Op, list[int]]:
    """Ranks > 0: wait for rank 0's next command."""
    op, *args = broadcast_ints(None, 1 + _ARGS)
    return Op(op), args


class Follower(Protocol):
    """What a rank > 0 follows with: its rank, its shard of the model, and the policy's collectives
    (`graft.train.policy.PolicyState`)."""

    ctx: Dist
    model: nn.Module

    def learn(self, batch: RolloutBatch | None, step: int) -> dict: ...

    def maybe_checkpoint(self, step: int) -> None: ...


def follow(follower: Follower) -> None:
    """Ranks > 0: join rank 0's collectives (updates, checkpoints, the sync's reads of the sharded
    model), in the order it announces them, until it announces `Op.STOP`."""
    assert follower.ctx.active and not follower.ctx.is_main
    while True:
        op, args = next_command()
        if op is Op.STOP:
            return
        _FOLLOWERS[op](follower, args)


def _follow_learn(follower: Follower, args: list[int]) -> None:
    follower.learn(None, args[0])


def _follow_checkpoint(follower: Follower, args: list[int]) -> None:
    follower.maybe_checkpoint(args[0])


def _follow_merged(follower: Follower, args: list[int]) -> None:
    run_merge_gathers(follower.model, _DTYPES[args[0]], full_tensor)


def _follow_logprobs(follower: Follower, args: list[int]) -> None:
    _logprobs(follower.model, None, args[0], args[1])


def _follow_probe(follower: Follower, args: list[int]) -> None:
    _probe(follower.model, None, args[0])


# What a rank > 0 runs for each announced collective (its results are rank 0's).
_FOLLOWERS: dict[Op, Callable[[Follower, list[int]], None]] = {
    Op.LEARN: _follow_learn,
    Op.CHECKPOINT: _follow_checkpoint,
    Op.MERGED: _follow_merged,
    Op.LOGPROBS: _follow_logprobs,
    Op.PROBE: _follow_probe,
}


class ShardedSource:
    """Rank 0's `graft.sync.source.PolicySource` over an FSDP2-sharded policy (see the module docstring).

    Args:
        model: the sharded PEFT model (its tree gives configs and names; its shards the base weights).
        lora: the LoRA tensors gathered after the last step, by training name; the owner updates it
            in place (`PolicyState`).
    """

    def __init__(self, model: nn.Module, lora: dict[str, torch.Tensor]) -> None:
        self.model = model
        self._lora = lora

    def lora_tensors(self) -> dict[str, torch.Tensor]:
        return dict(self._lora)

    def adapter(self) -> AdapterWeights:
        """From the gathered LoRA tensors: no collective, no base weight read."""
        return adapter_weights(self._lora, adapter_layout(self.model))  # the layout checks the model first

    def merged_weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """Announced when the writer starts reading: the other ranks gather module by module with us."""
        announce(Op.MERGED, _DTYPES.index(dtype))
        yield from iter_merged_weights(self.model, dtype, gather=full_tensor)

    async def read(self, read):
        """Here and now: the ranks' collectives follow rank 0's calls (the trainer waits for the check
        before the next update in a sharded run)."""
        return read()

    def logprobs(self, prompt: Sequence[int], completion: Sequence[int]) -> list[float]:
        announce(Op.LOGPROBS, len(prompt), len(completion))
        return _logprobs(self.model, [*prompt, *completion], len(prompt), len(completion))

    def probe_logits_finite(self, probe: Sequence[int]) -> bool:
        announce(Op.PROBE, len(probe))
        return _probe(self.model, list(probe), len(probe))


def _logprobs(model: nn.Module, ids: list[int] | None, n_prompt: int, n_completion: int) -> list[float]:
    """Every rank: rank 0's prompt + completion, teacher-forced on the sharded model."""
    ids = broadcast_ints(ids, n_prompt + n_completion)
    logprobs = sequence_logprobs(model, ids[:n_prompt], ids[n_prompt:])
    reshard(model)  # no backward follows: drop the root unit's whole weights now
    return logprobs


def _probe(model: nn.Module, probe: list[int] | None, n: int) -> bool:
    """Every rank: rank 0's probe, one eval-mode forward on the sharded model."""
    finite = probe_logits_finite(model, broadcast_ints(probe, n))
    reshard(model)  # no backward follows: drop the root unit's whole weights now
    return finite
