"""AdapterSync under faults: a failed unload is counted and retried, an adapter already gone is
forgotten, adapters a killed run left are unloaded before the first load, and a version changed on
disk after publishing is never loaded, and a live run's adapters under the same lora.name are never
unloaded: the newcomer refuses."""

import logging

import pytest

from graft.sync.owner import LoraNameInUseError
from tests.sync.common import RecordingEngine, current_adapter, make_sync, names, run


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


def test_a_live_run_using_the_same_lora_name_is_refused_not_unloaded(tmp_path, peft_model):
    """Run A is live (it holds its publish root); run B, same lora.name on the same server, refuses
    with one message naming A and leaves A's adapters alone. Once A is gone (here: its lease dropped
    as the kernel drops it for a killed process), its leftovers are unloaded as before."""
    engine = RecordingEngine()
    run_a, _, _ = make_sync(engine, tmp_path / "a", keep=2, lora_name="policy")
    run_b, _, _ = make_sync(engine, tmp_path / "b", keep=2, lora_name="policy")

    async def main():
        await run_a.sync(peft_model, 1, step=1)
        await run_a.sync(peft_model, 2, step=2)
        with pytest.raises(LoraNameInUseError, match=r"lora.name 'policy' is in use on fake by a live run \(pid "):
            await run_b.sync(peft_model, 1, step=1)
        assert engine.graft_adapters("policy") == {"policy-v1", "policy-v2"}
        assert not any(call.startswith("unload") for call in engine.calls)
        run_a._lease.release()  # run A killed
        run_b._stale_unloaded = False
        await run_b.sync(peft_model, 1, step=1)
        assert engine.graft_adapters("policy") == {"policy-v1"}
        assert engine.adapters["policy-v1"].startswith(str(tmp_path / "b"))
        await run_b.close()

    run(main())


def test_two_runs_publishing_into_one_root_are_refused(tmp_path, peft_model):
    engine = RecordingEngine()
    run_a, _, _ = make_sync(engine, tmp_path, keep=2, lora_name="policy")
    run_b, _, _ = make_sync(RecordingEngine(), tmp_path, keep=2, lora_name="policy")

    async def main():
        await run_a.sync(peft_model, 1, step=1)
        with pytest.raises(LoraNameInUseError, match="is in use by a live run"):
            await run_b.sync(peft_model, 2, step=2)
        await run_a.close()  # the lease goes with the run
        await run_b.sync(peft_model, 2, step=2)
        await run_b.close()

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
        assert current_adapter(sync) == "graft-v3" and result.unload_failures == 1 and sync.unload_failures == 1
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


def test_a_version_changed_on_disk_after_publishing_is_never_loaded(tmp_path, peft_model, monkeypatch):
    from graft.sync import transport as transport_module
    from graft.sync.publish import CorruptVersionError

    engine = RecordingEngine()
    sync, _, publisher = make_sync(engine, tmp_path, keep=2)
    real_read_version = transport_module.read_version

    def tampered_then_read(root, kind, version, **kwargs):
        weights = publisher.root / f"{kind}-v{version:06d}" / "adapter_model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-8] + b"tampered")  # between publish and load
        return real_read_version(root, kind, version, **kwargs)

    monkeypatch.setattr(transport_module, "read_version", tampered_then_read)
    with pytest.raises(CorruptVersionError, match="adapter_model.safetensors"):
        run(sync.sync(peft_model, 1, step=1))
    assert engine.adapters == {}
