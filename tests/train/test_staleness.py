"""RolloutProducer: the staleness bound holds, the producer runs ahead only as far as it allows."""

import asyncio

import pytest
import torch

from graft.sync.served import ServedVersion
from graft.train.rollout_batch import RolloutBatch
from graft.train.staleness import RolloutProducer


def _batch(version: int) -> RolloutBatch:
    return RolloutBatch([([1], [2])], [[-1.0]], torch.zeros(1, 1), version, 0.01)


async def _served(version: int) -> ServedVersion:
    served = ServedVersion()
    await served.release(version)
    return served


async def _run(max_staleness: int, steps: int, train_seconds: float) -> tuple[list[tuple[int, int]], list[int]]:
    """A fake trainer: takes each batch, 'trains' for a while, publishes the next version.
    Returns (step, version of its batch) and, per step, how many batches were started by then."""
    started: list[int] = []

    async def make_batch(step: int, version: int) -> RolloutBatch:
        started.append(step)
        await asyncio.sleep(0.01)
        return _batch(version)

    seen, ahead = [], []
    served = await _served(0)
    async with RolloutProducer(make_batch, served=served, max_staleness=max_staleness, first_step=1,
                               last_step=steps) as producer:
        for step in range(1, steps + 1):
            batch = await producer.get(step)
            seen.append((step, batch.version))
            await asyncio.sleep(train_seconds)
            ahead.append(len(started) - step)
            await served.release(step)
    assert producer.dropped == 0
    return seen, ahead


def test_staleness_zero_is_on_policy_and_never_runs_ahead():
    seen, ahead = asyncio.run(_run(0, 5, 0.03))
    assert seen == [(s, s - 1) for s in range(1, 6)]
    assert max(ahead) == 0


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_bounded_staleness_overlaps_rollout_and_training_within_the_bound(max_staleness):
    seen, ahead = asyncio.run(_run(max_staleness, 8, 0.05))
    lags = [(step - 1) - version for step, version in seen]
    assert max(lags) <= max_staleness
    assert max(lags) == max_staleness  # it does use the slack: rollout overlaps training
    assert max(ahead) == max_staleness


def test_a_batch_beyond_the_bound_is_never_returned():
    calls = []

    async def make_batch(step: int, version: int) -> RolloutBatch:
        calls.append((step, version))
        return _batch(version)

    async def main():
        async with RolloutProducer(make_batch, served=await _served(0), max_staleness=0, first_step=1,
                                   last_step=1) as producer:
            await producer._queue.put(_batch(version=-3))  # a stale batch jumps the queue
            batch = await producer.get(1)
            return batch, producer.dropped

    batch, dropped = asyncio.run(main())
    assert dropped == 1 and batch.version == 0 and (1, 0) in calls


def test_a_failing_rollout_reaches_the_trainer():
    async def make_batch(step: int, version: int) -> RolloutBatch:
        raise RuntimeError("engine fell over")

    async def main():
        async with RolloutProducer(make_batch, served=await _served(0), max_staleness=1, first_step=1,
                                   last_step=3) as producer:
            await producer.get(1)

    with pytest.raises(RuntimeError, match="engine fell over"):
        asyncio.run(main())
