"""The results of a Tinker service's asynchronous requests, by request id: `Futures`.

Every training and sampling call of the Tinker API answers at once with a request id; the client then
asks for the result (`retrieve_future`) until it is there. The client asks again the moment it is
told "try again", so `wait` holds each ask until the result is ready or `timeout` passes (a long
poll, under the SDK's 45 s read timeout) rather than answering "not yet" in a busy loop.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import Counter, OrderedDict
from typing import Any

from graft.rollout.engine import EngineError
from graft.tenants.policy import TenantError

log = logging.getLogger(__name__)


class RequestFailed(Exception):
    """A request that cannot be done, told to the client as the result of its future or as the
    request's own 4xx (`status`). `category`: "user" (the request is at fault: the client must change
    it) or "server"."""

    status = 400

    def __init__(self, message: str, category: str = "user") -> None:
        super().__init__(message)
        self.category = category


class NotFound(RequestFailed):
    """No such thing for this user: what does not exist and what another user owns answer alike."""

    status = 404


class TooLarge(RequestFailed):
    """A request body over the service's limit."""

    status = 413


class TooMany(RequestFailed):
    """A user over a limit of things held at once (the SDK backs off and sends again on a 429)."""

    status = 429


class Futures:
    """Request id -> its pending or finished result, and the user it belongs to. Finished results are
    kept among the newest `keep_finished` whether fetched or not (the SDK may ask twice: the
    cookbook's supervised loop fetched one optim_step's result a second time, and a 404 then failed
    the run; a client that never asks must not grow the service's memory). Request ids are random
    (never sequential: one user must not guess another's, nor a restarted service hand out an
    earlier one again)."""

    def __init__(self, keep_finished: int = 4096) -> None:
        self._pending: dict[str, asyncio.Future] = {}
        self._finished: OrderedDict[str, asyncio.Future] = OrderedDict()
        self._owners: dict[str, str] = {}  # request id -> its user, while kept
        self.pending: Counter[str] = Counter()  # user -> their requests not finished yet
        self._keep = keep_finished

    def new(self, owner: str) -> tuple[str, asyncio.Future]:
        """A fresh request id of `owner`'s and the future its result goes into."""
        request_id = f"req-{secrets.token_hex(12)}"
        future = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        self._owners[request_id] = owner
        self.pending[owner] += 1
        future.add_done_callback(lambda _: self._finish(owner, request_id))
        return request_id, future

    def _finish(self, owner: str, request_id: str) -> None:
        self.pending[owner] -= 1
        self._finished[request_id] = self._pending.pop(request_id)
        while len(self._finished) > self._keep:
            self._owners.pop(self._finished.popitem(last=False)[0], None)

    def owns(self, owner: str, request_id: str) -> bool:
        return self._owners.get(request_id) == owner

    async def wait(self, owner: str, request_id: str, timeout: float) -> Any:
        """The result of `owner`'s request `request_id` (the object its op produced; a `RequestFailed`
        for a failed request), or None if it is not ready within `timeout` seconds.

        Raises:
            NotFound: no such request of `owner`'s (never made, another user's, or finished long ago).
        """
        if not self.owns(owner, request_id):
            raise NotFound(f"unknown request {request_id!r} (or finished long ago)")
        future = self._pending.get(request_id) or self._finished[request_id]
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            return None
        except RequestFailed:
            pass
        return future.exception() or future.result()

    def job(self, owner: str, work) -> str:
        """A request id of `owner`'s whose result is what the awaitable `work` gives (or its failure,
        `as_failure`)."""
        request_id, future = self.new(owner)

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
    # The details stay in the service's log: a message may name the server's directories.
    log.exception("request failed", exc_info=error)
    return RequestFailed(f"internal error ({type(error).__name__}); the service's log has the details", "server")
