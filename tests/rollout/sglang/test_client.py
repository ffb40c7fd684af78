"""SglangClient: request building and response parsing against SGLang's quoted shapes
(tests/rollout/sglang/shapes.py), then the whole client flow against a small in-process fake SGLang
HTTP server (fake_server.py) that answers with those shapes and records every call."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest

from graft.rollout.engine import (
    AdapterAlreadyLoadedError,
    BadRequestError,
    Completion,
    EngineError,
    EngineUnavailableError,
    GenerateRequest,
    RolloutEngine,
    SamplingParams,
    UnknownAdapterError,
)
from graft.rollout.http_util import error_for, server_message
from graft.rollout.launcher import free_port
from graft.rollout.sglang import client as sc
from graft.rollout.sglang.client import SglangClient
from tests.rollout.sglang import shapes
from tests.rollout.sglang.fake_server import FakeSglang

PROMPT = (791, 6864, 315, 9822, 374)
ADDRESS = "http://10.0.0.7:30000"


# --- request building ----------------------------------------------------------------------------


def test_generate_payload_matches_sglang_request_shape():
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=3, stop=("\n",), seed=5)
    assert sc.build_generate_payload(GenerateRequest(PROMPT, params), "policy-v3") == shapes.GENERATE_REQUEST


def test_generate_payload_unseeded_n_uses_parallel_sampling_and_base_model_has_no_lora():
    params = SamplingParams(n=2, max_new_tokens=3)
    assert sc.build_generate_payload(GenerateRequest(PROMPT, params), None) == shapes.GENERATE_REQUEST_N


def test_generate_payload_seeded_n_is_a_batch_with_one_seed_per_sample():
    payload = sc.build_generate_payload(GenerateRequest(PROMPT, SamplingParams(n=3, seed=10)), "policy-v3")
    assert payload["input_ids"] == [list(PROMPT)] * 3
    assert [p["sampling_seed"] for p in payload["sampling_params"]] == [10, 11, 12]
    assert all("n" not in p for p in payload["sampling_params"])
    assert payload["lora_path"] == "policy-v3" and payload["return_logprob"] is True


def test_adapter_and_weight_payloads_match_sglang_shapes():
    assert sc.build_load_payload("policy-v3", "/runs/r1/weights/adapter-v000003") == shapes.LOAD_LORA_REQUEST
    assert sc.build_unload_payload("policy-v3") == shapes.UNLOAD_LORA_REQUEST
    assert sc.build_update_weights_payload("/runs/r1/weights/merged-v000004") == shapes.UPDATE_WEIGHTS_REQUEST


# --- response parsing ----------------------------------------------------------------------------


def test_parse_single_output_into_completion():
    (c,) = sc.parse_generate_response(shapes.GENERATE_RESPONSE, 1)
    assert c == Completion((12366, 13, 198), (-0.2231, -1.2040, -0.0513), "length", " Paris.")


def test_parse_n_outputs_in_order_with_stop_reason():
    a, b = sc.parse_generate_response(shapes.GENERATE_RESPONSE_N2, 2)
    assert a.finish_reason == "length" and b.finish_reason == "stop"
    assert b.token_ids == (7566, 151643) and b.logprobs == (-0.6931, -0.0101)


def test_parse_rejects_abort_wrong_count_and_mismatched_ids():
    with pytest.raises(EngineError, match="Abort in waiting queue"):
        sc.parse_generate_response(shapes.GENERATE_RESPONSE_ABORT, 1, address=ADDRESS)
    with pytest.raises(EngineError, match="expected 2"):
        sc.parse_generate_response(shapes.GENERATE_RESPONSE, 2)
    broken = copy.deepcopy(shapes.GENERATE_RESPONSE)
    broken["output_ids"][0] = 1
    with pytest.raises(EngineError, match="disagree"):
        sc.parse_generate_response(broken, 1)
    no_logprobs = copy.deepcopy(shapes.GENERATE_RESPONSE)
    del no_logprobs["meta_info"]["output_token_logprobs"]
    with pytest.raises(EngineError, match="output_token_logprobs"):
        sc.parse_generate_response(no_logprobs, 1)


@pytest.mark.parametrize("shape, expected", [
    (shapes.GENERATE_ERROR_UNKNOWN_LORA, UnknownAdapterError),
    (shapes.GENERATE_ERROR_TOO_LONG, BadRequestError),
    (shapes.GENERATE_ERROR_VALIDATION, BadRequestError),
    (shapes.GENERATE_ERROR_UNAVAILABLE, EngineUnavailableError),
    (shapes.LOAD_LORA_ALREADY, AdapterAlreadyLoadedError),
    (shapes.LOAD_LORA_NOT_ENABLED, BadRequestError),
    (shapes.UNLOAD_LORA_UNKNOWN, UnknownAdapterError),
    (shapes.UPDATE_WEIGHTS_FAILED, BadRequestError),
    (shapes.FLUSH_CACHE_REFUSED, BadRequestError),
])
def test_error_shapes_map_to_typed_errors_with_sglang_words_and_address(shape, expected):
    status, body = shape
    text = body if isinstance(body, str) else json.dumps(body)
    words = server_message(text)
    err = error_for("sglang", status, words, address=ADDRESS, route="POST /x")
    assert type(err) is expected
    assert err.address == ADDRESS and err.status == status
    assert ADDRESS in str(err) and words.splitlines()[0] in str(err)


def test_lora_update_and_weights_update_answers():
    loaded = sc.parse_lora_update(shapes.LOAD_LORA_OK[1], 200, address=ADDRESS, route="/load_lora_adapter")
    assert loaded == {"policy-v3": "/runs/r1/weights/adapter-v000003"}
    assert sc.parse_lora_update(shapes.UNLOAD_LORA_OK[1], 200, address=ADDRESS, route="/u") == {}
    with pytest.raises(AdapterAlreadyLoadedError, match="already loaded"):
        sc.parse_lora_update(shapes.LOAD_LORA_ALREADY[1], 400, address=ADDRESS, route="/load_lora_adapter")
    with pytest.raises(UnknownAdapterError, match="does not exist"):  # success false even on a 200
        sc.parse_lora_update(shapes.UNLOAD_LORA_UNKNOWN[1], 200, address=ADDRESS, route="/unload_lora_adapter")
    sc.check_weights_update(shapes.UPDATE_WEIGHTS_OK[1], 200, address=ADDRESS)
    with pytest.raises(EngineError, match="Rolling back"):
        sc.check_weights_update(shapes.UPDATE_WEIGHTS_FAILED[1], 400, address=ADDRESS)


@pytest.fixture
def fake():
    server = FakeSglang()
    yield server
    server.stop()


# --- the client against the fake server ----------------------------------------------------------


def test_whole_flow_load_generate_unload_reload(fake):
    adapter_dir, merged_dir = "/runs/r1/weights/adapter-v000003", "/runs/r1/weights/merged-v000004"
    requests = [GenerateRequest(PROMPT, SamplingParams(max_new_tokens=3, seed=5)),
                GenerateRequest((1, 2), SamplingParams(n=2, max_new_tokens=3))]

    async def flow():
        async with SglangClient(fake.url) as client:
            assert isinstance(client, RolloutEngine) and client.address == fake.url
            assert (await client.health()).healthy
            await client.load_adapter("policy-v3", adapter_dir)
            listed = await client.list_adapters()
            out = await client.generate(requests, adapter="policy-v3")
            await client.unload_adapter("policy-v3")
            after = await client.list_adapters()
            await client.reload_weights(merged_dir)
            return listed, out, after

    listed, out, after = asyncio.run(flow())
    assert listed == ["policy-v3"] and after == []
    assert [len(c) for c in out] == [1, 2]
    assert out[0][0] == sc.parse_output(shapes.GENERATE_RESPONSE)
    assert [c.finish_reason for c in out[1]] == ["length", "stop"]

    assert fake.paths() == ["/health", "/load_lora_adapter", "/generate", "/generate", "/unload_lora_adapter",
                            "/update_weights_from_disk", "/flush_cache"]
    bodies = {path: body for _, path, body in fake.calls if path != "/generate"}
    assert bodies["/load_lora_adapter"] == {"lora_name": "policy-v3", "lora_path": adapter_dir}
    assert bodies["/unload_lora_adapter"] == {"lora_name": "policy-v3"}
    assert bodies["/update_weights_from_disk"] == {"model_path": merged_dir}
    generated = sorted((b for _, p, b in fake.calls if p == "/generate"), key=json.dumps)
    assert generated == sorted((sc.build_generate_payload(r, "policy-v3") for r in requests), key=json.dumps)
    assert all(b["lora_path"] == "policy-v3" for b in generated)


def test_adapter_errors_from_the_server_are_typed(fake):
    async def flow():
        async with SglangClient(fake.url) as client:
            await client.load_adapter("policy-v3", "/a")
            with pytest.raises(AdapterAlreadyLoadedError, match="already loaded"):
                await client.load_adapter("policy-v3", "/a")
            with pytest.raises(UnknownAdapterError, match="does not exist"):
                await client.unload_adapter("policy-v9")
            with pytest.raises(UnknownAdapterError, match="never been loaded"):
                await client.generate([GenerateRequest(PROMPT)], adapter="policy-v9")
            assert await client.list_adapters() == ["policy-v3"]

    asyncio.run(flow())


def test_generate_refuses_an_adapter_it_unloaded_without_asking_sglang(fake):
    async def flow():
        async with SglangClient(fake.url) as client:
            await client.load_adapter("policy-v3", "/a")
            await client.unload_adapter("policy-v3")
            calls_before = len(fake.calls)
            with pytest.raises(UnknownAdapterError, match="unloaded"):
                await client.generate([GenerateRequest(PROMPT)], adapter="policy-v3")
            assert len(fake.calls) == calls_before
            await client.load_adapter("policy-v3", "/a")  # loading it again lifts the refusal
            assert len(await client.generate([GenerateRequest(PROMPT)], adapter="policy-v3")) == 1

    asyncio.run(flow())


def test_reload_failures_carry_sglang_message(fake, monkeypatch):
    monkeypatch.setattr("graft.rollout.sglang.client._FLUSH_WAIT_S", 0.0)
    async def flow():
        async with SglangClient(fake.url) as client:
            fake.next_answer["/update_weights_from_disk"] = shapes.UPDATE_WEIGHTS_FAILED
            with pytest.raises(EngineError, match="Rolling back to original weights"):
                await client.reload_weights("/runs/r1/weights/merged-v000099")
            assert "/flush_cache" not in fake.paths()
            fake.flush_refusals = 10**6  # requests that never finish
            with pytest.raises(EngineError, match="NOT flushed") as info:
                await client.reload_weights("/runs/r1/weights/merged-v000004")
            assert info.value.address == fake.url and info.value.status == 400

    asyncio.run(flow())


def test_a_reload_waits_for_running_requests_to_flush_the_cache(fake, monkeypatch):
    """Weights updated while requests ran: SGLang keeps the prefix cache; the flush is retried until
    they drained, so no request is served from the old weights' cache after the reload returns."""
    monkeypatch.setattr("graft.rollout.sglang.client._FLUSH_WAIT_S", 0.01)

    async def flow():
        async with SglangClient(fake.url) as client:
            fake.next_answer["/update_weights_from_disk"] = shapes.UPDATE_WEIGHTS_NOT_FLUSHED
            fake.flush_refusals = 2
            await client.reload_weights("/runs/r1/weights/merged-v000004")
            assert fake.paths().count("/flush_cache") == 3 and fake.flush_refusals == 0

    asyncio.run(flow())


