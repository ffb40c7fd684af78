"""graft's batch route gives up a batch whose client disconnected: the batch's requests are cancelled
(vLLM aborts a cancelled request in its engine), as vLLM's own routes do, instead of being awaited on
(a stopped trainer's batch held its SIGTERM'd server until SIGKILL 20 s later)."""

from __future__ import annotations

import asyncio

from graft.rollout.vllm.server.batch_route import _unless_disconnected


class _Request:
    """The ASGI side of a request whose body was read: `receive` gives what the client sends next."""

    def __init__(self) -> None:
        self.messages: asyncio.Queue = asyncio.Queue()

    async def receive(self) -> dict:
        return await self.messages.get()


def test_a_batch_whose_client_leaves_is_cancelled_request_by_request():
    async def scenario():
        request, generating = _Request(), [asyncio.ensure_future(asyncio.sleep(3600)) for _ in range(3)]
        batch = asyncio.ensure_future(_unless_disconnected(asyncio.gather(*generating), request))
        await asyncio.sleep(0.05)
        request.messages.put_nowait({"type": "http.disconnect"})
        answer = await asyncio.wait_for(batch, 5)
        await asyncio.sleep(0)
        return answer, [task.cancelled() for task in generating]

    assert asyncio.run(scenario()) == (None, [True, True, True])


def test_a_batch_that_ends_first_is_answered():
    async def scenario():
        async def answer(i: int) -> int:
            await asyncio.sleep(0.01)
            return i

        return await _unless_disconnected(asyncio.gather(*(answer(i) for i in range(3))), _Request())

    assert asyncio.run(scenario()) == [0, 1, 2]
