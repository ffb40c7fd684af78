"""The HTTP clients' two timeouts (long for generations, short for control calls) and API key, on
an httpx mock transport and a loopback socket that never answers. A real vLLM started with
--api-key, and a real frozen one, are in test_pool_faults.py."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest

from graft.rollout.engine import BadRequestError, EngineUnavailableError, GenerateRequest, SamplingParams
from graft.rollout.vllm.client import VllmClient

KEY = "sk-test-0123456789"
MODELS = {"object": "list", "data": [{"id": "/models/base", "parent": None}]}
CHOICE = {"index": 0, "token_ids": [3], "logprobs": {"token_logprobs": [-0.5]}, "finish_reason": "length", "text": ""}


def _answer(request: httpx.Request) -> httpx.Response:
    path = request.url.path
    if path == "/v1/models":
        return httpx.Response(200, json=MODELS)
    if path == "/v1/completions":
        return httpx.Response(200, json={"choices": [CHOICE]})
    if path == "/reset_prefix_cache":
        return httpx.Response(200, json={"success": True})
    return httpx.Response(200, text="ok")


def test_generation_and_reloads_get_the_request_timeout_the_rest_the_control_timeout():
    seen: dict[str, tuple[float, str | None]] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen[request.url.path] = (request.extensions["timeout"]["read"], request.headers.get("Authorization"))
        return _answer(request)

    async def run():
        async with VllmClient("http://vllm.test", request_timeout_s=123, control_timeout_s=7, api_key=KEY,
                              transport=httpx.MockTransport(handler)) as client:
            await client.generate([GenerateRequest((1, 2), SamplingParams(max_new_tokens=1))])
            await client.load_adapter("p-v1", "/w/v1")
            await client.unload_adapter("p-v1")
            await client.reload_weights("/w/merged")
            assert (await client.health()).healthy

    asyncio.run(run())
    timeouts = {path: timeout for path, (timeout, _) in seen.items()}
    assert timeouts == {"/v1/models": 7, "/v1/completions": 123, "/v1/load_lora_adapter": 7,
                        "/v1/unload_lora_adapter": 7, "/pause": 123, "/collective_rpc": 123,
                        "/reset_prefix_cache": 7, "/resume": 7, "/health": 7}
    assert {auth for _, auth in seen.values()} == {f"Bearer {KEY}"}  # every route, dev endpoints too


def _guarded(request: httpx.Request) -> httpx.Response:
    """vLLM's AuthenticationMiddleware: /v1/* needs the Bearer key; /health does not."""
    if request.url.path.startswith("/v1") and request.headers.get("Authorization") != f"Bearer {KEY}":
        return httpx.Response(401, json={"error": "Unauthorized"})
    return _answer(request)


@pytest.mark.parametrize("api_key, words", [(None, "requires an API key and graft sent none"),
                                            ("sk-wrong", "rejected the API key graft sent")])
def test_a_missing_or_wrong_key_is_one_clear_error_that_never_shows_a_key(api_key, words):
    async def run():
        async with VllmClient("http://vllm.test", api_key=api_key, transport=httpx.MockTransport(_guarded)) as client:
            health = await client.health()
            with pytest.raises(BadRequestError) as info:
                await client.generate([GenerateRequest((1, 2), SamplingParams(max_new_tokens=1))])
            return health, info.value

    health, error = asyncio.run(run())
    assert not health.healthy and words in health.detail  # /health passed, the adapter list did not
    assert str(error) == (f"http://vllm.test: GET /v1/models -> HTTP 401: the server {words}: put the server's key in "
                          "the environment variable named by rollout.api_key_env (default VLLM_API_KEY) or in "
                          "rollout.api_key")
    assert error.status == 401 and KEY not in str(error) and "sk-wrong" not in str(error)


def test_the_right_key_is_served():
    async def run():
        async with VllmClient("http://vllm.test", api_key=KEY, transport=httpx.MockTransport(_guarded)) as client:
            return await client.generate([GenerateRequest((1, 2), SamplingParams(max_new_tokens=1))])

    assert asyncio.run(run())[0][0].token_ids == (3,)


def _seconds_until_error(call, match: str) -> float:
    """Seconds until `call(client)` raises EngineUnavailableError matching `match`, against a
    listening socket nobody reads: connect succeeds (kernel backlog), no answer ever comes — what a
    SIGSTOPped server looks like from the client. Control timeout 0.5 s, request timeout 300 s."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"

        async def run():
            async with VllmClient(url, model="m", control_timeout_s=0.5, request_timeout_s=300) as client:
                start = time.monotonic()
                with pytest.raises(EngineUnavailableError, match=match):
                    await call(client)
                return time.monotonic() - start

        return asyncio.run(run())


def test_a_server_that_never_answers_fails_a_control_call_within_the_control_timeout():
    seconds = _seconds_until_error(lambda client: client.load_adapter("p-v1", "/w/v1"),
                                   r"POST /v1/load_lora_adapter: no answer within 0.5 s")
    assert seconds < 0.5 + 2.0  # the control timeout, plus slack; not the 300 s


def _slow_generation(seconds: float, health: list[float]):
    """A vLLM whose /v1/completions answers after `seconds`; /health answers at once (and is logged)."""
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            health.append(time.monotonic())
        if request.url.path == "/v1/completions":
            await asyncio.sleep(seconds)
        return _answer(request)
    return handler


def test_a_generation_longer_than_the_control_timeout_runs_on_while_the_server_is_healthy():
    health: list[float] = []

    async def run():
        async with VllmClient("http://vllm.test", model="m", control_timeout_s=0.2, request_timeout_s=30,
                              transport=httpx.MockTransport(_slow_generation(1.0, health))) as client:
            return await client.generate([GenerateRequest((1, 2), SamplingParams(max_new_tokens=1))])

    assert asyncio.run(run())[0][0].token_ids == (3,)
    assert len(health) >= 3  # checked every 0.2 s while the answer took 1 s


def test_a_frozen_server_fails_a_generation_within_twice_the_control_timeout():
    seconds = _seconds_until_error(
        lambda client: client.generate([GenerateRequest((1, 2), SamplingParams(max_new_tokens=1))]),
        r"no answer to a generation for 0.5 s, then the health check failed: .*GET /health: no answer")
    assert seconds < 2 * 0.5 + 2.0  # not the generation's own 300 s
