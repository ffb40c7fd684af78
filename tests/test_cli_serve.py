"""`graft serve`: what it says before and after starting (network exposure, dtype, weight reload),
and a real vLLM server that leaves no process behind when it is stopped."""

import argparse
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from graft.cli import main
from graft.commands.serve import _serving_lines
from graft.rollout.launcher import ServerStartupError, free_port
from graft.rollout.vllm.launcher import VllmServer
from tests.helpers import live_group_members

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _models(url: str) -> list[dict] | None:
    try:
        with _NO_PROXY.open(url + "/v1/models", timeout=2) as response:
            return json.loads(response.read())["data"]
    except OSError:
        return None


def _post_status(url: str) -> int:
    request = urllib.request.Request(url, data=b"{}", method="POST", headers={"Content-Type": "application/json"})
    try:
        with _NO_PROXY.open(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


@pytest.fixture
def no_start(monkeypatch):
    """`graft serve` runs up to the server start, which fails at once (no vLLM is launched)."""
    def refuse(self):
        raise ServerStartupError("stand-in: not started")
    monkeypatch.setattr(VllmServer, "start", refuse)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)


def test_serve_on_a_network_interface_warns_in_one_line_and_recommends_an_api_key(base_dir, tmp_path, capsys,
                                                                                   no_start):
    assert main(["serve", str(base_dir), "--host", "0.0.0.0", "--log-dir", str(tmp_path)]) == 2
    warning, error = capsys.readouterr().err.strip().splitlines()
    assert warning == ("graft: warning: vLLM on 0.0.0.0 is reachable from the network with completions, runtime "
                       "adapter loading (from any path on this machine); no API key is set: pass --api-key-env NAME "
                       "or set VLLM_API_KEY")
    assert error == "graft: error: stand-in: not started"
    assert main(["serve", str(base_dir), "--log-dir", str(tmp_path)]) == 2  # loopback: no warning
    assert "warning" not in capsys.readouterr().err


def test_serve_warning_names_the_dev_endpoints_and_the_key_source(base_dir, tmp_path, capsys, no_start, monkeypatch):
    monkeypatch.setenv("SERVE_KEY", "k")
    assert main(["serve", str(base_dir), "--host", "0.0.0.0", "--weight-reload", "--api-key-env", "SERVE_KEY",
                 "--log-dir", str(tmp_path)]) == 2
    warning = capsys.readouterr().err.splitlines()[0]
    assert "(/collective_rpc, /pause, ...; never authenticated, not even with an API key)" in warning
    assert warning.endswith("/v1 requests need the API key from $SERVE_KEY")


def test_serve_with_an_unset_api_key_variable_is_one_line_before_any_start(base_dir, tmp_path, capsys, no_start):
    assert main(["serve", str(base_dir), "--api-key-env", "GRAFT_TEST_UNSET_KEY", "--log-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "graft: error: the API key variable GRAFT_TEST_UNSET_KEY is not set or empty in the environment"]


def test_serve_says_a_bf16_server_fails_a_float32_run_and_how_to_fix_it(tmp_path):
    class Served:
        url, startup_seconds, log_path = "http://127.0.0.1:8000", 42.0, tmp_path / "vllm-8000.log"
        ENGINE_NAME = "vLLM"

        def served_dtype(self):
            return "bfloat16"

    args = argparse.Namespace(model="m", dtype="auto", weight_reload=False, engine="vllm")
    banner, dtype_hint, reload_line = _serving_lines(args, Served()).splitlines()
    assert banner.startswith("vLLM serving m in dtype bfloat16 at http://127.0.0.1:8000")
    assert dtype_hint == ("graft serve: a run with model.dtype float32 (the default) needs `graft serve --dtype "
                          "float32`: on dtype bfloat16 its first delivery check fails")
    assert reload_line == "graft serve: weight reload (sync.mode merged) is off: sync.mode adapter only " \
                          "(--weight-reload turns it on)"


def test_serve_sglang_names_sglang_and_its_always_on_weight_reload(tmp_path):
    class Served:
        url, startup_seconds, log_path = "http://127.0.0.1:8000", 90.0, tmp_path / "sglang-8000.log"
        ENGINE_NAME = "SGLang"

        def served_dtype(self):
            return "float32"

    args = argparse.Namespace(model="m", dtype="float32", weight_reload=False, engine="sglang")
    banner, reload_line = _serving_lines(args, Served()).splitlines()
    assert banner.startswith("SGLang serving m in dtype float32 at http://127.0.0.1:8000 (ready in 90 s")
    assert reload_line == ("graft serve: weight reload (sync.mode merged) is on: SGLang always serves "
                           "/update_weights_from_disk (loopback only)")


@pytest.mark.parametrize("extra, message", [
    (["--host", "0.0.0.0"], "graft launches SGLang on loopback only"),
    (["--api-key-env", "SERVE_KEY"], "--api-key-env is for vLLM"),
])
def test_serve_sglang_refuses_a_network_host_or_a_key_before_any_start(base_dir, tmp_path, capsys, no_start,
                                                                       monkeypatch, extra, message):
    monkeypatch.setenv("SERVE_KEY", "k")
    assert main(["serve", str(base_dir), "--engine", "sglang", *extra, "--log-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("graft: error: ") and message in err[0]


@pytest.mark.vllm
def test_graft_serve_serves_and_sigterm_stops_every_process(base_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    said = tmp_path / "stderr.txt"  # a file: the test reads it while graft serve runs
    # Own session, so the test can list the group graft and vLLM run in.
    with open(said, "w") as stderr:
        # The default --dtype auto: vLLM serves the fp32 checkpoint in bf16, which a default run cannot use.
        proc = subprocess.Popen([sys.executable, "-m", "graft.cli", "serve", str(base_dir), "--port", str(port),
                                 "--max-lora-rank", "8", "--log-dir", str(tmp_path / "logs")],
                                stderr=stderr, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while "Ctrl-C stops it" not in said.read_text():  # graft serve saw /health answer and said so
            assert proc.poll() is None, said.read_text()
            assert time.monotonic() < deadline, "graft serve did not come up in 300 s"
            time.sleep(1)
        models = _models(url)
        assert models[0]["id"] == str(base_dir) and models[0]["parent"] is None
        assert f"vLLM serving {base_dir} in dtype bfloat16 at {url}" in said.read_text()  # read from vLLM's log
        assert "a run with model.dtype float32 (the default) needs `graft serve --dtype float32`" in said.read_text()
        assert (tmp_path / "logs" / f"vllm-{port}.log").is_file()
        assert _post_status(url + "/collective_rpc") == 404  # no --weight-reload: no dev endpoints
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
        assert _models(url) is None
    finally:
        if proc.poll() is None:
            proc.kill()
    # vLLM runs in its own process group, led by the server process; none of its processes may be left.
    leftovers = subprocess.run(["pgrep", "-f", f"--port {port}"], capture_output=True, text=True).stdout.split()
    assert leftovers == [], [live_group_members(int(pid)) for pid in leftovers]
