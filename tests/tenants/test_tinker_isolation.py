"""Two users of one Tinker service (graft.tenants.users), each with their own key: ann trains, saves
and samples through the real `tinker` SDK; bob, with his own key, tries every route on ann's ids and
`tinker://` paths over raw HTTP. Each of bob's tries must answer exactly as the same try on an id that
never existed (no route acts on ann's things or reveals them), ann's model must be untouched, and
bob's datum sent at ann's next seq_id must not be taken as ann's. Backed by the session's vLLM server,
left with no adapter loaded."""

from __future__ import annotations

import functools
import random
import re

import httpx
import pytest
import tinker
import torch
from tinker import types

from graft.tenants.background import ServiceThread
from graft.tenants.command import served_tenants
from graft.tenants.users import Users

pytestmark = pytest.mark.vllm
ANN, BOB = "tml-ann-isolation-0001", "tml-bob-isolation-0002"
NEVER = {"session": "session-0123456789abcdef", "model": "session-0123456789abcdef:train:0",
         "sampler": "sampler-0123456789abcdef", "request": "req-" + "0" * 24}


@pytest.fixture(scope="module")
def running(base_dir, vllm_server, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tenants-isolation")

    # batch-invariant: a user's results are the same bits whatever else the service ran (docs/tenants.md)
    service = functools.partial(served_tenants, vllm_server.url, base_dir, run_dir=run_dir, max_loras=4, max_rank=8,
                                batch_invariant=True)

    with ServiceThread(service, Users({"ann": ANN, "bob": BOB})) as running:
        yield running


def _datum(seed: int) -> types.Datum:
    rng = random.Random(seed)
    tokens = [rng.randrange(3, 200) for _ in range(10)]
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 9})


def _anns_things(service_client: tinker.ServiceClient, base: str) -> dict[str, str]:
    """ann's session, model, sampling session, sampler weights, saved state and a request id."""
    training = service_client.create_lora_training_client(base_model=base, rank=4, seed=1).result()
    training.forward_backward([_datum(1)], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    state = training.save_state("mine").result().path
    sampler_path = training.save_weights_for_sampler("mine").result().path
    sampler = service_client.create_sampling_client(model_path=sampler_path).result()
    return {"session": training.model_id.split(":")[0], "model": training.model_id,
            "sampler": sampler._sampling_session_id, "state": state, "sampler_path": sampler_path}


def _tries(things: dict[str, str], base: str, next_seq: int) -> list[tuple[str, str, dict | None]]:
    """Every route that takes an id or path, as bob would call it with `things`' ids."""
    model, session = things["model"], things["session"]
    return [
        ("POST", "/session_heartbeat", {"session_id": session}),
        ("POST", f"/sessions/{session}/finish", {}),
        ("POST", "/create_model", {"session_id": session, "model_seq_id": 9, "base_model": base,
                                   "lora_config": {"rank": 2}}),
        ("POST", "/get_info", {"model_id": model}),
        ("POST", "/optim_step", {"model_id": model, "seq_id": next_seq, "adam_params": {"learning_rate": 1.0}}),
        ("POST", "/save_weights_for_sampler", {"model_id": model, "seq_id": next_seq, "path": "stolen"}),
        ("POST", "/save_weights", {"model_id": model, "seq_id": next_seq, "path": "mine", "overwrite": True}),
        ("POST", "/load_weights", {"model_id": model, "seq_id": next_seq, "path": things["state"]}),
        ("POST", "/load_weights", {"session_id": session, "model_seq_id": 9, "path": things["state"]}),
        ("POST", "/create_sampling_session", {"session_id": session, "base_model": base}),
        ("POST", "/create_sampling_session", {"session_id": "{bob}", "model_path": things["sampler_path"]}),
        ("GET", f"/samplers/{things['sampler']}", None),
        ("POST", "/asample", {"sampling_session_id": things["sampler"], "num_samples": 1,
                              "prompt": {"chunks": [{"tokens": [5, 6, 7]}]}, "sampling_params": {"max_tokens": 2}}),
        ("POST", "/retrieve_future", {"request_id": things["request"]}),
    ]


def _never(things: dict[str, str]) -> dict[str, str]:
    """`things` with every id and path replaced by one that never existed."""
    model = NEVER["model"]
    return {**NEVER, "state": f"tinker://{model}/weights/mine", "sampler_path": f"tinker://{model}/sampler_weights/mine"}


def _answer(http: httpx.Client, method: str, route: str, body: dict | None, names: dict[str, str]) -> tuple:
    response = http.request(method, route, json=body)
    text = response.text
    for key in sorted(names, key=lambda k: -len(names[k])):
        text = text.replace(names[key], f"<{key}>")
    return response.status_code, re.sub(r"req-[0-9a-f]{24}", "<new request>", text)


def test_another_users_ids_and_paths_answer_as_ones_that_never_existed(running, base_dir):
    base = str(base_dir)
    with tinker.ServiceClient(base_url=running.url, api_key=ANN) as ann:
        things = _anns_things(ann, base)
        model = running.service.models[things["model"]]
        things["request"] = running.service.scheduler.models[things["model"]].issued[model.next_seq - 1][1]
        before = {k: p.detach().clone() for k, p in running.service.policy.parameters(model.tenant).items()}
        next_seq = model.next_seq
        headers = {"X-API-Key": BOB}
        table = []
        with httpx.Client(base_url=running.url + "/api/v1", headers=headers, timeout=60) as bob:
            bobs_session = bob.post("/create_session", json={}).json()["session_id"]
            for real, never in zip(_tries(things, base, next_seq), _tries(_never(things), base, next_seq),
                                   strict=True):
                for call in (real, never):
                    if call[2] and call[2].get("session_id") == "{bob}":
                        call[2]["session_id"] = bobs_session
                got = _answer(bob, *real, things)
                expected = _answer(bob, *never, _never(things))
                table.append((real[1], got[0]))
                assert got == expected, f"{real[0]} {real[1]}: ann's ids answer {got}, ids never made {expected}"
                assert got[0] in (404, 410), f"{real[1]} acted on ann's things: {got}"
        after = running.service.policy.parameters(model.tenant)
        assert all(torch.equal(before[k], after[k]) for k in before), "bob's requests changed ann's adapter"
        assert model.next_seq == next_seq and not model.waiting, "bob's requests took ann's places"
        # ann goes on as if bob had never been there: her next operations take her next seq_ids
        training = ann.create_training_client_from_state(things["state"]).result()
        assert training.forward([_datum(1)], "cross_entropy").result().metrics["loss:sum"] > 0


def _forward_backward_body(model_id: str, seq_id: int, datum: types.Datum) -> bytes:
    """A forward_backward body as the SDK encodes it (its own protobuf conversion)."""
    from tinker.proto.request_conv import forward_backward_request_to_proto

    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"),
        model_id=model_id, seq_id=seq_id)
    return forward_backward_request_to_proto(request).SerializeToString()


