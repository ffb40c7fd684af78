"""EnginePool failover on fake engines: which failures drop a member, that its requests are answered
by the others, that a dropped member is never used again, and that min_engines stops the dropping.
The same faults on real vLLM servers (killed, frozen) are in test_pool_faults.py."""

from __future__ import annotations

import asyncio
import logging

import pytest

from graft.rollout.engine import (
    BadRequestError,
    EngineHealth,
    EngineUnavailableError,
)
from graft.rollout.pool import EnginePool, PoolBroadcastError, live_engine_count
from tests.helpers import in_flight
from tests.rollout.test_pool import FakeEngine, request


class Dying(FakeEngine):
    """Serves `lives` requests, then is gone: requests and control calls fail as a killed server's
    do (no HTTP answer), and health says so."""

    def __init__(self, address: str, lives: int = 0, status: int | None = None) -> None:
        super().__init__(address, delay_s=0.01)
        self.lives, self.status, self.started = lives, status, 0

    async def generate(self, requests, adapter=None):
        self.started += 1
        if self.started > self.lives:
            self.healthy = False
            raise EngineUnavailableError("POST /v1/completions: connection lost", address=self.address,
                                         status=self.status)
        return await super().generate(requests, adapter)

    def _control(self, op: str, arg: str) -> None:
        self.calls.append((op, arg))
        if not self.healthy:
            raise EngineUnavailableError(f"{op}: cannot connect", address=self.address, status=self.status)


class Frozen(FakeEngine):
    """A SIGSTOPped server: generate never answers; health takes `health_s`, then reports the timeout."""

    def __init__(self, address: str, health_s: float = 0.05) -> None:
        super().__init__(address)
        self.health_s, self.health_calls = health_s, 0

    async def generate(self, requests, adapter=None):
        self.active += 1
        await asyncio.Event().wait()

    async def health(self):
        self.health_calls += 1
        await asyncio.sleep(self.health_s)
        return EngineHealth(self.address, False, (), f"GET /health: no answer within {self.health_s:g} s")


# --- generation ----------------------------------------------------------------------------------


def test_requests_of_a_dead_member_are_answered_by_the_others(caplog):
    ok, dying = FakeEngine("ok", delay_s=0.01), Dying("dying", lives=1)
    pool = EnginePool([ok, dying])

    async def two_calls():  # each sends half its requests to each member, in one call there
        return await asyncio.gather(pool.generate([request(100 + i) for i in range(6)]),
                                    pool.generate([request(200 + i) for i in range(6)]))

    with caplog.at_level(logging.WARNING, logger="graft.rollout.pool"):
        first, second = asyncio.run(two_calls())
    # every request, in order
    assert [c[0].token_ids[0] for c in first + second] == [100 + i for i in range(6)] + [200 + i for i in range(6)]
    # The second call there failed; the drop cancelled the first, which it was still serving.
    assert dying.started == 2 and dying.served == 0 and ok.served == 12
    assert pool.engines == [ok] and pool.dropped == {"dying": "POST /v1/completions: connection lost"}
    assert [r.getMessage() for r in caplog.records] == [
        "rollout engine dying dropped from the pool, 1 of 2 still live: POST /v1/completions: connection lost"]
    assert in_flight(pool) == {"ok": 0, "dying": 0}


def test_a_dropped_member_is_never_used_again_even_when_it_answers_again():
    ok, dying = FakeEngine("ok"), Dying("dying")
    pool = EnginePool([ok, dying])

    async def run():
        await pool.generate([request(i) for i in range(4)])
        dying.healthy, dying.lives = True, 10**6  # back up: the pool must not care
        dying.calls.clear()
        await pool.load_adapter("policy-v2", "/w/v2")
        await pool.generate([request(i) for i in range(4)], adapter="policy-v2")
        return await pool.list_adapters(), await pool.adapters_by_engine(), await pool.health()

    common, by_engine, health = asyncio.run(run())
    assert dying.calls == [] and dying.served == 0 and ok.served == 8
    assert common == ["policy-v2"] and by_engine == {"ok": ["policy-v2"]}
    assert health.healthy and "dying: dropped (POST /v1/completions: connection lost)" in health.detail
    assert live_engine_count(pool) == 1 and live_engine_count(ok) == 1


