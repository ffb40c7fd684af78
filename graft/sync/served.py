"""`ServedVersion`: the newest policy version rollouts may sample from, and a way to wait for one.

A run has two version numbers and one owner each: the version the trainer has trained
(`graft.train.policy.PolicyState.version`: the updates applied so far) and the version the engines
serve and rollouts may use (this object, held by `graft.sync.policy_sync.PolicySync`). They differ
while a sync is under way; every batch records the version it was sampled from.
"""

from __future__ import annotations

import asyncio


class ServedVersion:
    """The version released to rollouts (None before the first), raised only by `release`."""

    def __init__(self) -> None:
        self._version: int | None = None
        self._changed = asyncio.Condition()

    @property
    def version(self) -> int | None:
        return self._version

    async def release(self, version: int) -> None:
        """`version` is served: rollouts may sample from it from now on."""
        assert self._version is None or version >= self._version, (version, self._version)
        async with self._changed:
            self._version = version
            self._changed.notify_all()

    async def at_least(self, oldest: int) -> int:
        """Wait until a version >= `oldest` is served; the newest served one."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._version is not None and self._version >= oldest)
            return self._version
