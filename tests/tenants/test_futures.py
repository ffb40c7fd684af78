"""Results by request id (graft.tenants.futures): held until ready, fetchable again, failures as results."""

import asyncio

import pytest

from graft.tenants.futures import Futures, RequestFailed


def test_a_result_is_held_until_ready_and_can_be_fetched_again():
    async def scenario():
        futures = Futures(keep_fetched=2)
        request_id, future = futures.new()
        assert await futures.wait(request_id, 0.01) is None  # not ready: the client is told to try again
        future.set_result({"metrics": {}})
        assert await futures.wait(request_id, 0.01) == {"metrics": {}}
        assert await futures.wait(request_id, 0.01) == {"metrics": {}}  # the SDK may ask twice
        failed = futures.job(_fail())
        assert isinstance(result := await futures.wait(failed, 1.0), RequestFailed) and "bad datum" in str(result)
        for _ in range(2):  # two more fetched results push the first out
            newer, done = futures.new()
            done.set_result({})
            await futures.wait(newer, 0.01)
        assert request_id not in futures
        with pytest.raises(KeyError):
            await futures.wait(request_id, 0.01)

    asyncio.run(scenario())


async def _fail():
    raise ValueError("bad datum")
