"""SglangServer: its command line, environment and refusals (no server), then `graft serve --engine
sglang` for real (marked `sglang`): it serves, and a SIGKILLed graft takes the server down with it
(the owner watchdog in graft/rollout/sglang/server/sitecustomize.py)."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from graft.rollout.launcher import free_port
from graft.rollout.process_group import OWNER_ENV
from graft.rollout.sglang.launcher import (
    CPU_FIXES_DIR,
    SglangServer,
    SglangServerConfig,
    sglang_missing,
    sglang_python,
)
from tests.helpers import KERNEL_STUB_MARKER, kernel_stub_calls, live_group_members


def test_command_uses_sglangs_venv_and_the_torch_native_cpu_backends(tmp_path):
    server = SglangServer(SglangServerConfig(model="/m", dtype="float32", port=4321, venv=tmp_path, max_loras=3))
    args = server.command()
    assert args[:3] == [str(tmp_path / "bin" / "python"), "-m", "sglang.launch_server"]
    flags = dict(zip(args[3::1], args[4::1]))
    assert flags["--model-path"] == "/m" and flags["--host"] == "127.0.0.1" and flags["--port"] == "4321"
    assert flags["--device"] == "cpu" and flags["--attention-backend"] == "torch_native"
    assert flags["--lora-backend"] == "torch_native" and flags["--max-loras-per-batch"] == "3"
    assert flags["--context-length"] == "512" and "--enable-lora" in args and "--sleep-on-idle" in args
    assert args[args.index("--lora-target-modules") + 1:][:7] == ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                 "gate_proj", "up_proj", "down_proj"]


def test_environment_puts_the_cpu_fixes_first_and_asks_for_raw_logprobs(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = SglangServer(SglangServerConfig(model="/m")).environment()
    assert env["PYTHONPATH"].split(os.pathsep) == [str(CPU_FIXES_DIR), "/elsewhere"]
    assert (CPU_FIXES_DIR / "sitecustomize.py").is_file() and (CPU_FIXES_DIR / "sgl_kernel" / "__init__.py").is_file()
    assert env["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1" and env["GRAFT_SGLANG_CPU_FIXES"] == "1"
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env[OWNER_ENV] == str(os.getpid())


def test_a_server_whose_owner_died_before_start_up_stops_its_group_at_once():
    """graft SIGKILLed before the server's Python even ran its sitecustomize: the group leader sees an
    owner that is not its parent and stops the group before torch is imported."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    env = {**os.environ, "PYTHONPATH": str(CPU_FIXES_DIR), "GRAFT_SGLANG_CPU_FIXES": "1", OWNER_ENV: str(gone.pid)}
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env, start_new_session=True)
    try:
        assert server.wait(timeout=30) == -signal.SIGTERM
    finally:
        server.kill()
        server.wait()


@pytest.mark.parametrize("kwargs, message", [
    ({"host": "0.0.0.0"}, "loopback only"),
    ({"dtype": "float16"}, "is not one of"),
    ({"max_lora_rank": 0}, "must be >= 1"),
])
def test_config_refuses_a_network_host_and_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SglangServerConfig(model="/m", **kwargs)


def test_a_missing_venv_is_one_clear_error_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAFT_SGLANG_VENV", str(tmp_path / "none"))
    assert sglang_python() == tmp_path / "none" / "bin" / "python"
    with pytest.raises(FileNotFoundError, match="make sglang-venv"):
        SglangServer(SglangServerConfig(model="/m")).start()


def test_kernel_stub_calls_are_read_from_the_log(tmp_path):
    server = SglangServer(SglangServerConfig(model="/m"))
    server.log_path = tmp_path / "sglang-1.log"
    assert kernel_stub_calls(server) == []
    server.log_path.write_text(f"ok\n{KERNEL_STUB_MARKER} rmsnorm_cpu\nmore\n")
    assert kernel_stub_calls(server) == ["rmsnorm_cpu"]


def test_the_kernel_stand_in_fails_loudly_and_has_no_submodules(tmp_path):
    code = ("import sgl_kernel, importlib\n"
            "try:\n    sgl_kernel.rmsnorm_cpu(1)\nexcept NotImplementedError as e:\n    print('raised', e)\n"
            "try:\n    importlib.import_module('sgl_kernel.scalar_type')\n"
            "except ImportError:\n    print('no submodule')\n")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(CPU_FIXES_DIR)},
                         capture_output=True, text=True, check=True)
    assert "raised sgl_kernel.rmsnorm_cpu" in out.stdout and "no submodule" in out.stdout
    assert f"{KERNEL_STUB_MARKER} rmsnorm_cpu" in out.stderr


def _model_path(url: str) -> str | None:
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url + "/get_model_info",
                                                                               timeout=30) as r:
            return json.loads(r.read())["model_path"]
    except OSError:
        return None


@pytest.mark.sglang
def test_graft_serve_sglang_serves_and_dies_with_a_killed_graft(base_dir, tmp_path):
    if (missing := sglang_missing()) is not None:
        pytest.skip(missing)
    port = free_port()
    url, said = f"http://127.0.0.1:{port}", tmp_path / "stderr.txt"
    with open(said, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "graft.cli", "serve", str(base_dir), "--engine", "sglang",
                                 "--dtype", "float32", "--port", str(port), "--max-lora-rank", "8",
                                 "--log-dir", str(tmp_path / "logs")], stderr=stderr, text=True,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while "Ctrl-C stops it" not in said.read_text():
            assert proc.poll() is None, said.read_text()
            assert time.monotonic() < deadline, "graft serve --engine sglang did not come up in 400 s"
            time.sleep(1)
        assert f"SGLang serving {base_dir} in dtype float32 at {url}" in said.read_text()
        assert _model_path(url) == str(base_dir)
        pgrep = subprocess.run(["pgrep", "-f", "--", f"--port {port}"], capture_output=True, text=True)
        server_pids = pgrep.stdout.split()
        groups = {os.getpgid(int(pid)) for pid in server_pids} - {os.getpgid(proc.pid)}
        assert len(groups) == 1  # SGLang in its own group, apart from graft's
        proc.send_signal(signal.SIGKILL)  # no stop() runs: only the watchdog can end the server
        proc.wait(timeout=10)
        (group,) = groups
        deadline = time.monotonic() + 60
        while live_group_members(group):
            assert time.monotonic() < deadline, live_group_members(group)
            time.sleep(0.5)
        assert _model_path(url) is None
    finally:
        if proc.poll() is None:
            proc.kill()


def test_graft_train_on_sglang_without_its_venv_is_one_line_and_rc_2(base_dir, tmp_path, monkeypatch, capsys):
    from graft.cli import main

    monkeypatch.setenv("GRAFT_SGLANG_VENV", str(tmp_path / "none"))
    code = main(["train", "-o", f"model.path={base_dir}", "-o", "rollout.engine=sglang", "-o", "train.steps=1",
                 "--run-dir", str(tmp_path / "run")])
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("graft:")]
    assert code == 2 and err == [f"graft: error: no SGLang virtualenv at {tmp_path / 'none'}: build it with "
                                 "`make sglang-venv` (or set GRAFT_SGLANG_VENV)"]
