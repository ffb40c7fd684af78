"""One engine call for every episode's next turn: the turn requests that episodes make in the same
event-loop pass go to the engine together.

Each episode of a multi-turn batch asks for its next model turn on its own (`run_episode` awaits one
request at a time), so without this the server receives one HTTP request per episode per turn,
and they reach its engine in waves while it is already stepping (the single-turn path measured
32 concurrent requests at 0.35-1.07 s against 0.24 s for one request carrying them). The episodes
of a batch all resume in the same pass when a batched answer arrives, and environments that answer
at once ask for their next turns in that pass again, so each turn of the batch becomes one call
(`VllmClient` sends a multi-request call through graft's batch route). An environment that awaits
I/O simply joins a later call. Requests for different adapters are never mixed.

An engine error fails every request of the call it was in: those episodes would have failed alike.
"""

from __future__ import annotations

import asyncio

from graft.rollout.engine import Completion, GenerateRequest, RolloutEngine

_Waiting = tuple[list[GenerateRequest], asyncio.Future]


class TurnBatcher:
    """`generate` as the wrapped engine's, with calls made in the same event-loop pass (same adapter)
    merged into one."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine
        self._waiting: dict[str | None, list[_Waiting]] = {}
        self._sending: set[asyncio.Task] = set()  # the event loop keeps only weak references to tasks

    async def generate(self, requests: list[GenerateRequest], adapter: str | None = None) -> list[list[Completion]]:
        answer: asyncio.Future = asyncio.get_running_loop().create_future()
        waiting = self._waiting.setdefault(adapter, [])
        waiting.append((list(requests), answer))
        if len(waiting) == 1:  # the first of this pass: send once the pass's other episodes have asked
            asyncio.get_running_loop().call_soon(self._start_sending, adapter)
        return await answer

    def _start_sending(self, adapter: str | None) -> None:
        task = asyncio.ensure_future(self._send(adapter))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, adapter: str | None) -> None:
        waiting = self._waiting.pop(adapter)
        flat = [request for requests, _ in waiting for request in requests]
        try:
            answers = await self.engine.generate(flat, adapter)
        except BaseException as error:  # noqa: BLE001 - handed to every caller of this call
            for _, answer in waiting:
                if not answer.done():
                    answer.set_exception(error)
            if not isinstance(error, Exception):
                raise
            return
        start = 0
        for requests, answer in waiting:
            if not answer.done():  # a cancelled episode's answer is dropped
                answer.set_result(answers[start:start + len(requests)])
            start += len(requests)
