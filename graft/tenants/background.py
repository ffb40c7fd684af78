"""A Tinker service on a loopback port, run in a thread of this process: what the tests and
`graft bench cookbook` point the real `tinker` SDK (another thread, or other processes) at."""

from __future__ import annotations

import asyncio
import threading
import time

import uvicorn

from graft.rollout.launcher import free_port
from graft.tenants.api import build_app
from graft.tenants.users import Users


class ServiceThread:
    """`with ServiceThread(make) as running:` serves the service that `make()` (an async context
    manager) yields at `running.url`; `running.service` is that service, `running.call(coroutine)` runs
    on its event loop. `users`: their keys, or one key for a single user."""

    def __init__(self, make, users: Users | str, poll_seconds: float = 5.0) -> None:
        self._make, self._poll = make, poll_seconds
        self._users = Users.single(users) if isinstance(users, str) else users
        self.url = f"http://127.0.0.1:{free_port()}"
        self.service = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: uvicorn.Server | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="tinker-service", daemon=True)

    def __enter__(self) -> ServiceThread:
        self._thread.start()
        deadline = time.monotonic() + 120
        while not (self._server is not None and self._server.started):
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError("the Tinker service did not start") from self._error
            if time.monotonic() > deadline:
                raise TimeoutError("the Tinker service did not start in 120 s")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc_info) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=60)

    def call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=300)

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as error:  # reported by __enter__
            self._error = error

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        async with self._make() as service:
            self.service = service
            port = int(self.url.rsplit(":", 1)[1])
            self._server = uvicorn.Server(uvicorn.Config(build_app(service, self._users, poll_seconds=self._poll),
                                                         host="127.0.0.1", port=port, log_level="warning"))
            await self._server.serve()
