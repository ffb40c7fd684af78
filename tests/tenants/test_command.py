"""`graft tenants serve`: bad input gets one clear error and exit 2 before any server starts; the
command serves its keys file's users and stops within seconds of SIGTERM."""

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from graft.cli import main
from graft.rollout.launcher import free_port


@pytest.mark.parametrize(("key", "extra", "message"), [
    ("secret-key", [], "must start with 'tml-'"),
    ("tml-fine-key", ["--model", "no/such-model-here"], "neither a local directory, a packaged model"),
])
def test_bad_input_exits_2_naming_the_problem(monkeypatch, capsys, base_dir, key, extra, message):
    monkeypatch.setenv("TINKER_API_KEY", key)
    args = ["tenants", "serve", "--model", str(base_dir), *extra]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("graft: error: ") and message in err and err.count("\n") == 1


def test_a_keep_versions_of_0_is_refused_when_the_flags_are_parsed(monkeypatch, capsys, base_dir):
    monkeypatch.setenv("TINKER_API_KEY", "tml-fine-key")
    with pytest.raises(SystemExit) as exit_info:
        main(["tenants", "serve", "--model", str(base_dir), "--keep-versions", "0"])
    assert exit_info.value.code == 2
    assert "argument --keep-versions: must be at least 1 (got 0)" in capsys.readouterr().err


@pytest.mark.vllm
def test_serve_with_a_keys_file_answers_its_users_and_stops_within_seconds_of_sigterm(base_dir, vllm_server,
                                                                                     tmp_path):
    """The command itself: users from --keys, a warning for a non-loopback bind, and a SIGTERM while a
    client's retrieve_future long poll is open ends the service within a few seconds (uvicorn's
    graceful stop waited for the poll: 24 s)."""
    keys = tmp_path / "keys"
    keys.write_text("ann tml-ann-command-0001\nbob tml-bob-command-0002\n")
    port = free_port()
    service = subprocess.Popen([sys.executable, "-m", "graft.cli", "tenants", "serve", "--model", str(base_dir),
                                "--keys", str(keys), "--engine-url", vllm_server.url, "--host", "0.0.0.0",
                                "--port", str(port), "--run-dir", str(tmp_path / "run")],
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "TINKER_API_KEY": ""})
    url = f"http://127.0.0.1:{port}/api/v1"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/healthz", headers={"X-API-Key": "tml-bob-command-0002"}).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
        assert httpx.get(url + "/healthz", headers={"X-API-Key": "tml-nobody-00000"}).status_code == 401
        ann = {"X-API-Key": "tml-ann-command-0001"}
        session = httpx.post(url + "/create_session", json={}, headers=ann).json()["session_id"]
        created = httpx.post(url + "/create_model", json={"session_id": session, "base_model": str(base_dir),
                                                          "lora_config": {"rank": 2}}, headers=ann).json()
        model = httpx.post(url + "/retrieve_future", json=created, headers=ann, timeout=60).json()["model_id"]
        later = httpx.post(url + "/optim_step", json={"model_id": model, "seq_id": 9}, headers=ann).json()
        poll = threading.Thread(target=lambda: _quietly(httpx.post, url + "/retrieve_future", json=later,
                                                        headers=ann, timeout=60))
        poll.start()
        time.sleep(1.0)
        start = time.monotonic()
        service.send_signal(signal.SIGTERM)
        service.wait(timeout=30)
        assert time.monotonic() - start < 10, "the service did not stop within 10 s of SIGTERM"
        assert "graft: warning: the Tinker API on 0.0.0.0 is reachable from the network" in service.stderr.read()
    finally:
        service.kill()
        service.wait()


def _quietly(call, *args, **kwargs) -> None:
    try:
        call(*args, **kwargs)
    except Exception:  # noqa: BLE001 - the service goes away under it: that is the test
        pass
