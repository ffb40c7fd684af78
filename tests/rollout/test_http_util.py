"""graft.rollout.http_util: the server's own words from any error body; gather that cancels siblings;
the clients' one sender (only a failed connect is retried) and status-to-error fallback."""

import asyncio
import json

import httpx
import pytest

from graft.rollout.engine import BadRequestError, EngineError, EngineHealth, EngineUnavailableError
from graft.rollout.http_util import (
    answer_while_alive,
    error_class_for_status,
    gather_cancel_on_error,
    send,
    server_message,
)
from tests.helpers import unretrieved_task_errors

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


def _send_through(handler, retries=2, method="POST"):
    async def go():
        async with httpx.AsyncClient(base_url="http://engine.test", transport=httpx.MockTransport(handler)) as http:
            return await send(http, method, "/x", address="http://engine.test", retries=retries, backoff_s=0.001,
                              timeout_s=5, json={"a": 1})
    return asyncio.run(go())


@pytest.mark.parametrize("failure", [httpx.ConnectError, httpx.ConnectTimeout])
def test_send_retries_only_a_failed_connect_then_gives_up_naming_the_attempts(failure):
    attempts = []

    def handler(request):
        attempts.append(json.loads(request.content))
        if len(attempts) < 3:
            raise failure("nothing reached the server", request=request)
        return httpx.Response(500, text="boom")

    assert _send_through(handler).status_code == 500  # an HTTP status is the caller's to map, never retried
    assert attempts == [{"a": 1}] * 3
    attempts.clear()
    with pytest.raises(EngineUnavailableError, match="cannot connect after 2 attempt"):
        _send_through(handler, retries=1)


@pytest.mark.parametrize("failure, words", [(httpx.ReadTimeout, "no answer within 5 s"),
                                            (httpx.RemoteProtocolError, "RemoteProtocolError")])
def test_send_never_retries_once_the_request_may_have_been_served(failure, words):
    attempts = []

    def handler(request):
        attempts.append(1)
        raise failure("lost after sending", request=request)

    with pytest.raises(EngineUnavailableError, match=words):
        _send_through(handler)
    assert attempts == [1]


@pytest.mark.parametrize("failure", [httpx.ReadError, httpx.RemoteProtocolError])
def test_a_get_on_a_connection_the_server_closed_is_sent_again(failure):
    """uvicorn closes a connection after a route raised (vLLM 0.20's adapter routes): the next GET on
    it fails unread, and a GET is safe to send again; within `retries`."""
    attempts = []

    def handler(request):
        attempts.append(1)
        if len(attempts) < 2:
            raise failure("", request=request)
        return httpx.Response(200, json={"data": []})

    assert _send_through(handler, method="GET").json() == {"data": []} and attempts == [1, 1]
    attempts.clear()
    with pytest.raises(EngineUnavailableError, match=failure.__name__):
        _send_through(handler, retries=0, method="GET")


@pytest.mark.parametrize("status, cls", [(400, BadRequestError), (404, BadRequestError), (422, BadRequestError),
                                         (429, EngineUnavailableError), (500, EngineUnavailableError),
                                         (503, EngineUnavailableError), (302, EngineError)])
def test_error_class_for_status(status, cls):
    assert error_class_for_status(status) is cls


def test_a_call_failing_as_its_waiter_is_cancelled_leaves_no_unretrieved_exception():
    async def healthy():
        return EngineHealth("http://e", True, ())

    reports = unretrieved_task_errors(lambda call: answer_while_alive(call(), healthy, every_s=10, address="http://e"))
    assert reports == []
