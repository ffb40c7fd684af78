"""The sync-mode registry: every mode `sync.mode` admits is registered, answers the questions rollout
code asks (which adapter a version's requests name, whether a sync needs the engine lock), and
cleans up what an interrupted run published."""

import asyncio
import typing

import pytest

from graft.config import SyncConfig, load_config
from graft.rollout.reference import ReferenceEngine
from graft.sync.adapter import AdapterSync
from graft.sync.inflight import InFlightVersions
from graft.sync.merged import MergedSync
from graft.sync.modes import SYNC_MODES, build_sync_mode
from tests.helpers import trained_like_peft_model


def test_every_mode_the_config_admits_is_registered():
    admitted = set(typing.get_args(SyncConfig.model_fields["mode"].annotation))
    assert admitted == set(SYNC_MODES)


@pytest.mark.parametrize("mode, cls, adapter_of_7, lock", [
    ("adapter", AdapterSync, "policy-v7", False),
    ("merged", MergedSync, None, True),
])
def test_modes_answer_what_rollouts_ask(base_dir, tmp_path, mode, cls, adapter_of_7, lock):
    config = load_config(None, [f"model.path={base_dir}", "rollout.engine=reference", "lora.name=policy",
                                f"sync.mode={mode}"])
    built = build_sync_mode(config, ReferenceEngine(base_dir), tmp_path / "weights", InFlightVersions())
    assert isinstance(built, cls) and built.name == mode
    assert built.request_adapter(7) == adapter_of_7
    assert built.needs_engine_lock is lock


# On disk the adapter mode keeps keep_versions + 1 = 3 versions, the merged mode 2 (whole models).
@pytest.mark.parametrize("mode, left", [("adapter", [1]), ("merged", [])])
def test_discard_from_forgets_what_an_interrupted_run_published(base_dir, tmp_path, mode, left):
    config = load_config(None, [f"model.path={base_dir}", "rollout.engine=reference", f"sync.mode={mode}",
                                "sync.verify=false"])
    model = trained_like_peft_model(base_dir)

    async def publish_three_then_discard():
        built = build_sync_mode(config, ReferenceEngine(base_dir), tmp_path / "weights", InFlightVersions())
        for version in (1, 2, 3):
            await built.sync(model, version, step=version)
        built.discard_from(2)
        versions = [v.version for v in built.publisher.versions(mode)]
        await built.close()
        return versions

    assert asyncio.run(publish_three_then_discard()) == left
