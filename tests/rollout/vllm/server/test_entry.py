"""graft starts vLLM through `graft.rollout.vllm.server.entry`: after a request the engine's processes go
quiet within ~50 ms instead of spinning a core for 1 s, and no request waits for vLLM's 5 s
missed-wake-up recheck."""

import asyncio
import re
import time
from types import SimpleNamespace

import pytest

from graft.rollout.engine import GenerateRequest, SamplingParams
from graft.rollout.process_group import group_cpu_seconds
from graft.rollout.vllm.client import VllmClient


async def _timed_requests(url: str, n: int) -> list[float]:
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=4, seed=0)
    seconds = []
    async with VllmClient(url) as client:
        for _ in range(n):
            start = time.perf_counter()
            await client.generate([GenerateRequest(tuple(range(5, 15)), params)])
            seconds.append(time.perf_counter() - start)
            await asyncio.sleep(0.2)  # past the short spin: the next request wakes a sleeping reader
    return seconds


@pytest.mark.vllm
def test_engine_is_idle_right_after_a_request_and_never_waits_for_the_recheck(vllm_server):
    seconds = asyncio.run(_timed_requests(vllm_server.url, 11))[1:]  # the first may warm up for seconds
    # A missed wake-up waits for vLLM's 5 s recheck; a loaded 2-core machine took 1.14 s once without one.
    assert max(seconds) < 3.0, seconds
    before = group_cpu_seconds(vllm_server.pid)
    time.sleep(1.0)
    # vLLM's default spins a reader for 1 s after the last request: ~1 CPU-second here.
    assert group_cpu_seconds(vllm_server.pid) - before < 0.3


def test_the_late_kill_after_the_owner_died_hits_only_this_launchs_processes():
    """By the time the grace period ends, the server's group id may belong to another group (pid
    reuse): the delayed SIGKILL goes to the processes carrying the launch's token, nothing else."""
    import os
    import signal
    import subprocess
    import sys

    from graft.rollout.process_group import SERVER_ID_ENV
    from graft.rollout.vllm.server.entry import _KILL_CARRIERS_LATER

    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    ours = subprocess.Popen(sleeper, env={**os.environ, SERVER_ID_ENV: "launch-a"})
    theirs = subprocess.Popen(sleeper, env={**os.environ, SERVER_ID_ENV: "launch-b"}, start_new_session=True)
    try:
        subprocess.run([sys.executable, "-c", _KILL_CARRIERS_LATER, "0.2", f"{SERVER_ID_ENV}=launch-a"], check=True,
                       timeout=30)
        assert ours.wait(timeout=10) == -signal.SIGKILL
        assert theirs.poll() is None
    finally:
        for proc in (ours, theirs):
            proc.kill()
            proc.wait()


