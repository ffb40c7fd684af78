"""`InFlightVersions`: how many running requests use each policy version right now.

The adapter lifecycle (`graft.sync.adapter`) must never unload a version a running request still
names, so rollout code wraps the generate calls of a batch (graft.train.rollout_batch), whose
version it took from `PolicySync.served`:

    async with inflight.use(version):
        completions = await engine.generate(requests, sync.request_adapter(version))

and the sync side asks `count(v)` / `busy()`, or waits with `wait_idle(v)`. Waiting is event based:
the last user leaving a version sets that version's `asyncio.Event`, so waiters resume on the next
turn of the event loop, with no polling.

Everything here runs on one event loop and is not thread-safe (asyncio primitives are not).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class InFlightVersions:
    """Counts of running requests per policy version (int)."""

    def __init__(self) -> None:
        self._counts: dict[int, int] = {}
        self._idle: dict[int, asyncio.Event] = {}  # only for versions someone waits on

    @contextlib.asynccontextmanager
    async def use(self, version: int) -> AsyncIterator[None]:
        """Count one request on `version` for the body of the `async with`.

        Entering never suspends, so `version` read just before is counted before any other task
        runs. Leaving (normally, by exception or by cancellation) never suspends either.
        """
        self._counts[version] = self._counts.get(version, 0) + 1
        try:
            yield
        finally:
            self._release(version)

    def _release(self, version: int) -> None:
        left = self._counts[version] - 1
        assert left >= 0, f"version {version} released more often than acquired"
        if left:
            self._counts[version] = left
            return
        del self._counts[version]
        event = self._idle.pop(version, None)
        if event is not None:
            event.set()

    def count(self, version: int) -> int:
        """Requests running on `version` now."""
        return self._counts.get(version, 0)

    def busy(self) -> set[int]:
        """Versions with at least one running request."""
        return set(self._counts)

    async def wait_idle(self, version: int, timeout_s: float | None = None) -> None:
        """Return as soon as no request uses `version` (at once if none does).

        On return `count(version) == 0` holds in the caller's turn of the event loop: a request
        that entered again between the wake-up and the resumption is waited for too.

        Raises:
            TimeoutError: still in use after `timeout_s` seconds.
        """
        async with asyncio.timeout(timeout_s):
            while self.count(version):
                event = self._idle.get(version)
                if event is None:
                    event = self._idle[version] = asyncio.Event()
                await event.wait()
