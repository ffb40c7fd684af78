"""The results of a Tinker service's asynchronous requests, by request id: `Futures`.

Every training and sampling call of the Tinker API answers at once with a request id; the client then
asks for the result (`retrieve_future`) until it is there. The client asks again the moment it is
told "try again", so `wait` holds each ask until the result is ready or `timeout` passes (a long
poll, under the SDK's 45 s read timeout) rather than answering "not yet" in a busy loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import OrderedDict
from typing import Any

from graft.rollout.engine import EngineError
from graft.tenants.policy import TenantError

log = logging.getLogger(__name__)


class RequestFailed(Exception):
    """A request that cannot be done, told to the client as the result of its future. `category`:
    "user" (the request is at fault: the client must change it) or "server"."""

    def __init__(self, message: str, category: str = "user") -> None:
        super().__init__(message)
        self.category = category


class Futures:
    """Request id -> its pending or finished result. A fetched result is kept among the newest
    `keep_fetched` (the SDK may ask twice: the cookbook's supervised loop fetched one optim_step's
    result a second time, and a 404 then failed the run), older ones are dropped."""

    def __init__(self, keep_fetched: int = 4096) -> None:
        self._futures: dict[str, asyncio.Future] = {}
        self._fetched: OrderedDict[str, asyncio.Future] = OrderedDict()
        self._keep = keep_fetched
        self._ids = itertools.count(1)

    def new(self) -> tuple[str, asyncio.Future]:
        """A fresh request id and the future its result goes into."""
        request_id = f"req-{next(self._ids)}"
        future = asyncio.get_running_loop().create_future()
        self._futures[request_id] = future
        return request_id, future

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._futures or request_id in self._fetched

    async def wait(self, request_id: str, timeout: float) -> Any:
        """The result of `request_id` (the object its op produced; a `RequestFailed` for a failed
        request), or None if it is not ready within `timeout` seconds.

        Raises:
            KeyError: no such request (never made, or fetched long ago).
        """
        future = self._futures.get(request_id) or self._fetched[request_id]
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            return None
        except RequestFailed:
            pass
        if self._futures.pop(request_id, None) is not None:
            self._fetched[request_id] = future
            while len(self._fetched) > self._keep:
                self._fetched.popitem(last=False)
        return future.exception() or future.result()

    def job(self, work) -> str:
        """A request id whose result is what the awaitable `work` gives (or its failure, `as_failure`)."""
        request_id, future = self.new()

        async def settle() -> None:
            try:
                future.set_result(await work)
            except Exception as error:
                future.set_exception(as_failure(error))

        asyncio.get_running_loop().create_task(settle())
        return request_id


def as_failure(error: Exception) -> RequestFailed:
    """The client's view of `error`: the request's fault (bad input) or the server's."""
    if isinstance(error, RequestFailed):
        log.warning("request failed: %s", error)
        return error
    if isinstance(error, TenantError | ValueError):
        log.warning("request failed: %s", error)
        return RequestFailed(str(error), "user")
    if isinstance(error, EngineError):
        log.warning("request failed: inference engine: %s", error)
        return RequestFailed(f"inference engine: {error}", "server")
    log.exception("request failed", exc_info=error)
    return RequestFailed(f"{type(error).__name__}: {error}", "server")
