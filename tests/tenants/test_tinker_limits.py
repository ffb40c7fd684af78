"""Every limit of the Tinker service and every field checked when parsed (graft.tenants.parse): each
abuse gets one 4xx line naming its field or limit (never a 500, never the server's directories), the
service keeps answering correct requests, its memory stays bounded, and one user's bad datums never
fail another user's forward_backward, in a shared pass or behind it."""

from __future__ import annotations

import os
import random
import threading

import httpx
import pytest
import tinker
from tinker import types

from graft.tenants.background import ServiceThread
from graft.tenants.command import tenant_service
from graft.tenants.users import Limits, Users

ANN, BOB = "tml-ann-limits-000001", "tml-bob-limits-000002"
LIMITS = Limits(body_bytes=1 << 20, datum_tokens=64, request_tokens=256, sample_tokens=512, models_per_user=3,
                sessions_per_user=4, pending_per_user=64)


@pytest.fixture(scope="module")
def running(base_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tenants-limits")
    with ServiceThread(lambda: tenant_service(base_dir, None, run_dir=run_dir, max_loras=4, max_rank=8,
                                              limits=LIMITS, batch_window_s=0.05),
                       Users({"ann": ANN, "bob": BOB})) as running:
        yield running


@pytest.fixture
def ann_http(running):
    with httpx.Client(base_url=running.url + "/api/v1", headers={"X-API-Key": ANN}, timeout=60) as http:
        yield http


def _model(http: httpx.Client, base: str) -> tuple[str, str]:
    session = http.post("/create_session", json={}).json()["session_id"]
    request_id = http.post("/create_model", json={"session_id": session, "base_model": base,
                                                  "lora_config": {"rank": 2}}).json()["request_id"]
    return session, http.post("/retrieve_future", json={"request_id": request_id}).json()["model_id"]


def _refused(response: httpx.Response, status: int, words: str) -> None:
    assert response.status_code == status, (response.status_code, response.text)
    detail = response.json()["detail"]
    assert words in detail and "\n" not in detail and "/tmp" not in detail and "/work" not in detail, detail


WRONG_TYPES = [
    ("/create_model", {"lora_config": "rank 4"}, "lora_config must be a JSON object"),
    ("/create_model", {"lora_config": {"rank": "4"}}, "'lora_config.rank' must be an integer"),
    ("/create_model", {"lora_config": {"rank": 9}}, "LoRA rank 9 is out of range"),
    ("/create_model", {"model_seq_id": 1.5}, "'model_seq_id' must be an integer"),
    ("/optim_step", {"adam_params": [1e-3]}, "adam_params must be a JSON object"),
    ("/optim_step", {"adam_params": {"learning_rate": "fast"}}, "'adam_params.learning_rate' must be a finite number"),
    ("/optim_step", {"adam_params": {"momentum": 0.9}}, "adam_params: unknown keys ['momentum']"),
    ("/optim_step", {"seq_id": "2"}, "'seq_id' must be an integer"),
    ("/save_weights", {"path": ["x"]}, "'path' must be a string"),
    ("/save_weights", {"path": "../up"}, "one path segment"),
    ("/load_weights", {"path": 7}, "'path' must be a string"),
    ("/asample", {"sampling_params": [1]}, "sampling_params must be a JSON object"),
    ("/asample", {"sampling_params": {"temperature": "hot"}}, "'sampling_params.temperature' must be a finite number"),
    ("/asample", {"prompt": "hello"}, "prompt must be a JSON object"),
    ("/asample", {"prompt": {"chunks": [{"tokens": ["a"]}]}}, "token ids must be integers"),
    ("/asample", {"prompt": {"chunks": [{"tokens": [10 ** 9]}]}}, "token id 1000000000 is outside the vocabulary"),
    ("/asample", {"num_samples": 10_000}, "'num_samples' must be in 1..512"),
    ("/asample", {"num_samples": 8, "sampling_params": {"max_tokens": 100}}, "over the limit of 512 per sample"),
    ("/get_info", {"model_id": {"$ne": 1}}, "'model_id' must be a string"),
]


def test_every_field_of_the_wrong_type_or_size_is_one_400_naming_it(running, ann_http, base_dir):
    session, model = _model(ann_http, str(base_dir))
    sampler = ann_http.post("/create_sampling_session", json={"session_id": session,
                                                              "base_model": str(base_dir)}).json()
    base = {"/create_model": {"session_id": session, "base_model": str(base_dir), "model_seq_id": 5},
            "/optim_step": {"model_id": model, "seq_id": 1}, "/save_weights": {"model_id": model, "seq_id": 1},
            "/load_weights": {"model_id": model, "seq_id": 1},
            "/asample": {"sampling_session_id": sampler["sampling_session_id"],
                         "prompt": {"chunks": [{"tokens": [5]}]}},
            "/get_info": {}}
    for seq, (route, fields, words) in enumerate(WRONG_TYPES):
        body = {**base[route], **fields}
        if "seq_id" in base[route] and "seq_id" not in fields:
            body["seq_id"] = running.service.models[model].next_seq + len(running.service.models[model].waiting)
        _refused(ann_http.post(route, json=body), 400, words)
    _refused(ann_http.post("/create_session", content=b"{not json"), 400, "not valid JSON")
    assert ann_http.post("/get_info", json={"model_id": model}).json()["lora_rank"] == 2  # still answering
    assert ann_http.post(f"/sessions/{session}/finish", json={}).status_code == 200


def test_a_body_over_the_limit_is_refused_unread(ann_http):
    _refused(ann_http.post("/create_session", content=b"x" * (LIMITS.body_bytes + 1)), 413, "--max-body-bytes")

    def chunks():  # no Content-Length: the size is counted as it arrives
        for _ in range(LIMITS.body_bytes // 65536 + 2):
            yield b" " * 65536

    _refused(ann_http.post("/create_session", content=chunks()), 413, "--max-body-bytes")


def _datum(tokens: list[int], weights: bool = True) -> types.Datum:
    inputs = {"target_tokens": tokens[1:]}
    if weights:
        inputs["weights"] = [1.0] * (len(tokens) - 1)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def test_datum_request_and_holding_limits_each_refused_with_one_line(running, base_dir):
    with tinker.ServiceClient(base_url=running.url, api_key=ANN) as ann:
        training = ann.create_lora_training_client(base_model=str(base_dir), rank=2).result()
        with pytest.raises(tinker.BadRequestError, match="over the limit of 64 per datum"):
            training.forward_backward([_datum(list(range(3, 80)))], "cross_entropy").result()
        with pytest.raises(tinker.BadRequestError, match="--max-request-tokens"):
            training.forward_backward([_datum(list(range(3, 60)))] * 5, "cross_entropy").result()
        more = [ann.create_lora_training_client(base_model=str(base_dir), rank=2).result() for _ in range(2)]
        with pytest.raises(tinker.BadRequestError, match="limit per user \\(--max-models\\)"):
            ann.create_lora_training_client(base_model=str(base_dir), rank=2).result()
        assert training.forward([_datum(list(range(3, 20)))], "cross_entropy").result().metrics["loss:sum"] > 0
        assert len(more) == 2
    with tinker.ServiceClient(base_url=running.url, api_key=BOB) as bob:  # ann's limits are not bob's
        bob.create_lora_training_client(base_model=str(base_dir), rank=2).result()
    with httpx.Client(base_url=running.url + "/api/v1", headers={"X-API-Key": ANN}, timeout=60) as http:
        sessions = [http.post("/create_session", json={}) for _ in range(LIMITS.sessions_per_user + 1)]
        assert [response.status_code for response in sessions] == [200] * LIMITS.sessions_per_user + [400]
        _refused(sessions[-1], 400, "limit per user (--max-sessions)")
        for response in sessions[:-1]:
            assert http.post(f"/sessions/{response.json()['session_id']}/finish", json={}).status_code == 200


def test_one_users_bad_datums_never_fail_anothers_pass(running, base_dir):
    """20 rounds: ann's good datum and bob's bad one (a token outside the vocabulary, no weights, or a
    NaN weight) sent at the same time; ann's loss each round is what her datum alone gives."""
    vocab = running.service.policy.model.get_input_embeddings().num_embeddings
    rng = random.Random(0)
    with (tinker.ServiceClient(base_url=running.url, api_key=ANN) as ann,
          tinker.ServiceClient(base_url=running.url, api_key=BOB) as bob):
        good = ann.create_lora_training_client(base_model=str(base_dir), rank=2, seed=3).result()
        bad = bob.create_lora_training_client(base_model=str(base_dir), rank=2, seed=4).result()
        tokens = [rng.randrange(3, 200) for _ in range(12)]
        expected = good.forward([_datum(tokens)], "cross_entropy").result().metrics["loss:sum"]
        for round_ in range(20):
            bad_datum = [_datum([*tokens[:-1], vocab + round_]), _datum(tokens, weights=False),
                         _nan_weighted(tokens)][round_ % 3]
            errors: list[Exception] = []
            thread = threading.Thread(target=_expect_refusal, args=(bad, bad_datum, errors))
            thread.start()
            got = good.forward([_datum(tokens)], "cross_entropy").result().metrics["loss:sum"]
            thread.join(60)
            assert got == pytest.approx(expected, rel=1e-6), f"round {round_}"
            assert len(errors) == 1 and isinstance(errors[0], tinker.BadRequestError), errors


def _nan_weighted(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [float("nan")] * (len(tokens) - 1)})


def _expect_refusal(training, datum, errors: list) -> None:
    try:
        training.forward([datum], "cross_entropy").result()
    except Exception as error:  # noqa: BLE001 - the test checks which
        errors.append(error)


def test_memory_stays_bounded_under_1000_abusive_requests(running, ann_http, base_dir):
    session, model = _model(ann_http, str(base_dir))
    abuse = [lambda: ann_http.post("/get_info", json={"model_id": ["x"] * 1000}),
             lambda: ann_http.post("/create_session", content=b"{" * 100_000),
             lambda: ann_http.post("/retrieve_future", json={"request_id": "req-" + "f" * 24}),
             lambda: ann_http.post("/create_model", json={"session_id": session, "base_model": "x" * 5000}),
             lambda: ann_http.post("/asample", json={"sampling_session_id": "s", "num_samples": 10 ** 6})]
    for warmup in range(50):
        abuse[warmup % len(abuse)]()
    before = _rss_kib()
    for index in range(1000):
        response = abuse[index % len(abuse)]()
        assert 400 <= response.status_code < 500, response.text
    after = _rss_kib()
    assert after <= before * 1.10, f"RSS grew {before} -> {after} KiB"
    assert ann_http.post("/get_info", json={"model_id": model}).status_code == 200
    assert ann_http.post(f"/sessions/{session}/finish", json={}).status_code == 200


def _rss_kib() -> int:
    """This process's resident memory now (the service runs in it, on a thread)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