def test_a_server_whose_owner_died_before_the_watch_began_stops_before_vllm_loads():
    """The launcher was SIGKILLed in the server's first seconds (here: before it started at all): the
    server, leader of its own group, sees an owner that is not its parent and stops its group at
    once, from the top of the entry module, before vLLM's imports."""
    import os
    import signal
    import subprocess
    import sys

    from graft.rollout.process_group import OWNER_ENV, SERVER_ID_ENV

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that no longer runs: the owner that died
    env = {**os.environ, OWNER_ENV: str(gone.pid), SERVER_ID_ENV: "owner-gone-test"}
    started = time.monotonic()
    server = subprocess.Popen([sys.executable, "-m", "graft.rollout.vllm.server.entry", "--model", "/nonexistent"],
                              env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _, stderr = server.communicate(timeout=60)
    finally:
        server.kill()
    assert server.returncode == -signal.SIGTERM, stderr.decode()[-2000:]
    assert time.monotonic() - started < 30
    assert b"vllm" not in stderr.lower()  # stopped before vLLM said anything


def _cuda_platform():
    """What vLLM's CUDA build reports as `current_platform`: vLLM's own Platform with the CUDA enum
    (its CudaPlatform cannot be imported without the CUDA build's compiled ops)."""
    from vllm.platforms.interface import Platform, PlatformEnum

    class CudaPlatform(Platform):
        _enum = PlatformEnum.CUDA
        device_type = "cuda"

    return CudaPlatform()


@pytest.fixture
def vllm_ops_restored(monkeypatch):
    """vLLM's LoRA ops, shared-memory spin and prefix-cache key as they are now, put back after the test."""
    from vllm.distributed.device_communicators import shm_broadcast
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice"):
        monkeypatch.setattr(lora_ops, name, getattr(lora_ops, name))
        monkeypatch.setattr(punica_cpu, name, getattr(punica_cpu, name))
    monkeypatch.setattr(shm_broadcast.SpinCondition.__init__, "__defaults__", (1,))
    monkeypatch.setattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS", shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS)
    monkeypatch.delenv("GRAFT_VLLM_LORA_OPS", raising=False)
    return lora_ops, shm_broadcast


@pytest.fixture(autouse=True)
def vllm_key_restored(monkeypatch):
    """vLLM's prefix-cache key function as it is now, put back after the test (which may patch it)."""
    from vllm.v1.core import kv_cache_utils

    monkeypatch.setattr(kv_cache_utils, "_gen_lora_extra_hash_keys", kv_cache_utils._gen_lora_extra_hash_keys)


def test_a_cuda_vllm_gets_the_http_routes_and_none_of_the_cpu_patches(monkeypatch, vllm_ops_restored):
    import vllm.platforms

    from graft.rollout.vllm.server import entry, lora_cpu

    lora_ops, shm_broadcast = vllm_ops_restored
    monkeypatch.setattr(vllm.platforms, "_current_platform", _cuda_platform())
    device = entry.serving_device()
    assert device == "cuda"
    assert entry.select_patches(device) == (["lora_block_keys", "batch_route", "memory_adapters"],
                                            ["short_busy_wait", "lora_cpu", "fork_start"])
    # The engine core and workers get the prefix-cache key alone (this vLLM's key lacks the load).
    assert entry.install_patches(device, api_server=False) == ["lora_block_keys"]
    assert lora_ops.bgmv_expand is not lora_cpu.bgmv_expand
    assert shm_broadcast.SpinCondition.__init__.__defaults__ == (1,)
    assert entry.patches_line(device, ["batch_route", "memory_adapters"]) == (
        "graft patches applied: batch_route, memory_adapters; not installed (another vLLM version, or turned off): "
        "lora_block_keys; skipped on cuda: short_busy_wait, lora_cpu, fork_start")


def test_vllm_cpu_gets_every_patch_in_every_process(vllm_ops_restored):
    from graft.rollout.vllm.server import entry, lora_cpu

    lora_ops, shm_broadcast = vllm_ops_restored
    device = entry.serving_device()  # this machine's vLLM-CPU, as it reports itself
    assert device == "cpu"
    assert entry.select_patches(device) == (
        ["short_busy_wait", "lora_cpu", "lora_block_keys", "fork_start", "batch_route", "memory_adapters"], [])
    assert entry.install_patches(device, api_server=False) == ["short_busy_wait", "lora_cpu", "lora_block_keys"]
    assert lora_ops.bgmv_expand is lora_cpu.bgmv_expand
    assert shm_broadcast.SpinCondition.__init__.__defaults__ == (entry.BUSY_LOOP_S,)
    assert entry.patches_line(device, ["short_busy_wait", "batch_route"]) == (
        "graft patches applied: short_busy_wait, batch_route; not installed (another vLLM version, or turned "
        "off): lora_cpu, lora_block_keys, fork_start, memory_adapters; skipped on cpu: none")


def _lora_request(name: str, path: str, load: int) -> SimpleNamespace:
    """What the prefix cache's key reads of a request through an adapter, `load` the id vLLM gave
    the adapter's load."""
    return SimpleNamespace(lora_request=SimpleNamespace(lora_name=name, lora_path=path, lora_int_id=load),
                           mm_features=[], cache_salt=None, prompt_embeds=None)


def _block_key(name: str, path: str, load: int):
    from vllm.v1.core import kv_cache_utils

    return kv_cache_utils.generate_block_hash_extra_keys(_lora_request(name, path, load), 0, 16, 0)[0]


def _name_keys(request) -> list:  # vLLM 0.20's key
    return [request.lora_request.lora_name] if request.lora_request else []


def _name_and_path_keys(request) -> list:  # vLLM 0.32's key
    lora = request.lora_request
    return [("lora", lora.lora_name, lora.lora_path)] if lora else []


@pytest.mark.parametrize("vllm_keys", [_name_keys, _name_and_path_keys], ids=["vllm-0.20", "vllm-0.32"])
def test_a_vllm_keying_adapter_blocks_without_their_load_gets_them_keyed_by_load(monkeypatch, vllm_keys):
    """Each vLLM's key in this vLLM's module: after the patch, two loads under one name share no
    prefix-cache block, from two paths or from one; the blocks of one load keep one key."""
    from vllm.v1.core import kv_cache_utils

    from graft.rollout.vllm.server.versions import key_lora_blocks_by_load

    monkeypatch.setattr(kv_cache_utils, "_gen_lora_extra_hash_keys", vllm_keys)
    # the stale KV a load after an unload would hit: same path (both vLLMs), another path (0.20)
    assert _block_key("policy-v1", "/run/v1", 1) == _block_key("policy-v1", "/run/v1", 2)
    assert (_block_key("policy-v1", "/run-a/v1", 1) == _block_key("policy-v1", "/run-b/v1", 2)) == (
        vllm_keys is _name_keys)
    assert key_lora_blocks_by_load()
    assert _block_key("policy-v1", "/run/v1", 1) != _block_key("policy-v1", "/run/v1", 2)
    assert _block_key("policy-v1", "/run-a/v1", 1) != _block_key("policy-v1", "/run-b/v1", 2)
    assert _block_key("policy-v1", "/run/v1", 1) == _block_key("policy-v1", "/run/v1", 1)
    assert kv_cache_utils.generate_block_hash_extra_keys(
        SimpleNamespace(lora_request=None, mm_features=[], cache_salt=None, prompt_embeds=None), 0, 16, 0)[0] is None


def test_a_vllm_whose_key_holds_the_load_keeps_its_own(monkeypatch):
    from vllm.v1.core import kv_cache_utils

    from graft.rollout.vllm.server.versions import key_lora_blocks_by_load

    def own(request):
        lora = request.lora_request
        return [("lora", lora.lora_name, lora.lora_path, lora.lora_int_id)] if lora else []

    monkeypatch.setattr(kv_cache_utils, "_gen_lora_extra_hash_keys", own)
    assert not key_lora_blocks_by_load()
    assert kv_cache_utils._gen_lora_extra_hash_keys is own


def test_a_platform_graft_has_no_entry_for_gets_no_patch():
    from graft.rollout.vllm.server import entry

    assert entry.select_patches("xpu") == ([], list(entry.PATCHES))


@pytest.mark.vllm
def test_the_server_logs_once_which_patches_it_got(vllm_server):
    with open(vllm_server.log_path) as log:
        lines = [line.strip() for line in log if line.startswith("graft patches applied:")]
    assert lines == ["graft patches applied: short_busy_wait, lora_cpu, lora_block_keys, fork_start, batch_route, "
                     "memory_adapters; skipped on cpu: none"]


@pytest.mark.vllm
def test_the_server_process_imports_no_graft_config(vllm_server):
    """The server once read an environment variable's name from graft.rollout.vllm.launcher, and with it
    imported graft.config, pydantic and 28 graft modules; its own package, the adapter blob format
    (lora_memory), the process-group names (the owner watchdog) and the kernel cache's directory
    (lora_kernel) are 16."""
    with open(vllm_server.log_path) as log:
        lines = [line.strip() for line in log if line.startswith("graft modules loaded:")]
    assert len(lines) == 1, lines
    count, names = re.fullmatch(r"graft modules loaded: (\d+) \((.*)\)", lines[0]).groups()
    modules = names.split(", ")
    assert int(count) == len(modules)
    assert [m for m in modules if m == "graft.config" or m.startswith("graft.config.")] == []
    assert len(modules) <= 16, modules
