"""The real `tinker` SDK (0.38.0) training against graft's Tinker service over HTTP: two tenants whose
clients run at the same time share forward_backward passes, and each ends exactly where it would
have trained alone; forward gives the policy's log-probs; bad requests get one clear error each."""

from __future__ import annotations

import random
import threading
import time

import httpx
import pytest
import tinker
import torch
from tinker import types

from graft.models.loading import load_model
from graft.tenants.background import ServiceThread
from graft.tenants.command import tenant_service
from graft.tenants.policy import AdamParams, Datum, TenantPolicy, TenantSpec
from graft.tenants.service import ATTENTION, MLP
from graft.tenants.users import SINGLE_USER

API_KEY = "tml-graft-tests"
STEPS = 3
LEARNING_RATES = {0: 1e-2, 1: 3e-3}


@pytest.fixture(scope="module")
def running(base_dir, tmp_path_factory):
    """The service with no engine (training only), a 50 ms window so both clients' passes meet."""
    run_dir = tmp_path_factory.mktemp("tenants")
    with ServiceThread(lambda: tenant_service(base_dir, None, run_dir=run_dir, max_loras=4, max_rank=8,
                                              batch_window_s=0.05), API_KEY) as running:
        yield running


def _sequences(client: int, step: int) -> list[list[int]]:
    rng = random.Random(f"{client}-{step}")
    return [[rng.randrange(3, 200) for _ in range(rng.randint(6, 12))] for _ in range(2)]


def _weights(tokens: list[int]) -> list[float]:
    return [float(i >= 2) for i in range(len(tokens) - 1)]


def _sdk_datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": _weights(tokens)})


def _train(service_client: tinker.ServiceClient, base: str, client: int, out: dict) -> None:
    training = service_client.create_lora_training_client(base_model=base, rank=4, seed=client + 1).result()
    for step in range(STEPS):
        backward = training.forward_backward([_sdk_datum(t) for t in _sequences(client, step)], "cross_entropy")
        optim = training.optim_step(types.AdamParams(learning_rate=LEARNING_RATES[client]))
        out.setdefault(client, []).append(backward.result().metrics["loss:sum"])
        optim.result()
    out[f"model{client}"] = training.model_id


def _solo(base_dir, client: int) -> dict[str, torch.Tensor]:
    """The same tenant trained alone on the same datums, in this process."""
    policy = TenantPolicy(load_model(base_dir))
    policy.add(TenantSpec("solo", rank=4, alpha=4.0, target_modules=ATTENTION + MLP, seed=client + 1))
    for step in range(STEPS):
        policy.forward_backward([Datum("solo", t, {"weights": _weights(t)}) for t in _sequences(client, step)],
                                "cross_entropy")
        assert policy.optim_step("solo", AdamParams(learning_rate=LEARNING_RATES[client])).applied
    return {name.replace(".solo.", "."): p.detach().clone() for name, p in policy.parameters("solo").items()}


@pytest.fixture
def service_client(running):
    """A client whose session ends with the test (an open one's heartbeat thread outlives the service
    and warns for the rest of the test run)."""
    with tinker.ServiceClient(base_url=running.url, api_key=API_KEY) as client:
        yield client


def test_two_clients_at_once_share_passes_and_train_as_if_alone(running, service_client, base_dir):
    out: dict = {}
    threads = [threading.Thread(target=_train, args=(service_client, str(base_dir), c, out)) for c in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert len(out[0]) == len(out[1]) == STEPS, out
    assert max(running.service.pass_sizes) == 2, f"no pass held both tenants: {running.service.pass_sizes}"
    for client in (0, 1):
        tenant = running.service.models[out[f"model{client}"]].tenant
        served = {name.replace(f".{tenant}.", "."): p.detach() for name, p in
                  running.service.policy.parameters(tenant).items()}
        solo = _solo(base_dir, client)
        assert served.keys() == solo.keys()
        worst = max(((served[k] - solo[k]).norm() / solo[k].norm()).item() for k in solo)
        assert worst <= 1e-6, f"client {client}: adapter differs from its solo run by {worst:.2e} (relative)"
        assert any(".lora_B." in k and solo[k].abs().max() > 0 for k in solo), "the adapter never moved"


def test_forward_gives_the_tenants_logprobs_and_no_update(running, service_client, base_dir):
    training = service_client.create_lora_training_client(base_model=str(base_dir), rank=2).result()
    tokens = _sequences(7, 0)[0]
    first = training.forward([_sdk_datum(tokens)], "cross_entropy").result()
    again = training.forward([_sdk_datum(tokens)], "cross_entropy").result()
    logprobs = first.loss_fn_outputs[0]["logprobs"].tolist()
    assert len(logprobs) == len(tokens) - 1 and all(value < 0 for value in logprobs)
    assert again.loss_fn_outputs[0]["logprobs"].tolist() == logprobs
    expected = -sum(w * lp for w, lp in zip(_weights(tokens), logprobs, strict=True))
    assert first.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)
    tenant = running.service.models[training.model_id].tenant
    assert all(p.grad is None for p in running.service.policy.parameters(tenant).values())


