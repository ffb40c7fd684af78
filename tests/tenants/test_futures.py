"""Results by request id (graft.tenants.futures): held until ready, fetchable again, failures as
results, each request its user's alone, finished results kept within a bound."""

import asyncio

import pytest

from graft.tenants.futures import Futures, NotFound, RequestFailed


def test_a_result_is_held_until_ready_and_can_be_fetched_again():
    async def scenario():
        futures = Futures(keep_finished=2)
        request_id, future = futures.new("ann")
        assert futures.pending["ann"] == 1
        assert await futures.wait("ann", request_id, 0.01) is None  # not ready: the client is told to try again
        future.set_result({"metrics": {}})
        assert await futures.wait("ann", request_id, 0.01) == {"metrics": {}}
        assert await futures.wait("ann", request_id, 0.01) == {"metrics": {}}  # the SDK may ask twice
        assert futures.pending["ann"] == 0
        failed = futures.job("ann", _fail())
        result = await futures.wait("ann", failed, 1.0)
        assert isinstance(result, RequestFailed) and "bad datum" in str(result)
        for _ in range(2):  # two more finished results (never fetched) push the first out
            _, done = futures.new("ann")
            done.set_result({})
        await asyncio.sleep(0)
        with pytest.raises(NotFound):
            await futures.wait("ann", request_id, 0.01)

    asyncio.run(scenario())


def test_another_users_request_is_as_unknown_as_none():
    async def scenario():
        futures = Futures()
        request_id, future = futures.new("ann")
        future.set_result({"secret": 1})
        with pytest.raises(NotFound) as other:
            await futures.wait("bob", request_id, 0.01)
        with pytest.raises(NotFound) as never:
            await futures.wait("bob", "req-" + "0" * 24, 0.01)
        assert str(other.value).replace(request_id, "ID") == str(never.value).replace("req-" + "0" * 24, "ID")
        assert request_id != futures.new("ann")[0] and len(request_id) > 20  # random, not sequential

    asyncio.run(scenario())


async def _fail():
    raise ValueError("bad datum")