def test_an_error_from_a_member_that_is_still_healthy_is_raised_not_failed_over():
    ok, flaky = FakeEngine("ok"), Dying("flaky", status=503)
    flaky.healthy = True
    flaky.generate = lambda requests, adapter=None: _raise(EngineUnavailableError("HTTP 503", address="flaky",
                                                                                  status=503))
    pool = EnginePool([ok, flaky])
    with pytest.raises(EngineUnavailableError, match="flaky: HTTP 503"):
        asyncio.run(pool.generate([request(i) for i in range(4)]))
    assert pool.engines_live == 2 and pool.dropped == {}


async def _raise(error):
    raise error


def test_a_frozen_member_is_probed_once_for_all_its_requests_and_dropped():
    ok, frozen = FakeEngine("ok", delay_s=0.01), Frozen("frozen")
    pool = EnginePool([ok, frozen], probe_after_s=0.1)

    async def two_calls():
        return await asyncio.gather(*(pool.generate([request(i) for i in range(4)]) for _ in range(2)))

    out = [answer for call in asyncio.run(two_calls()) for answer in call]
    assert [c[0].text for c in out] == ["ok"] * 8
    assert frozen.active == 2  # half of each call's requests went there first, in one call each
    assert frozen.health_calls == 1  # its 2 waiting calls shared one probe
    assert pool.dropped == {"frozen": "no answer to a generation for 0.1 s, then health failed: "
                                      "GET /health: no answer within 0.05 s"}


def test_a_slow_but_healthy_member_keeps_its_requests():
    slow, fast = FakeEngine("slow", delay_s=0.3), FakeEngine("fast")
    pool = EnginePool([slow, fast], probe_after_s=0.05)
    out = asyncio.run(pool.generate([request(i) for i in range(4)]))
    assert sorted(c[0].text for c in out) == ["fast", "fast", "slow", "slow"]
    assert pool.engines_live == 2


def test_min_engines_stops_the_dropping_with_one_clear_error():
    pool = EnginePool([FakeEngine("ok"), Dying("dying")], min_engines=2)
    with pytest.raises(EngineUnavailableError) as info:
        asyncio.run(pool.generate([request(i) for i in range(4)]))
    assert str(info.value) == ("dying: POST /v1/completions: connection lost; not dropped from the pool: 1 live "
                               "engine(s) would remain, fewer than min_engines=2")
    assert pool.engines_live == 2
    with pytest.raises(ValueError, match=r"min_engines must be in 1..2"):
        EnginePool([FakeEngine("a"), FakeEngine("b")], min_engines=3)


# --- broadcast -----------------------------------------------------------------------------------


@pytest.mark.parametrize("status, healthy, dropped", [
    (None, True, True),  # no answer at all (refused, timed out): the call was the health check
    (500, False, True),  # answered 500 and /health fails: the server is broken
    (500, True, False),  # answered 500 but healthy: a real error about this call (e.g. adapter rank)
])
def test_which_broadcast_failures_drop_a_member(status, healthy, dropped):
    ok, bad = FakeEngine("ok"), Dying("bad", status=status)
    bad.healthy = False
    pool = EnginePool([ok, bad])
    bad.health = lambda: _health(bad.address, healthy)

    async def run():
        await pool.load_adapter("policy-v3", "/w/v3")

    if dropped:
        asyncio.run(run())
        assert list(pool.dropped) == ["bad"] and ok.adapters == {"policy-v3"}
    else:
        with pytest.raises(PoolBroadcastError) as info:
            asyncio.run(run())
        assert list(info.value.failures) == ["bad"] and info.value.succeeded == ["ok"]
        assert pool.dropped == {}


async def _health(address, healthy):
    return EngineHealth(address, healthy, (), "" if healthy else "GET /health: cannot connect")


def test_a_member_that_refuses_the_call_fails_the_broadcast_as_before():
    ok, refusing = FakeEngine("ok"), FakeEngine("refusing", fail=BadRequestError("No adapter found", status=404))
    pool = EnginePool([ok, refusing])
    with pytest.raises(PoolBroadcastError, match="refusing: BadRequestError: No adapter found"):
        asyncio.run(pool.load_adapter("policy-v4", "/w/missing"))
    assert pool.dropped == {}


def test_when_every_member_is_down_the_broadcast_fails_and_nothing_is_dropped():
    a, b = Dying("a"), Dying("b")
    a.healthy = b.healthy = False
    pool = EnginePool([a, b])
    with pytest.raises(PoolBroadcastError) as info:
        asyncio.run(pool.unload_adapter("policy-v1"))
    assert list(info.value.failures) == ["a", "b"]
    assert "0 live engine(s) would remain, fewer than min_engines=1" in str(info.value)
    assert pool.engines_live == 2
