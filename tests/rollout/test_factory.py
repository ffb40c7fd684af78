"""graft.rollout.factory: which engine a config opens, the server graft launches for it, and what a
run is told when that server dies. Tests marked `vllm` that launch their own server come first, so
they run before the session's shared server starts (one vLLM at a time on 2 cores)."""

import asyncio
import http.server
import json
import os
import shutil
import signal
import subprocess
import threading
import urllib.error
import urllib.request

import pytest
import torch
from huggingface_hub import constants

from graft.config import ConfigError, load_config
from graft.config.rollout import AUTO_ALL_CORES_PARAMETERS
from graft.lora.adapter_io import save_adapter
from graft.models.loading import checkpoint_parameters, load_model
from graft.rollout import factory
from graft.rollout.engine import BadRequestError, EngineUnavailableError, GenerateRequest, SamplingParams
from graft.rollout.factory import launch_config, open_engine, require_weight_reload
from graft.rollout.launcher import free_port
from graft.rollout.pool import EnginePool
from graft.rollout.reference import ReferenceEngine
from graft.rollout.vllm.client import VllmClient
from graft.rollout.vllm.launcher import VllmServer
from tests.helpers import hf_cache_with, trained_like_peft_model

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
GREEDY_4 = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)


def _status(method: str, url: str) -> int:
    request = urllib.request.Request(url, data=b"{}" if method == "POST" else None, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with _NO_PROXY.open(request, timeout=60) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def _server_pgid(port: int) -> int:
    """The process group of the vLLM server this process launched on `port` (it leads its own group)."""
    listing = subprocess.run(["pgrep", "-f", f"graft.rollout.vllm.server.entry .*--port {port} "], capture_output=True,
                             text=True).stdout.split()
    (pgid,) = {os.getpgid(int(pid)) for pid in listing}  # a forked engine core shares the command line
    return pgid


@pytest.mark.vllm
def test_launched_adapter_server_has_no_dev_endpoints_follows_max_model_len_and_its_death_is_named(
        base_dir, tmp_path, capsys):
    config = load_config(None, [f"model.path={base_dir}", "rollout.max_lora_rank=8", "lora.rank=8",
                                "rollout.max_model_len=1024"])
    adapter = save_adapter(trained_like_peft_model(base_dir, rank=8), tmp_path / "adapter")

    async def scenario():
        async with open_engine(config, tmp_path / "run") as engine:
            url = engine.address
            said = f"graft: starting a vllm server for {base_dir} (its log in {tmp_path / 'run' / 'logs'})"
            assert said in capsys.readouterr().err  # a minute, said not silent
            # Adapter sync: the dev endpoints are not served, and merged sync would be refused up front.
            assert _status("POST", url + "/collective_rpc") == 404 and _status("POST", url + "/pause") == 404
            with pytest.raises(BadRequestError, match="graft serve --weight-reload"):
                await require_weight_reload([url])
            with _NO_PROXY.open(url + "/v1/models", timeout=60) as response:
                assert json.loads(response.read())["data"][0]["max_model_len"] == 1024
            await engine.load_adapter("graft-v1", str(adapter))
            (completion,), = await engine.generate([GenerateRequest((1, 2, 3), GREEDY_4)], adapter="graft-v1")
            assert len(completion.token_ids) == 4
            os.killpg(_server_pgid(int(url.rsplit(":", 1)[1])), signal.SIGKILL)
            await engine.generate([GenerateRequest((1, 2, 3), GREEDY_4)])

    with pytest.raises(EngineUnavailableError) as info:
        asyncio.run(scenario())
    first_line = str(info.value).splitlines()[0]
    assert "the vLLM server graft launched" in first_line and "was killed by SIGKILL" in first_line
    assert "graft train ... --resume" in first_line and str(tmp_path / "run" / "logs" / "vllm-") in first_line
    assert isinstance(info.value.__cause__, EngineUnavailableError)  # the client's own error, chained


def test_launch_config_follows_the_sync_mode_and_the_context_length(base_dir, tmp_path):
    adapter = launch_config(load_config(None, [f"model.path={base_dir}"]), tmp_path)
    assert not adapter.dev_endpoints and adapter.max_model_len == 2048 and adapter.dtype == "float32"
    assert adapter.log_dir == tmp_path / "logs" and adapter.model == str(base_dir)
    merged = launch_config(load_config(None, [f"model.path={base_dir}", "sync.mode=merged", "model.dtype=bfloat16",
                                              "rollout.max_model_len=null"]), tmp_path)
    assert merged.dev_endpoints and merged.max_model_len is None and merged.dtype == "bfloat16"
    assert adapter.enable_lora and not merged.enable_lora  # merged weights: no adapter to serve
    evaluating = launch_config(load_config(None, [f"model.path={base_dir}", "sync.mode=merged"]), tmp_path, syncs=False)
    assert not evaluating.dev_endpoints and evaluating.enable_lora  # eval reloads no weights, whatever sync.mode says
    assert adapter.tensor_parallel_size == 1
    split = launch_config(load_config(None, [f"model.path={base_dir}", "rollout.tensor_parallel_size=2"]), tmp_path)
    assert split.tensor_parallel_size == 2


def test_a_launched_vllm_on_the_trainers_gpu_takes_a_share_of_what_is_free(base_dir, tmp_path, monkeypatch):
    """vLLM refuses to start when less than --gpu-memory-utilization of the GPU is free, and its
    default (0.92) never is beside the trainer's model: 'auto' asks for 90% of what is free."""
    import torch

    assert launch_config(load_config(None, [f"model.path={base_dir}"]), tmp_path).gpu_memory_utilization is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (60 * 2**30, 80 * 2**30))  # the trainer holds 20 GiB
    assert launch_config(load_config(None, [f"model.path={base_dir}"]), tmp_path).gpu_memory_utilization == 0.68
    fixed = load_config(None, [f"model.path={base_dir}", "rollout.gpu_memory_utilization=0.3"])
    assert launch_config(fixed, tmp_path).gpu_memory_utilization == 0.3