def test_a_forward_backward_at_another_users_next_seq_id_is_not_taken_as_theirs(running, base_dir):
    """The SDK's resend rule (same seq_id and kind: the first answer) must never hand one user's
    request id, nor run one user's datums, as another's: bob's pass sent at ann's next seq_id, before
    and after ann's own, leaves ann's loss her data's."""
    with tinker.ServiceClient(base_url=running.url, api_key=ANN) as ann:
        training = ann.create_lora_training_client(base_model=str(base_dir), rank=4, seed=2).result()
        expected = training.forward([_datum(7)], "cross_entropy").result().metrics["loss:sum"]
        model = running.service.models[training.model_id]
        with httpx.Client(base_url=running.url + "/api/v1", timeout=60) as http:
            hijack = http.post("/forward_backward", content=_forward_backward_body(training.model_id, model.next_seq,
                                                                                   _datum(8)),
                               headers={"X-API-Key": BOB, "Content-Type": "application/x-protobuf"})
            assert hijack.status_code == 404, hijack.text
            got = training.forward_backward([_datum(7)], "cross_entropy").result().metrics["loss:sum"]
            assert got == expected, "ann's pass returned another datum's loss"
            resent = http.post("/forward_backward", content=_forward_backward_body(training.model_id,
                                                                                   model.next_seq - 1, _datum(8)),
                               headers={"X-API-Key": BOB, "Content-Type": "application/x-protobuf"})
            assert resent.status_code == 404 and "req-" not in resent.text