def test_generate_errors_and_aborts_from_the_server(fake):
    async def flow():
        async with SglangClient(fake.url) as client:
            fake.next_answer["/generate"] = shapes.GENERATE_ERROR_UNAVAILABLE
            with pytest.raises(EngineUnavailableError, match="shutting down"):
                await client.generate([GenerateRequest(PROMPT)])
            fake.next_answer["/generate"] = (200, shapes.GENERATE_RESPONSE_ABORT)
            with pytest.raises(EngineError, match="abort"):
                await client.generate([GenerateRequest(PROMPT)])
            fake.next_answer["/health"] = shapes.HEALTH_UNAVAILABLE
            health = await client.health()
            assert not health.healthy and "503" in health.detail and health.address == fake.url

    asyncio.run(flow())


def test_max_concurrency_bounds_generate_calls_in_flight(fake):
    fake.generate_delay_s = 0.05

    async def flow():
        async with SglangClient(fake.url, max_concurrency=2) as client:
            return await client.generate([GenerateRequest((i, i + 1)) for i in range(6)])

    out = asyncio.run(flow())
    assert len(out) == 6 and fake.peak_active == 2


def test_unreachable_server_is_unavailable_with_its_address():
    url = f"http://127.0.0.1:{free_port()}"

    async def flow():
        async with SglangClient(url, connect_retries=1) as client:
            with pytest.raises(EngineUnavailableError, match="cannot connect after 2 attempt") as info:
                await client.load_adapter("policy-v3", "/a")
            assert info.value.address == url and url in str(info.value)
            health = await client.health()
            assert not health.healthy and health.address == url and "cannot connect" in health.detail

    asyncio.run(flow())


def test_api_key_is_sent_and_its_absence_is_one_clear_error(fake):
    fake.api_key = "sk-sglang-1"

    async def flow():
        async with SglangClient(fake.url) as client:
            with pytest.raises(BadRequestError, match="requires an API key and graft sent none") as info:
                await client.load_adapter("policy-v3", "/a")
        async with SglangClient(fake.url, api_key="sk-sglang-1") as client:
            await client.load_adapter("policy-v3", "/a")
            out = await client.generate([GenerateRequest(PROMPT)], adapter="policy-v3")
        return info.value, out

    error, out = asyncio.run(flow())
    assert error.status == 401 and "rollout.api_key_env" in str(error)
    assert len(out) == 1 and fake.loaded == {"policy-v3": "/a"}


def test_constructor_rejects_bad_limits():
    with pytest.raises(ValueError, match="max_concurrency"):
        SglangClient("http://127.0.0.1:1", max_concurrency=0)