def test_launch_config_gives_generation_every_core_on_policy_from_10m_parameters(base_dir, tmp_path, monkeypatch):
    def reserved(*overrides, parameters):
        monkeypatch.setattr(factory, "checkpoint_parameters", lambda model_dir: parameters)
        config = launch_config(load_config(None, [f"model.path={base_dir}", *overrides]), tmp_path)
        return config.cpu_reserved_cores, VllmServer(config).environment().get("VLLM_CPU_NUM_OF_RESERVED_CPU")

    assert reserved(parameters=AUTO_ALL_CORES_PARAMETERS) == (0, "0")
    assert reserved(parameters=AUTO_ALL_CORES_PARAMETERS - 1) == (None, os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU"))
    assert reserved("rollout.max_staleness=1", parameters=10**9)[0] is None  # the trainer runs beside it
    assert reserved("rollout.cpu_reserved_cores=1", parameters=10**9) == (1, "1")
    with pytest.raises(ConfigError, match="cpu_reserved_cores"):
        load_config(None, ["rollout.cpu_reserved_cores=-1"])


def test_checkpoint_parameters_counts_the_safetensors_headers(base_dir):
    model = load_model(base_dir)
    assert checkpoint_parameters(base_dir) == sum(p.numel() for p in model.state_dict().values())


def test_launch_config_gives_vllm_a_cached_hub_id_as_its_local_snapshot(base_dir, tmp_path, monkeypatch):
    snapshot = hf_cache_with(tmp_path / "hub", "graft-test/tiny", base_dir)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert launch_config(load_config(None, ["model.path=graft-test/tiny"]), tmp_path).model == snapshot


def test_a_model_directory_without_config_json_fails_before_any_server_starts(base_dir, tmp_path):
    shutil.copytree(base_dir, tmp_path / "model")
    (tmp_path / "model" / "config.json").unlink()

    async def scenario():
        async with open_engine(load_config(None, [f"model.path={tmp_path / 'model'}"]), tmp_path / "run"):
            raise AssertionError("no engine may open on a directory without config.json")

    with pytest.raises(ValueError, match=f"model directory {tmp_path / 'model'} has no config.json"):
        asyncio.run(scenario())
    assert not (tmp_path / "run").exists()


class _IsPaused(http.server.BaseHTTPRequestHandler):
    """A stand-in vLLM that answers GET /is_paused with the status in its server's `status`."""

    def do_GET(self):
        self.send_response(self.server.status if self.path == "/is_paused" else 500)
        self.end_headers()
        self.wfile.write(b'{"is_paused": false}' if self.server.status == 200 else b'{"detail":"Not Found"}')

    def log_message(self, *args):
        pass


@pytest.fixture
def is_paused_server():
    """Starts stand-ins answering /is_paused with a given status; yields a `start(status) -> url`."""
    servers = []

    def start(status: int) -> str:
        server = http.server.HTTPServer(("127.0.0.1", 0), _IsPaused)
        server.status = status
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_port}"

    yield start
    for server in servers:
        server.shutdown()