def test_idempotency_answers_are_the_users_and_the_routes_own(running):
    with httpx.Client(base_url=running.url + "/api/v1", timeout=60) as http:
        key = {"X-Idempotency-Key": "same-key"}
        ann = http.post("/create_session", json={}, headers={"X-API-Key": ANN, **key}).json()
        assert http.post("/create_session", json={}, headers={"X-API-Key": ANN, **key}).json() == ann
        bob = http.post("/create_session", json={}, headers={"X-API-Key": BOB, **key}).json()
        assert bob["session_id"] != ann["session_id"]
        info = http.post("/get_info", json={"model_id": "x"}, headers={"X-API-Key": ANN, **key})
        assert info.status_code == 404 and "session_id" not in info.text
        for session, user in ((ann["session_id"], ANN), (bob["session_id"], BOB)):
            assert http.post(f"/sessions/{session}/finish", json={}, headers={"X-API-Key": user}).status_code == 200


def test_the_rest_listing_shows_a_user_their_own_runs_and_checkpoints(running, base_dir):
    """The SDK's RestClient: each user lists their own runs and checkpoints only, reads a run, and
    deletes a checkpoint; another user's run is unknown."""
    with tinker.ServiceClient(base_url=running.url, api_key=ANN) as ann:
        training = ann.create_lora_training_client(base_model=str(base_dir), rank=4, seed=5).result()
        training.forward_backward([_datum(5)], "cross_entropy").result()
        first = training.save_state("one").result().path
        second = training.save_state("two").result().path
        sampler = training.save_weights_for_sampler("s1").result().path
        rest = tinker.RestClient(base_url=running.url, api_key=ANN)
        run = rest.get_training_run(training.model_id).result()
        assert run.model_owner == "ann" and run.lora_rank == 4 and run.last_checkpoint.tinker_path == second
        listed = rest.list_checkpoints(training.model_id).result().checkpoints
        assert [c.tinker_path for c in listed] == [first, second, sampler]
        assert {c.checkpoint_type for c in listed} == {"training", "sampler"}
        mine = {c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints}
        assert {first, second, sampler} <= mine
        assert training.model_id in {r.training_run_id for r in rest.list_training_runs().result().training_runs}
        rest.delete_checkpoint_from_tinker_path(first).result()
        assert [c.tinker_path for c in rest.list_checkpoints(training.model_id).result().checkpoints] == [second,
                                                                                                        sampler]
        with pytest.raises(tinker.NotFoundError):
            ann.create_training_client_from_state(first).result()
        bobs = tinker.RestClient(base_url=running.url, api_key=BOB)
        assert training.model_id not in {r.training_run_id for r in bobs.list_training_runs().result().training_runs}
        assert not {second, sampler} & {c.tinker_path for c in bobs.list_user_checkpoints().result().checkpoints}
        for call in (lambda: bobs.get_training_run(training.model_id).result(),
                     lambda: bobs.list_checkpoints(training.model_id).result(),
                     lambda: bobs.delete_checkpoint_from_tinker_path(second).result()):
            with pytest.raises(tinker.NotFoundError):
                call()
        assert second in {c.tinker_path for c in rest.list_checkpoints(training.model_id).result().checkpoints}


def test_one_users_flood_of_samples_does_not_hold_anothers_behind_it(base_dir, vllm_server, tmp_path):
    """ann sends 24 sample requests of 8 x 48 tokens at once, bob one of 2 tokens right after: each
    user's share of the engine (2 requests here) queues that user's own requests, never another's, so
    bob's is answered long before ann's last."""
    import time

    from graft.tenants.users import Limits

    service = functools.partial(served_tenants, vllm_server.url, base_dir, run_dir=tmp_path, max_loras=4,
                                max_rank=8, limits=Limits(engine_per_user=2))

    prompt = types.ModelInput.from_ints([5, 6, 7, 8])
    with (ServiceThread(service, Users({"ann": ANN, "bob": BOB})) as running,
          tinker.ServiceClient(base_url=running.url, api_key=ANN) as ann,
          tinker.ServiceClient(base_url=running.url, api_key=BOB) as bob):
        floods = ann.create_sampling_client(base_model=str(base_dir)).result()
        small = bob.create_sampling_client(base_model=str(base_dir)).result()
        done: dict[str, float] = {}
        big = types.SamplingParams(max_tokens=48, temperature=1.0, stop=[])
        futures = [floods.sample(prompt, 8, big) for _ in range(24)]
        time.sleep(0.5)
        small.sample(prompt, 1, types.SamplingParams(max_tokens=2, stop=[])).result()
        done["bob"] = time.monotonic()
        for future in futures:
            future.result()
        done["ann"] = time.monotonic()
        assert done["bob"] < done["ann"], "bob's sample waited for ann's flood"
