"""AdapterSync: adapter names, the retention window, deferred unloads of versions still in use, the
max_loras cap and disk GC, on a recording fake engine and the in-process reference engine. Faults
(failed unloads, adapters a killed run left, files changed on disk) are in test_adapter_sync_faults.py,
50 cycles on the real vLLM server in test_adapter_sync_vllm.py.

Asyncio runs through `asyncio.run` inside plain test functions.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from graft.rollout.engine import GenerateRequest, SamplingParams
from graft.rollout.reference import ReferenceEngine
from graft.sync.adapter import adapter_name, adapter_version
from tests.helpers import is_peft_adapter, randomize_lora
from tests.sync.common import RecordingEngine, current_adapter, make_sync, names, run

GREEDY = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)


# ---- names ----

def test_adapter_names_are_made_and_parsed_in_one_place():
    assert adapter_name("graft", 7) == "graft-v7"
    assert adapter_version("graft", "graft-v7") == 7
    assert adapter_version("graft-v1", "graft-v1-v30") == 30
    for other in ("graft-v07", "graft-v", "graft-vx", "graft-v1a", "other-v7", "graft", "xgraft-v7", "graft-v٣"):
        assert adapter_version("graft", other) is None, other


def test_bad_window_settings_are_rejected(tmp_path):
    for keep, max_loras in ((-1, 4), (5, 4), (0, 0)):
        with pytest.raises(ValueError, match="keep_versions"):
            make_sync(RecordingEngine(), tmp_path, keep=keep, max_loras=max_loras)


def test_names_come_from_lora_name_and_other_adapters_are_not_counted(tmp_path, peft_model):
    engine = RecordingEngine(others=("someone-else", "policy.a-vx"))
    sync, _, publisher = make_sync(engine, tmp_path, keep=2, lora_name="policy.a")

    async def main():
        assert current_adapter(sync) is None and sync.current_version is None
        result = await sync.sync(peft_model, 1, step=10)
        assert result.adapter == current_adapter(sync) == "policy.a-v1" and sync.current_version == 1
        assert Path(engine.adapters["policy.a-v1"]).resolve() == publisher.latest("adapter").path
        assert (result.mode, result.version, result.engine_adapters_loaded) == ("adapter", 1, 1)
        assert result.bytes == publisher.latest("adapter").bytes > 0
        assert result.seconds >= result.publish_seconds + result.apply_seconds
        with pytest.raises(ValueError, match="not above"):
            await sync.sync(peft_model, 1, step=11)
        await sync.close()
        assert current_adapter(sync) is None and sync.loaded == []
        assert set(engine.adapters) == {"someone-else", "policy.a-vx"}  # not graft's: left alone

    run(main())


def test_keep_versions_0_unloads_nothing_over_6_syncs(tmp_path, peft_model):
    engine = RecordingEngine()
    sync, _, _ = make_sync(engine, tmp_path, keep=0, max_loras=4)

    async def main():
        loaded_after = [(await sync.sync(peft_model, v, step=v)).engine_adapters_loaded for v in range(1, 7)]
        assert loaded_after == [1, 2, 3, 4, 5, 6]
        assert sync.loaded == [1, 2, 3, 4, 5, 6] and current_adapter(sync) == "graft-v6"
        assert not any(c.startswith("unload") for c in engine.calls)
        await sync.close()
        assert engine.adapters == {}

    run(main())


@pytest.mark.parametrize("max_loras, peak", [(4, 3), (2, 2)])
def test_keep_versions_2_keeps_exactly_the_newest_2(tmp_path, peft_model, max_loras, peak):
    engine = RecordingEngine()
    sync, _, _ = make_sync(engine, tmp_path, keep=2, max_loras=max_loras)

    async def main():
        for v in range(1, 7):
            result = await sync.sync(peft_model, v, step=v)
            assert engine.graft_adapters() == names(range(max(1, v - 1), v + 1))
            assert sync.loaded == list(range(max(1, v - 1), v + 1))
            assert result.engine_adapters_loaded == min(v, 2) and result.unload_failures == 0
        # With a slot free the new version loads first (servable sooner) and the one leaving the window
        # is unloaded after; with none free it is unloaded first: never more than max_loras at once.
        assert max(len(s) for s in engine.history) == peak
        await sync.close()

    run(main())


@pytest.mark.parametrize("keep", [3, 2])
def test_closing_with_a_version_to_keep_unloads_all_but_that_one(tmp_path, peft_model, keep):
    """What a run that stops early leaves on a shared server: its last good version (the newest, or an
    older one when the newest failed its delivery check), nothing else."""
    engine = RecordingEngine(others=("someone-else",))
    sync, _, _ = make_sync(engine, tmp_path, keep=3, max_loras=4)

    async def main():
        for v in range(1, 4):
            await sync.sync(peft_model, v, step=v)
        assert engine.graft_adapters() == names([1, 2, 3])
        await sync.close(keep=keep)
        assert engine.graft_adapters() == names([keep]) and current_adapter(sync) == f"graft-v{keep}"
        assert sync.loaded == [keep] and "someone-else" in engine.adapters
        await sync.close(keep=9)  # not loaded: nothing to keep
        assert engine.graft_adapters() == names([]) and current_adapter(sync) is None
        assert engine.graft_adapters() == names([]) and current_adapter(sync) is None

    run(main())


def test_closing_after_a_signal_cancelled_every_task_still_unloads_the_busy_versions(tmp_path, peft_model):
    """A SIGTERMed run: asyncio.run cancels every task at once, the requests holding an old version and
    the wait to unload it among them; the run's close must still leave only the version it keeps."""
    engine = RecordingEngine()
    sync, inflight, _ = make_sync(engine, tmp_path, keep=3, max_loras=4)

    async def request_on(version: int):
        async with inflight.use(version):
            await asyncio.Event().wait()

    async def main():
        for v in range(1, 4):
            await sync.sync(peft_model, v, step=v)
        request = asyncio.create_task(request_on(2))
        await asyncio.sleep(0)
        closing = asyncio.create_task(sync.close(keep=3))
        await asyncio.sleep(0.01)
        assert engine.graft_adapters() == names([2, 3]) and not request.done()  # waiting for the request
        for task in asyncio.all_tasks() - {asyncio.current_task(), closing}:
            task.cancel()
        await asyncio.wait_for(closing, 1)
        assert engine.graft_adapters() == names([3]) and sync.loaded == [3]

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
        assert not syncing.done() and engine.graft_adapters() == names([1, 2]) and current_adapter(sync) == "graft-v2"
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
                (completions,) = await engine.generate(request, current_adapter(sync))
            outputs.append(completions[0].token_ids)
            assert await engine.list_adapters() == [f"ref-v{u}" for u in range(max(1, v - 1), v + 1)]
        await sync.close()
        assert await engine.list_adapters() == []
        return outputs

    outputs = run(main())
    randomize_lora(peft_model, seed=1)  # back to the module fixture's weights
    assert len(set(outputs)) > 1, "the adapters do not change the output; the test proves nothing"


