"""`torchrun --nproc-per-node 2 graft tenants serve --engine-url A --engine-url B`: the Tinker service
on 2 gloo ranks (graft.tenants.ranks) sampling from 2 vLLM-CPU servers (an `EnginePool`), driven by
the real `tinker` SDK. Two clients train at once and their losses fall; one server is killed mid-run
and the run goes on on the other; a tenant's saved state is its one-process training (to Adam's
rounding); SIGTERM ends every rank promptly."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import safetensors.torch
import tinker
from tinker import types

from graft.models.loading import load_model
from graft.rollout.launcher import free_port
from graft.rollout.vllm.launcher import VllmServer, VllmServerConfig
from graft.tenants.policy import AdamParams, Datum, TenantPolicy, TenantSpec
from graft.tenants.service import ATTENTION, MLP
from graft.tenants.users import SINGLE_USER
from tests.helpers import assert_adam_weights_close
from tests.tenants.test_tinker_training import _sdk_datum, _sequences, _weights

pytestmark = pytest.mark.vllm
API_KEY = "tml-graft-ranks-test"
STEPS = 3
KILLED_AFTER = 1  # the second server is killed once both clients sampled at this step
LEARNING_RATE = 1e-2
PROMPT = [5, 17, 42, 9, 33]


@pytest.fixture
def second_server(base_dir, tmp_path):
    """A vLLM server of this test's own, as the session's: the one killed mid-run."""
    config = VllmServerConfig(model=str(base_dir), dtype="float32", max_lora_rank=8, log_dir=tmp_path / "vllm-2")
    with VllmServer(config) as server:
        yield server


@contextlib.contextmanager
def _ranked_service(base_dir, urls: list[str], run_dir: Path):
    """The service under torchrun on 2 ranks, its url; SIGTERM'd after, which must end it in 30 s."""
    run_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "-m", "graft.cli", "tenants", "serve", "--model", str(base_dir), "--port", str(port),
               *[arg for url in urls for arg in ("--engine-url", url)], "--max-loras", "4", "--max-rank", "8",
               "--run-dir", str(run_dir)]
    env = {**os.environ, "TINKER_API_KEY": API_KEY, "OMP_NUM_THREADS": "1"}
    log = run_dir / "service.log"
    with open(log, "w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_up(url, process, log)
        yield url, log
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            pytest.fail(f"the ranked service did not end within 30 s of SIGTERM: {log.read_text()[-3000:]}")


def _wait_until_up(url: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the ranked service exited: {log.read_text()[-3000:]}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/api/v1/healthz", headers={"X-API-Key": API_KEY}, timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"the ranked service did not answer in 180 s: {log.read_text()[-3000:]}")


def _client(url: str, base: str, client: int, sampled: threading.Barrier, kill, out: dict) -> None:
    """One SDK client: each step a forward_backward and optim_step on its fixed datums, then a version
    published and sampled from; the second server is killed once both sampled at `KILLED_AFTER`."""
    with tinker.ServiceClient(base_url=url, api_key=API_KEY) as service:
        training = service.create_lora_training_client(base_model=base, rank=4, seed=client + 1).result()
        datums = [_sdk_datum(tokens) for tokens in _sequences(client, 0)]
        for step in range(STEPS):
            backward = training.forward_backward(datums, "cross_entropy")
            training.optim_step(types.AdamParams(learning_rate=LEARNING_RATE)).result()
            out.setdefault(client, []).append(backward.result().metrics["loss:sum"])
            sampler = training.save_weights_and_get_sampling_client().result()
            samples = sampler.sample(types.ModelInput.from_ints(PROMPT), num_samples=2,
                                     sampling_params=types.SamplingParams(max_tokens=4, temperature=1.0)).result()
            out.setdefault(f"samples{client}", []).append([list(s.tokens) for s in samples.sequences])
            if step == KILLED_AFTER:
                if sampled.wait(timeout=300) == 0:
                    kill()
                sampled.wait(timeout=300)  # both go on once the server is gone
        out[f"model{client}"] = training.model_id
        training.save_state("final").result()


def _solo(base_dir, client: int) -> dict:
    """The same tenant trained on one process, alone."""
    policy = TenantPolicy(load_model(base_dir))
    policy.add(TenantSpec("solo", rank=4, alpha=4.0, target_modules=ATTENTION + MLP, seed=client + 1))
    for _ in range(STEPS):
        policy.forward_backward([Datum("solo", t, {"weights": _weights(t)}) for t in _sequences(client, 0)],
                                "cross_entropy")
        assert policy.optim_step("solo", AdamParams(learning_rate=LEARNING_RATE)).applied
    return {name.replace(".solo.", "."): p.detach().clone() for name, p in policy.parameters("solo").items()}


def test_two_clients_train_on_two_ranks_and_sample_on_while_a_server_dies(base_dir, vllm_server, second_server,
                                                                         tmp_path):
    run_dir = tmp_path / "service"
    out: dict = {}
    sampled = threading.Barrier(2)
    with _ranked_service(base_dir, [vllm_server.url, second_server.url], run_dir) as (url, log):
        threads = [threading.Thread(target=_client, args=(url, str(base_dir), c, sampled,
                                                          lambda: os.killpg(second_server.pid, signal.SIGKILL), out))
                   for c in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=600)
        text = log.read_text()
    for client in (0, 1):
        losses = out.get(client, [])
        assert len(losses) == STEPS and losses[-1] < losses[0], (out, text[-3000:])
        assert len(out[f"samples{client}"]) == STEPS and all(len(s) == 2 for s in out[f"samples{client}"])
        state = run_dir / "states" / SINGLE_USER / out[f"model{client}"].replace(":", "_") / "final"
        saved = safetensors.torch.load_file(state / "adapter_model.safetensors")
        solo = _solo(base_dir, client)
        assert_adam_weights_close(saved, solo, LEARNING_RATE)
    assert f"{second_server.url}" in text and "dropped from the pool" in text, text[-3000:]
