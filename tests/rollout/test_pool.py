"""EnginePool: least-outstanding-requests spreading, answers in input order, broadcasts that report
every failing engine by address, list/health views; plus a real network failure (an SglangClient
pointed at a closed loopback port) next to a healthy fake engine."""

from __future__ import annotations

import asyncio
import socket

import pytest

from graft.rollout.engine import (
    Completion,
    EngineError,
    EngineHealth,
    EngineUnavailableError,
    GenerateRequest,
    RolloutEngine,
    SamplingParams,
    UnknownAdapterError,
)
from graft.rollout.pool import EnginePool, PoolBroadcastError, engine_address
from graft.rollout.sglang.client import SglangClient
from tests.helpers import in_flight, unretrieved_task_errors


class FakeEngine:
    """A RolloutEngine in a few lines: answers after `delay_s` with one token per sample (the
    prompt's first id), counts what it served and its peak number of generate calls in flight."""

    def __init__(self, address: str, delay_s: float = 0.0, fail: Exception | None = None) -> None:
        self.address, self.delay_s, self.fail = address, delay_s, fail
        self.adapters: set[str] = set()
        self.calls: list[tuple[str, str]] = []
        self.active = self.peak = self.served = 0
        self.healthy = True

    async def generate(self, requests, adapter=None):
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.active -= 1
        self.served += len(requests)
        return [[Completion((r.prompt_token_ids[0],), (-0.5,), "length", self.address)] * r.params.n
                for r in requests]

    async def load_adapter(self, name, path):
        self._control("load", name)
        self.adapters.add(name)

    async def unload_adapter(self, name):
        self._control("unload", name)
        self.adapters.discard(name)

    async def list_adapters(self):
        self._control("list", "")
        return sorted(self.adapters)

    async def reload_weights(self, path):
        self._control("reload", path)

    async def health(self):
        return EngineHealth(self.address, self.healthy, tuple(sorted(self.adapters)), "" if self.healthy else "down")

    def _control(self, op: str, arg: str) -> None:
        self.calls.append((op, arg))
        if self.fail is not None:
            raise self.fail


def request(i: int, n: int = 1) -> GenerateRequest:
    return GenerateRequest((i, 7), SamplingParams(n=n))


# --- generation ----------------------------------------------------------------------------------


def test_pool_is_a_rollout_engine_and_needs_engines():
    assert isinstance(EnginePool([FakeEngine("a")]), RolloutEngine)
    with pytest.raises(ValueError, match="at least one engine"):
        EnginePool([])


def test_concurrent_requests_spread_evenly_by_least_outstanding():
    engines = [FakeEngine(f"e{i}", delay_s=0.05) for i in range(3)]
    pool = EnginePool(engines)
    out = asyncio.run(pool.generate([request(i) for i in range(30)]))
    assert len(out) == 30
    assert [e.served for e in engines] == [10, 10, 10]
    assert [e.peak for e in engines] == [1, 1, 1]  # one call each, for its 10 (an HTTP client: one batch request)
    assert in_flight(pool) == {"e0": 0, "e1": 0, "e2": 0}


def test_slow_engine_gets_fewer_requests_under_sustained_load():
    fast, slow = FakeEngine("fast", delay_s=0.005), FakeEngine("slow", delay_s=0.1)
    pool = EnginePool([fast, slow])

    async def client(k: int) -> None:  # 4 callers, each sending one request at a time
        for j in range(10):
            await pool.generate([request(10 * k + j)])

    async def run() -> None:
        await asyncio.gather(*(client(k) for k in range(4)))

    asyncio.run(run())
    assert fast.served + slow.served == 40
    assert fast.served >= 3 * slow.served, (fast.served, slow.served)
    assert slow.peak <= 2 and fast.peak <= 2  # in flight stays balanced, never piled on one engine


def test_sequential_requests_round_robin_on_ties():
    engines = [FakeEngine(f"e{i}") for i in range(3)]
    pool = EnginePool(engines)

    async def run() -> list[str]:
        return [(await pool.generate([request(i)]))[0][0].text for i in range(7)]

    assert asyncio.run(run()) == ["e0", "e1", "e2", "e0", "e1", "e2", "e0"]