def test_bad_requests_get_one_clear_error(running, service_client, base_dir):
    with pytest.raises(tinker.BadRequestError, match="not served"):
        service_client.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result()
    with pytest.raises(tinker.BadRequestError, match="rank 64 is out of range"):
        service_client.create_lora_training_client(base_model=str(base_dir), rank=64).result()
    training = service_client.create_lora_training_client(base_model=str(base_dir), rank=2).result()
    tokens = _sequences(9, 0)[0]
    unshifted = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": tokens[:-1], "weights": _weights(tokens)})
    with pytest.raises(tinker.BadRequestError, match="shifted by one"):  # refused at once, its seq_id skipped
        training.forward_backward([unshifted], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match="unknown loss_fn 'bogus'"):
        training.forward_backward([_sdk_datum(tokens)], "bogus").result()
    with (pytest.raises(tinker.AuthenticationError),
          tinker.ServiceClient(base_url=running.url, api_key="tml-wrong-key") as stranger):
        stranger.create_lora_training_client(base_model=str(base_dir), rank=2).result()


def _adapter(running, model_id: str) -> dict[str, torch.Tensor]:
    tenant = running.service.models[model_id].tenant
    return {name.replace(f".{tenant}.", "."): p.detach().clone()
            for name, p in running.service.policy.parameters(tenant).items()}


def test_saved_state_resumes_exactly_and_is_a_peft_adapter(running, service_client, base_dir):
    training = service_client.create_lora_training_client(base_model=str(base_dir), rank=4, seed=5).result()

    def step(client, index: int) -> None:
        client.forward_backward([_sdk_datum(t) for t in _sequences(11, index)], "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()

    for index in range(2):
        step(training, index)
    path = training.save_state("after-2").result().path
    assert path == f"tinker://{training.model_id}/weights/after-2"
    step(training, 2)
    uninterrupted = _adapter(running, training.model_id)

    resumed = service_client.create_training_client_from_state_with_optimizer(path).result()
    step(resumed, 2)
    assert resumed.model_id != training.model_id
    after = _adapter(running, resumed.model_id)
    assert after.keys() == uninterrupted.keys()
    assert all(torch.equal(after[k], uninterrupted[k]) for k in after), "resume with the optimizer is not exact"

    fresh = service_client.create_training_client_from_state(path).result()  # weights only: a fresh AdamW
    step(fresh, 2)
    assert any(not torch.equal(_adapter(running, fresh.model_id)[k], uninterrupted[k]) for k in uninterrupted)

    import peft

    state_dir = running.service.state_dir(SINGLE_USER, path)
    peft_model = peft.PeftModel.from_pretrained(load_model(base_dir), state_dir)
    loaded = {k.replace(".default.", "."): v for k, v in peft_model.state_dict().items() if ".lora_" in k}
    assert loaded.keys() == uninterrupted.keys()
    with pytest.raises(tinker.BadRequestError, match="not a training state path"):
        service_client.create_training_client_from_state("tinker://nowhere").result()


def test_a_silent_session_is_finished_and_its_tenant_released(base_dir, tmp_path):
    """A client that stops sending heartbeats (it died) loses its session after the timeout; its
    tenant goes, and requests naming it are refused."""
    with ServiceThread(lambda: tenant_service(base_dir, None, run_dir=tmp_path, max_loras=4, max_rank=8,
                                              session_timeout_s=1.0), API_KEY) as running:
        session = running.call(_session_with_a_model(running.service))
        assert len(running.service.models) == 1
        deadline = time.monotonic() + 10
        while running.service.models and time.monotonic() < deadline:
            time.sleep(0.1)
        assert running.service.models == {} and session not in running.service.sessions
        assert running.service.policy.tenants == {}
        assert running.service.heartbeat(SINGLE_USER, session) is False  # the SDK's heartbeat: 410, it stops


async def _session_with_a_model(service) -> str:
    session = service.create_session(SINGLE_USER)
    request_id = service.create_model(SINGLE_USER, session, 0, service.base_model, rank=2, seed=None,
                                      train_attn=True, train_mlp=True)
    assert (await service.futures.wait(SINGLE_USER, request_id, 60))["model_id"] == f"{session}:train:0"
    return session


def test_a_request_sent_again_gets_the_first_ones_answer_and_runs_once(running, base_dir):
    """The SDK sends a request again, with a new idempotency key, when its answer was lost (a timeout:
    under a full test run's load a cookbook recipe's first save_weights_for_sampler was refused as a
    used seq_id, which failed the recipe). The same model_seq_id or seq_id and kind get the same
    request id, and the operation runs once; another kind at a used seq_id is still refused."""
    headers = {"X-API-Key": API_KEY}
    with httpx.Client(base_url=running.url + "/api/v1", headers=headers, timeout=60) as http:
        session = http.post("/create_session", json={}).json()["session_id"]
        create = {"session_id": session, "model_seq_id": 0, "base_model": str(base_dir), "lora_config": {"rank": 2}}
        first, again = (http.post("/create_model", json=create).json()["request_id"] for _ in range(2))
        assert first == again and len(running.service.sessions[session].models) == 1
        model_id = http.post("/retrieve_future", json={"request_id": first}).json()["model_id"]
        step = {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}}
        first, again = (http.post("/optim_step", json=step).json()["request_id"] for _ in range(2))
        assert first == again
        assert http.post("/retrieve_future", json={"request_id": first}).status_code == 200
        assert running.service.models[model_id].next_seq == 2  # one optim_step ran
        refused = http.post("/save_weights_for_sampler", json={"model_id": model_id, "seq_id": 1})
        assert refused.status_code == 400 and "seq_id 1 was used already" in refused.json()["detail"]


