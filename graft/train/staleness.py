"""The rollout producer: generates batches ahead of the trainer, with bounded staleness.

The batch for step t (which trains version t-1 into version t) may come from any policy version
v >= t - 1 - max_staleness. The producer starts the batch for step t as soon as such a version is
served and samples with the newest served version, so with `max_staleness: 0` rollout and training
alternate (fully on-policy) and with s > 0 up to s + 1 batches are generated while the trainer
updates. Every batch is tagged with its version; the consumer drops a batch staler than the bound
(it cannot happen by construction, but the bound is a promise, so it is enforced where it matters).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from graft.sync.served import ServedVersion
from graft.train.rollout_batch import RolloutBatch

# make_batch(step, version) -> the batch for `step`, sampled from policy `version`
# (`graft.train.batch_maker.BatchMaker.make`).
MakeBatch = Callable[[int, int], Awaitable[RolloutBatch]]


class RolloutProducer:
    """Background task producing the batches of steps `first_step..last_step` in order.

    Args:
        make_batch: Samples and scores the batch of a step with a given policy version.
        served: The version rollouts may use (released by the trainer after each sync); each
            batch is sampled from the newest one served when it starts.
        max_staleness: The bound s; the batch of step t is never sampled from a version < t-1-s.
        first_step, last_step: The steps to produce (inclusive).
        engine_lock: Held while a batch is generated; a sync that must not interleave with
            generation (a merged-weight reload) takes it too, so one batch is one version.
    """

    def __init__(self, make_batch: MakeBatch, *, served: ServedVersion, max_staleness: int, first_step: int,
                 last_step: int, engine_lock: asyncio.Lock | None = None) -> None:
        self._make_batch = make_batch
        self._served = served
        self.max_staleness = max_staleness
        self._steps = range(first_step, last_step + 1)
        self._queue: asyncio.Queue[RolloutBatch | BaseException] = asyncio.Queue()
        self.engine_lock = engine_lock or asyncio.Lock()
        self._task: asyncio.Task | None = None
        self.dropped = 0  # batches refused for staleness

    async def __aenter__(self) -> RolloutProducer:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def get(self, step: int) -> RolloutBatch:
        """The batch for `step`, sampled from a version within the bound (regenerated if not)."""
        batch = await self._queue.get()
        if isinstance(batch, BaseException):
            raise batch
        if self.is_too_stale(batch, step):
            self.dropped += 1
            async with self.engine_lock:
                batch = await self._make_batch(step, self._served.version)
        return batch

    def is_too_stale(self, batch: RolloutBatch, step: int) -> bool:
        return (step - 1) - batch.version > self.max_staleness

    async def _run(self) -> None:
        try:
            for step in self._steps:
                version = await self._served.at_least(step - 1 - self.max_staleness)
                async with self.engine_lock:
                    batch = await self._make_batch(step, version)
                await self._queue.put(batch)
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # handed to the trainer, which raises it at its next get()
            await self._queue.put(error)
