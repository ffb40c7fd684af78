"""InFlightVersions: per-version counts, nesting, release on error and cancellation, and
`wait_idle` waking exactly when the last user of a version leaves (event based, no polling)."""

from __future__ import annotations

import asyncio

import pytest

from graft.sync.inflight import InFlightVersions


def run(coroutine):
    return asyncio.run(coroutine)


def test_counts_nested_uses_per_version():
    async def main():
        inflight = InFlightVersions()
        assert inflight.count(1) == 0 and inflight.busy() == set()
        async with inflight.use(1):
            async with inflight.use(1), inflight.use(2):
                assert (inflight.count(1), inflight.count(2)) == (2, 1)
                assert inflight.busy() == {1, 2}
            assert (inflight.count(1), inflight.count(2)) == (1, 0)
            assert inflight.busy() == {1}
        assert inflight.busy() == set()

    run(main())


def test_use_releases_on_error_and_on_cancellation():
    async def main():
        inflight = InFlightVersions()
        with pytest.raises(RuntimeError, match="boom"):
            async with inflight.use(3):
                raise RuntimeError("boom")
        assert inflight.count(3) == 0

        entered = asyncio.Event()

        async def request():
            async with inflight.use(3):
                entered.set()
                await asyncio.Event().wait()  # forever

        task = asyncio.create_task(request())
        await entered.wait()
        assert inflight.count(3) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert inflight.count(3) == 0

    run(main())


def test_wait_idle_returns_at_once_for_an_idle_version():
    async def main():
        inflight = InFlightVersions()
        await asyncio.wait_for(inflight.wait_idle(7), timeout=1)
        async with inflight.use(8):
            await asyncio.wait_for(inflight.wait_idle(7, timeout_s=0.01), timeout=1)  # other versions do not matter

    run(main())


def test_wait_idle_wakes_exactly_when_the_last_user_leaves():
    async def main():
        inflight = InFlightVersions()
        log: list[str] = []
        leave = [asyncio.Event(), asyncio.Event()]

        async def request(i: int):
            async with inflight.use(5):
                await leave[i].wait()
            log.append(f"left {i}")

        async def waiter():
            await inflight.wait_idle(5)
            log.append(f"idle, count {inflight.count(5)}")

        users = [asyncio.create_task(request(i)) for i in range(2)]
        await asyncio.sleep(0)
        assert inflight.count(5) == 2
        waiters = [asyncio.create_task(waiter()) for _ in range(2)]
        await asyncio.sleep(0.01)
        assert log == []
        leave[0].set()
        await asyncio.sleep(0.01)
        assert log == ["left 0"]  # one user is still on version 5: nobody woke
        leave[1].set()
        await asyncio.gather(*users, *waiters)
        assert log == ["left 0", "left 1", "idle, count 0", "idle, count 0"]

    run(main())


def test_wait_idle_waits_again_for_a_user_that_entered_before_the_waiter_resumed():
    async def main():
        inflight = InFlightVersions()
        woke = asyncio.Event()

        async def waiter():
            await inflight.wait_idle(2)
            woke.set()

        async with inflight.use(2):
            task = asyncio.create_task(waiter())
            await asyncio.sleep(0)
        # Released: the waiter's event is set, but before it runs another request enters version 2.
        async with inflight.use(2):
            await asyncio.sleep(0.01)
            assert not woke.is_set()
        await asyncio.wait_for(task, timeout=1)
        assert woke.is_set()

    run(main())


def test_wait_idle_times_out_and_leaves_the_count_alone():
    async def main():
        inflight = InFlightVersions()
        async with inflight.use(4):
            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises(TimeoutError):
                await inflight.wait_idle(4, timeout_s=0.05)
            assert 0.04 <= loop.time() - start < 1
            assert inflight.count(4) == 1
        await asyncio.wait_for(inflight.wait_idle(4), timeout=1)

    run(main())
