"""A Tinker service restarted on the same state root (graft.tenants.service): every saved state is
served to its owner and to no one else, no session, model or request id of the first run is handed
out again (a new client must never get a crashed service's model id, whose states it could then
overwrite), and what saves cut short by a crash left is cleaned up. And the `tinker` CLI's listing
against it."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import tinker
from tinker import types

from graft.tenants.background import ServiceThread
from graft.tenants.command import tenant_service
from graft.tenants.users import Users

ANN, BOB = "tml-ann-restart-000001", "tml-bob-restart-000002"
USERS = Users({"ann": ANN, "bob": BOB})


def _datum(seed: int) -> types.Datum:
    rng = random.Random(seed)
    tokens = [rng.randrange(3, 200) for _ in range(10)]
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 9})


def _service(base_dir, run_dir):
    return ServiceThread(lambda: tenant_service(base_dir, None, run_dir=run_dir, max_loras=4, max_rank=8), USERS)


def test_a_restarted_service_serves_each_state_to_its_owner_and_reuses_no_id(base_dir, tmp_path):
    with _service(base_dir, tmp_path) as first, tinker.ServiceClient(base_url=first.url, api_key=ANN) as ann:
        training = ann.create_lora_training_client(base_model=str(base_dir), rank=4, seed=1).result()
        training.forward_backward([_datum(1)], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        path = training.save_state("kept").result().path
        expected = training.forward([_datum(2)], "cross_entropy").result().metrics["loss:sum"]
        first_ids = {training.model_id, *first.service.sessions}
        leftover = first.service.state_dir("ann", path).with_name(".kept.tmp-deadbeef")  # a save killed mid-way
    leftover.mkdir()
    (leftover / "adapter_model.safetensors").write_bytes(b"half")
    with _service(base_dir, tmp_path) as second:
        assert not leftover.exists(), "the half-written save's temporary was left behind"
        with tinker.ServiceClient(base_url=second.url, api_key=ANN) as ann:
            again = ann.create_lora_training_client(base_model=str(base_dir), rank=4, seed=1).result()
            assert again.model_id not in first_ids and not set(second.service.sessions) & first_ids
            resumed = ann.create_training_client_from_state(path).result()
            got = resumed.forward([_datum(2)], "cross_entropy").result().metrics["loss:sum"]
            assert got == pytest.approx(expected, rel=1e-6)
        with tinker.ServiceClient(base_url=second.url, api_key=BOB) as bob, pytest.raises(tinker.NotFoundError):
            bob.create_training_client_from_state(path).result()


def _cli(url: str, key: str, *args: str) -> dict:
    """The `tinker` CLI (installed with the SDK) against the service, its JSON answer."""
    env = {**os.environ, "TINKER_BASE_URL": url, "TINKER_API_KEY": key}
    done = subprocess.run([str(Path(sys.executable).parent / "tinker"), "-f", "json", *args], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_the_tinker_cli_lists_and_deletes_a_users_own_checkpoints(base_dir, tmp_path):
    with _service(base_dir, tmp_path) as running, tinker.ServiceClient(base_url=running.url, api_key=ANN) as ann:
        training = ann.create_lora_training_client(base_model=str(base_dir), rank=2).result()
        training.forward_backward([_datum(3)], "cross_entropy").result()
        path = training.save_state("cli").result().path
        runs = _cli(running.url, ANN, "run", "list")
        assert [run["training_run_id"] for run in runs["runs"]] == [training.model_id]
        assert [c["tinker_path"] for c in _cli(running.url, ANN, "checkpoint", "list")["checkpoints"]] == [path]
        assert _cli(running.url, BOB, "checkpoint", "list")["checkpoints"] == []
        assert _cli(running.url, ANN, "checkpoint", "delete", "-y", path)["deleted_count"] == 1
        assert _cli(running.url, ANN, "checkpoint", "list")["checkpoints"] == []


def test_the_service_takes_the_gil_back_quickly_while_it_runs_and_restores_the_interval(base_dir, tmp_path):
    """The model thread's many small ops each wait out the GIL switch interval behind the event loop's
    thread (graft.tenants.command.GIL_SWITCH_S): shorter while the service runs, as it was after."""
    from graft.tenants.command import GIL_SWITCH_S

    before = sys.getswitchinterval()
    with _service(base_dir, tmp_path):
        assert sys.getswitchinterval() == GIL_SWITCH_S < before
    assert sys.getswitchinterval() == before