def test_answers_come_back_in_input_order_with_n_samples():
    pool = EnginePool([FakeEngine("slow", 0.03), FakeEngine("fast", 0.0), FakeEngine("mid", 0.01)])
    out = asyncio.run(pool.generate([request(100 + i, n=1 + i % 3) for i in range(9)]))
    assert [c[0].token_ids[0] for c in out] == [100 + i for i in range(9)]
    assert [len(c) for c in out] == [1 + i % 3 for i in range(9)]


def test_generate_error_propagates_and_leaves_no_request_counted():
    class Broken(FakeEngine):
        async def generate(self, requests, adapter=None):
            raise UnknownAdapterError("adapter 'policy-v9' is not loaded", address=self.address)

    pool = EnginePool([FakeEngine("ok", delay_s=0.05), Broken("bad")])
    with pytest.raises(UnknownAdapterError, match="bad: adapter 'policy-v9'"):
        asyncio.run(pool.generate([request(i) for i in range(4)], adapter="policy-v9"))
    assert in_flight(pool) == {"ok": 0, "bad": 0}


# --- broadcast -----------------------------------------------------------------------------------


def test_broadcast_reaches_every_engine():
    engines = [FakeEngine(f"e{i}") for i in range(3)]
    pool = EnginePool(engines)

    async def run():
        await pool.load_adapter("policy-v1", "/w/adapter-v000001")
        await pool.load_adapter("policy-v2", "/w/adapter-v000002")
        await pool.unload_adapter("policy-v1")
        await pool.reload_weights("/w/merged-v000002")
        return await pool.list_adapters(), await pool.adapters_by_engine()

    common, per_engine = asyncio.run(run())
    for e in engines:
        assert [c for c in e.calls if c[0] != "list"] == [("load", "policy-v1"), ("load", "policy-v2"),
                                                          ("unload", "policy-v1"), ("reload", "/w/merged-v000002")]
    assert common == ["policy-v2"]
    assert per_engine == {"e0": ["policy-v2"], "e1": ["policy-v2"], "e2": ["policy-v2"]}


def test_broadcast_failure_names_each_failing_engine_and_the_others_still_got_the_call():
    good_a, good_b = FakeEngine("http://10.0.0.1:8000"), FakeEngine("http://10.0.0.3:8000")
    bad = FakeEngine("http://10.0.0.2:8000", fail=EngineError("LoRA is not enabled", address="http://10.0.0.2:8000"))
    pool = EnginePool([good_a, bad, good_b])
    with pytest.raises(PoolBroadcastError) as info:
        asyncio.run(pool.load_adapter("policy-v4", "/w/adapter-v000004"))
    err = info.value
    assert isinstance(err, EngineError)
    assert list(err.failures) == ["http://10.0.0.2:8000"] and err.failures["http://10.0.0.2:8000"] is bad.fail
    assert err.succeeded == ["http://10.0.0.1:8000", "http://10.0.0.3:8000"]
    message = str(err)
    assert "load_adapter('policy-v4') failed on 1/3" in message
    assert "http://10.0.0.2:8000: EngineError: http://10.0.0.2:8000: LoRA is not enabled" in message
    assert "succeeded on: http://10.0.0.1:8000, http://10.0.0.3:8000" in message
    assert good_a.calls == good_b.calls == bad.calls == [("load", "policy-v4")]
    assert err.__cause__ is bad.fail


def test_list_adapters_is_the_intersection_and_by_engine_the_full_view():
    a, b = FakeEngine("a"), FakeEngine("b")
    a.adapters, b.adapters = {"policy-v1", "policy-v2"}, {"policy-v2", "policy-v3"}
    pool = EnginePool([a, b])
    assert asyncio.run(pool.list_adapters()) == ["policy-v2"]
    assert asyncio.run(pool.adapters_by_engine()) == {"a": ["policy-v1", "policy-v2"], "b": ["policy-v2", "policy-v3"]}


# --- health and addresses ------------------------------------------------------------------------


def test_health_views_show_each_engine():
    a, b = FakeEngine("a"), FakeEngine("b")
    a.adapters = b.adapters = {"policy-v2"}
    pool = EnginePool([a, b])
    combined = asyncio.run(pool.health())
    assert combined == EngineHealth("pool[a, b]", True, ("policy-v2",), "")
    b.healthy = False
    combined, each = asyncio.run(pool.health()), asyncio.run(pool.health_all())
    assert not combined.healthy and combined.detail == "b: down"
    assert [(h.address, h.healthy) for h in each] == [("a", True), ("b", False)]