def _rl_datum(tokens: list[int], seed: int) -> types.Datum:
    rng = random.Random(seed)
    count = len(tokens) - 1
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:],
                                       "logprobs": [-rng.uniform(0.5, 6.0) for _ in range(count)],
                                       "advantages": [rng.uniform(-1.0, 1.0) for _ in range(count)]})


def test_the_sdks_rl_losses_read_their_loss_fn_config(service_client, base_dir):
    """cispo, dro and ppo through the SDK: the loss each reports is its definition's
    (graft.tenants.losses, checked against the SDK's in tests/tenants/test_losses.py) on the tenant's
    own log-probs, and a loss_fn_config changes it as the definition says."""
    from graft.tenants.losses import LOSSES, loss_config

    training = service_client.create_lora_training_client(base_model=str(base_dir), rank=2, seed=8).result()
    tokens = _sequences(13, 0)[0]
    datum = _rl_datum(tokens, 1)
    logprobs_C = torch.tensor(training.forward([_sdk_datum(tokens)], "cross_entropy").result()
                              .loss_fn_outputs[0]["logprobs"].tolist(), dtype=torch.float64)
    inputs = {key: torch.tensor(datum.loss_fn_inputs[key].tolist(), dtype=torch.float64)
              for key in ("logprobs", "advantages")}
    for loss, config in (("cispo", None), ("cispo", {"clip_high_threshold": 1.1}), ("dro", {"beta": 0.5}),
                         ("ppo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5})):
        got = training.forward([datum], loss, loss_fn_config=config).result().metrics["loss:sum"]
        expected = LOSSES[loss].fn(logprobs_C, inputs, loss_config(loss, config)).item()
        assert got == pytest.approx(expected, rel=1e-4, abs=1e-5), (loss, config)
    with pytest.raises(tinker.BadRequestError, match="loss_fn_config"):
        training.forward_backward([datum], "dro", loss_fn_config={"eps": 0.1}).result()


def test_forward_backward_custom_trains_as_its_loss_says(service_client, base_dir):
    """The SDK's forward_backward_custom (a forward, the client's loss on the log-probs, then a
    weighted cross_entropy pass carrying its gradient): a custom loss equal to cross-entropy steps the
    tenant exactly as cross_entropy does."""
    tokens = _sequences(17, 0)[0]

    def custom(data, logprobs_list):
        loss = -sum((torch.tensor(_weights(tokens)) * lp).sum() for lp in logprobs_list)
        return loss, {"custom": loss.item()}

    adapters = []
    for use_custom in (False, True):
        training = service_client.create_lora_training_client(base_model=str(base_dir), rank=2, seed=9).result()
        if use_custom:
            result = training.forward_backward_custom([_sdk_datum(tokens)], custom).result()
            assert "custom" in result.metrics
        else:
            training.forward_backward([_sdk_datum(tokens)], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        adapters.append(training.forward([_sdk_datum(tokens)], "cross_entropy").result().metrics["loss:sum"])
    assert adapters[1] == pytest.approx(adapters[0], rel=1e-5)