def test_merged_sync_against_a_server_without_weight_reload_fails_before_the_run(base_dir, tmp_path,
                                                                                  is_paused_server):
    dead = f"http://127.0.0.1:{free_port()}"

    async def scenario(urls, syncs=True):
        overrides = [f"model.path={base_dir}", "sync.mode=merged", f"rollout.urls=[{','.join(urls)}]"]
        async with open_engine(load_config(None, overrides), tmp_path, syncs=syncs) as engine:
            return engine

    served, bare = is_paused_server(200), is_paused_server(404)
    assert isinstance(asyncio.run(scenario([served, dead])), EnginePool)  # the dead one is the pool's business
    with pytest.raises(BadRequestError) as info:
        asyncio.run(scenario([served, bare]))
    assert str(info.value).startswith(f"{bare}: sync.mode 'merged' reloads weights through vLLM's dev endpoints")
    assert "`graft serve --weight-reload`" in str(info.value)
    assert isinstance(asyncio.run(scenario([bare], syncs=False)), VllmClient)  # eval needs no weight reload


def test_a_missing_model_path_is_named_before_anything_starts(tmp_path):
    async def scenario(config):
        async with open_engine(config, tmp_path):
            raise AssertionError("no engine may open without model.path")

    for overrides, message in ([[], "model.path is required to launch vLLM"],
                               [["rollout.engine=reference"], "model.path is required to load the model"]):
        with pytest.raises(ConfigError, match=message):
            asyncio.run(scenario(load_config(None, overrides)))
    assert not (tmp_path / "logs").exists()


def test_reference_engine_from_config(base_dir, tmp_path):
    config = load_config(None, [f"model.path={base_dir}", "rollout.engine=reference"])

    async def scenario():
        async with open_engine(config, tmp_path) as engine:
            assert isinstance(engine, ReferenceEngine)
            out = await engine.generate([GenerateRequest((1, 2, 3), SamplingParams(temperature=0, max_new_tokens=4,
                                                                                   ignore_eos=True))])
            assert len(out[0][0].token_ids) == 4

    asyncio.run(scenario())


@pytest.mark.parametrize("device", ["auto", "cpu"])
def test_the_reference_engine_runs_where_rollout_reference_device_says(base_dir, tmp_path, device):
    config = load_config(None, [f"model.path={base_dir}", "rollout.engine=reference",
                                f"rollout.reference_device={device}"])
    expected = "cuda" if device == "auto" and torch.cuda.is_available() else "cpu"

    async def scenario():
        async with open_engine(config, tmp_path) as engine:
            assert engine.device.type == expected

    asyncio.run(scenario())


@pytest.mark.vllm
def test_user_urls_give_a_client_or_a_pool(vllm_server, base_dir, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"

    async def scenario():
        one = load_config(None, [f"model.path={base_dir}", f"rollout.urls=[{vllm_server.url}]"])
        async with open_engine(one, tmp_path) as engine:
            assert isinstance(engine, VllmClient) and (await engine.health()).healthy
        two = load_config(None, [f"model.path={base_dir}", f"rollout.urls=[{vllm_server.url},{dead}]"])
        async with open_engine(two, tmp_path) as engine:
            assert isinstance(engine, EnginePool)
            assert {h.address: h.healthy for h in await engine.health_all()} == {vllm_server.url: True, dead: False}

    asyncio.run(scenario())


def test_a_user_server_that_is_gone_is_named_so_with_how_to_resume(base_dir, tmp_path):
    """A server at rollout.urls that stops answering mid-run (here: nothing listens at its port any
    more, every connection refused) is reported as gone, with how the run continues."""
    url = f"http://127.0.0.1:{free_port()}"
    config = load_config(None, [f"model.path={base_dir}", f"rollout.urls=[{url}]", "rollout.control_timeout_s=2"])

    async def generate_once():
        async with open_engine(config, tmp_path, syncs=False) as engine:
            await engine.generate([GenerateRequest((5, 6), SamplingParams(max_new_tokens=1))])

    with pytest.raises(EngineUnavailableError) as info:
        asyncio.run(generate_once())
    message = str(info.value)
    assert message.startswith(f"{url}: the server is gone: nothing answers any more (GET /v1/models: ")
    assert message.count(url) == 1 and "cannot connect after" in message
    assert message.endswith("a training run continues from its newest checkpoint with `graft train ... --resume` "
                            "(same config and --run-dir)")