def test_addresses_fall_back_to_repr_and_repeats_are_told_apart():
    class NoAddress(FakeEngine):
        def __repr__(self) -> str:
            return "<in-memory engine>"

    anonymous = NoAddress("unused")
    del anonymous.address
    assert engine_address(anonymous) == "<in-memory engine>"
    pool = EnginePool([FakeEngine("http://h:1"), FakeEngine("http://h:1"), anonymous])
    assert pool.addresses == ["http://h:1", "http://h:1#2", "<in-memory engine>"]


# --- a real network failure ----------------------------------------------------------------------


def closed_loopback_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_unreachable_http_engine_is_named_in_health_and_in_broadcast_errors():
    """Without failover (min_engines = every engine) an unreachable member fails the broadcast."""
    url = closed_loopback_url()
    healthy = FakeEngine("in-process")
    pool = EnginePool([SglangClient(url, connect_retries=0), healthy], min_engines=2)

    async def run():
        each = await pool.health_all()
        with pytest.raises(PoolBroadcastError) as info:
            await pool.load_adapter("policy-v5", "/w/adapter-v000005")
        await pool.aclose()
        return each, info.value

    each, err = asyncio.run(run())
    assert [(h.address, h.healthy) for h in each] == [(url, False), ("in-process", True)]
    assert "cannot connect" in each[0].detail
    assert list(err.failures) == [url] and isinstance(err.failures[url], EngineUnavailableError)
    assert f"{url}: EngineUnreachableError" in str(err) and "succeeded on: in-process" in str(err)
    assert "not dropped from the pool: 1 live engine(s) would remain, fewer than min_engines=2" in str(err)
    assert healthy.calls == [("load", "policy-v5")] and healthy.adapters == {"policy-v5"}
    assert pool.engines_live == 2 and pool.dropped == {}


def test_unreachable_http_engine_is_dropped_with_one_warning_and_never_used_again(caplog):
    url = closed_loopback_url()
    healthy = FakeEngine("in-process")
    pool = EnginePool([SglangClient(url, connect_retries=0), healthy])

    async def run():
        await pool.load_adapter("policy-v5", "/w/adapter-v000005")
        out = await pool.generate([request(i) for i in range(4)], adapter="policy-v5")
        await pool.aclose()
        return out

    with caplog.at_level("WARNING", logger="graft.rollout.pool"):
        out = asyncio.run(run())
    assert [c[0].text for c in out] == ["in-process"] * 4
    assert pool.engines == [healthy] and pool.engines_live == 1 and list(pool.dropped) == [url]
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"rollout engine {url} dropped from the pool, 1 of 2 still live: POST /load_lora_adapter: "
                           "cannot connect")


def test_a_member_failing_as_its_request_is_cancelled_leaves_no_unretrieved_exception():
    """A killed server fails every request at once; a request cancelled in that pass (a sibling's
    failure ended the batch) still reads its member's failure, so no traceback follows the run's error."""
    class Failing(FakeEngine):
        def __init__(self, call):
            super().__init__("http://e")
            self.call = call

        async def generate(self, requests, adapter=None):
            return await self.call()

    request = GenerateRequest((1, 2), SamplingParams(n=1))
    reports = unretrieved_task_errors(lambda call: EnginePool([Failing(call)]).generate([request]))
    assert reports == []


class _Scoring(FakeEngine):
    """A FakeEngine that scores prompts (-1 per token), or fails as a server that went away."""

    async def prompt_logprobs(self, prompt, adapter=None):
        if not self.healthy:
            raise EngineUnavailableError("connection refused", address=self.address)
        return [None, *[-1.0] * (len(prompt) - 1)]


def test_prompt_logprobs_come_from_a_live_member_and_a_dead_one_is_dropped():
    down, up = _Scoring("a"), _Scoring("b")
    down.healthy = False
    pool = EnginePool([down, up])

    async def run():
        return [await pool.prompt_logprobs([1, 2, 3], adapter="t-v1") for _ in range(3)]

    assert asyncio.run(run()) == [[None, -1.0, -1.0]] * 3
    assert list(pool.dropped) == ["a"] and pool.engines == [up]
