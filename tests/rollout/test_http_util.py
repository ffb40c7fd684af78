"""graft.rollout.http_util: the server's own words from any error body; gather that cancels siblings."""

import asyncio
import json

import pytest

from graft.rollout.http_util import gather_cancel_on_error, server_message

DETAIL = [{"loc": ["body", "lora_name"], "msg": "field required"}]


@pytest.mark.parametrize("body, expected", [
    (json.dumps({"error": {"message": "adapter not found", "type": "NotFound", "code": 404}}), "adapter not found"),
    (json.dumps({"error": "The lora adapter 'x' was not found"}), "The lora adapter 'x' was not found"),
    (json.dumps({"error_message": "sglang: out of slots"}), "sglang: out of slots"),
    (json.dumps({"message": "bad request"}), "bad request"),
    (json.dumps({"detail": "Not Found"}), "Not Found"),
    (json.dumps({"detail": DETAIL}), json.dumps(DETAIL)),  # FastAPI validation errors: kept whole
    (json.dumps({"error": {"type": "Internal", "code": 500}}), json.dumps({"type": "Internal", "code": 500})),
    (json.dumps({"error": "", "detail": "fallback"}), "fallback"),  # an empty field is skipped
    (json.dumps({"error": "first", "detail": "second"}), "first"),  # error wins over the others
    ("  Internal Server Error\n", "Internal Server Error"),  # plain text
    ("", ""),
    (json.dumps(["a", "list"]), json.dumps(["a", "list"])),  # JSON but not an object: the text itself
    (json.dumps({"status": "failed"}), json.dumps({"status": "failed"})),  # no known field: the text
])
def test_server_message(body, expected):
    assert server_message(body) == expected


def test_gather_returns_results_in_input_order():
    async def value(x, delay_s):
        await asyncio.sleep(delay_s)
        return x

    assert asyncio.run(gather_cancel_on_error([value("a", 0.03), value("b", 0.0), value("c", 0.01)])) == ["a", "b", "c"]


def test_gather_cancels_and_awaits_siblings_on_error():
    events = []

    async def slow(name):
        try:
            await asyncio.sleep(10)
            events.append(f"{name} finished")
        except asyncio.CancelledError:
            await asyncio.sleep(0)  # cleanup that takes a step: still awaited before the error surfaces
            events.append(f"{name} cancelled")
            raise

    async def failing():
        await asyncio.sleep(0.01)
        raise RuntimeError("engine 1 down")

    async def run():
        async with asyncio.timeout(5):  # a sibling left running would hold us for 10 s
            with pytest.raises(RuntimeError, match="engine 1 down"):
                await gather_cancel_on_error([slow("e0"), failing(), slow("e2")])
        return list(events), asyncio.all_tasks() - {asyncio.current_task()}

    seen, unfinished = asyncio.run(run())
    assert sorted(seen) == ["e0 cancelled", "e2 cancelled"]  # cancelled, and awaited before the raise
    assert not unfinished  # nothing orphaned
