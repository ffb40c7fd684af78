"""SglangClient against answers recorded from a REAL SGLang 0.5.23 server (tests/rollout/
sglang/shapes.py, section "Recorded"; docs/sglang-cpu.md): each test fails if the client mis-parses
what SGLang actually sends (triples' order, a list for n outputs, `error` as a string or an object,
`rid`/`http_worker_ipc` in adapter answers), and the fake server of the flow tests answers the same."""

from __future__ import annotations

import asyncio
import json

import pytest

from graft.rollout.engine import AdapterAlreadyLoadedError, BadRequestError, EngineError, UnknownAdapterError
from graft.rollout.http_util import error_for, server_message
from graft.rollout.sglang import client as sc
from graft.rollout.sglang.client import SglangClient
from tests.rollout.sglang import shapes
from tests.rollout.sglang.fake_server import FakeSglang
from tests.rollout.sglang.test_client import ADDRESS


@pytest.fixture
def fake():
    server = FakeSglang()
    yield server
    server.stop()


def test_recorded_generate_answers_parse_to_the_served_tokens_and_logprobs():
    (c,) = sc.parse_generate_response(shapes.RECORDED_GENERATE[1], 1)
    assert c.token_ids == (850, 192, 209, 6) and c.finish_reason == "length"
    assert c.logprobs == (-6.508398532867432, -6.458697319030762, -6.491931438446045, -6.325403213500977)
    assert c.text == " flower\u0001\u0012$"
    a, b = sc.parse_generate_response(shapes.RECORDED_GENERATE_N2[1], 2)
    assert (a.token_ids, b.token_ids) == ((308, 907, 942), (886, 598, 715))
    assert b.logprobs[0] == -6.923368453979492  # the first element of each triple, not the token id
    with pytest.raises(EngineError, match="expected 1"):  # n outputs where one was asked for
        sc.parse_generate_response(shapes.RECORDED_GENERATE_N2[1], 1)


@pytest.mark.parametrize("recorded, expected, words", [
    (shapes.RECORDED_GENERATE_UNKNOWN_LORA, UnknownAdapterError, "never been loaded: policy-v9"),
    (shapes.RECORDED_GENERATE_LORA_NOT_ENABLED, BadRequestError, "LoRA is not enabled"),
    (shapes.RECORDED_GENERATE_INVALID, BadRequestError, 'invalid type: string "hot", expected f64'),
    (shapes.RECORDED_GENERATE_TOO_LONG, BadRequestError, "longer than the model's context length"),
    (shapes.RECORDED_LOAD_ALREADY, AdapterAlreadyLoadedError, "because it is already loaded"),
    (shapes.RECORDED_LOAD_MISSING_PATH, BadRequestError, "'/tmp/sgl/nope'"),
    (shapes.RECORDED_LOAD_NOT_ENABLED, BadRequestError, "Please set `--enable-lora`"),
    (shapes.RECORDED_UNLOAD_UNKNOWN, UnknownAdapterError, "LoRA with name policy-v1 does not exist"),
    (shapes.RECORDED_UPDATE_WEIGHTS_MISSING, BadRequestError, "Failed to get weights iterator"),
])
def test_recorded_errors_are_typed_with_sglangs_words(recorded, expected, words):
    status, body = recorded
    err = error_for("sglang", status, server_message(json.dumps(body)), address=ADDRESS, route="POST /x")
    assert type(err) is expected and err.status == status and words in str(err)


def test_recorded_lora_and_weight_answers():
    assert sc.parse_lora_update(shapes.RECORDED_LOAD_SECOND_OK[1], 200, address=ADDRESS, route="/l") == {
        "policy-v1": "/tmp/sgl/adapterA", "policy-v2": "/tmp/sgl/adapterB"}
    assert sc.parse_lora_update(shapes.RECORDED_UNLOAD_OK[1], 200, address=ADDRESS, route="/u") == {
        "policy-v2": "/tmp/sgl/adapterB"}
    with pytest.raises(AdapterAlreadyLoadedError):
        sc.parse_lora_update(shapes.RECORDED_LOAD_ALREADY[1], 400, address=ADDRESS, route="/l")
    sc.check_weights_update(shapes.RECORDED_UPDATE_WEIGHTS_OK[1], 200, address=ADDRESS)
    with pytest.raises(BadRequestError, match="Name or service not known"):
        sc.check_weights_update(shapes.RECORDED_UPDATE_WEIGHTS_MISSING[1], 400, address=ADDRESS)


def test_the_fake_answers_what_the_real_server_answered(fake):
    """The fake's adapter answers have the recorded keys, so the flow tests below exercise them."""
    async def flow():
        async with SglangClient(fake.url) as client:
            await client.load_adapter("policy-v1", "/tmp/sgl/adapterA")
            with pytest.raises(AdapterAlreadyLoadedError):
                await client.load_adapter("policy-v1", "/tmp/sgl/adapterA")
    asyncio.run(flow())
    assert fake.answers["/load_lora_adapter"][0][1].keys() == shapes.RECORDED_LOAD_OK[1].keys()
    assert fake.answers["/load_lora_adapter"][1] == shapes.RECORDED_LOAD_ALREADY
