"""How adapter versions reach the engines (graft.sync.transport): which transport a run takes for which
engines, that memory versions write nothing and carry exactly the trainer's tensors, and that an engine
refusing the memory route moves the run to disk once, with nothing left loaded twice."""

import asyncio
import logging
import os
from pathlib import Path

import pytest
import safetensors.torch
import torch

from graft.lora.attach import lora_parameters
from graft.rollout.adapter_blob import SHM_DIR, SharedBlob, blob_config, folded_scaling, map_segment
from graft.rollout.engine import TransportUnsupportedError
from graft.rollout.pool import EnginePool
from graft.sync.source import policy_source
from graft.sync.transport import choose, offered
from tests.helpers import is_peft_adapter
from tests.sync.common import RecordingEngine, make_sync, run


class BlobEngine(RecordingEngine):
    """A RecordingEngine that also takes adapters from memory (keeping each blob), or refuses them as
    a vLLM without graft's route does (`refuse`)."""

    memory_transports = ("http", "shm")

    def __init__(self, address: str = "http://127.0.0.1:8000", refuse: bool = False) -> None:
        super().__init__()
        self.address, self.refuse, self.blobs = address, refuse, {}

    async def load_adapter_blob(self, name: str, label: str, blob) -> None:
        if self.refuse:
            raise TransportUnsupportedError("this server has no graft memory route", address=self.address, status=404)
        assert name not in self.adapters
        transport = "shm" if isinstance(blob, SharedBlob) else "http"
        if transport == "shm":  # read it now, as the server maps it during the call
            blob = bytes(map_segment(blob.segment))
        self.adapters[name], self.blobs[name] = label, blob
        self.calls.append(f"load {name} by {transport}")
        self.history.append(frozenset(self.adapters))


def test_auto_takes_shm_on_this_host_memory_elsewhere_and_disk_for_engines_without_the_route():
    assert choose("auto", BlobEngine("http://127.0.0.1:8000")) == "shm"
    assert choose("auto", BlobEngine("http://gpu-node-3:8000")) == "memory"
    assert choose("auto", RecordingEngine()) == "disk"
    # A pool takes what every live member takes.
    assert offered(EnginePool([BlobEngine("http://127.0.0.1:1"), BlobEngine("http://node:2")])) == {"disk", "memory"}
    assert offered(EnginePool([BlobEngine("http://127.0.0.1:1"), RecordingEngine()])) == {"disk"}


def test_a_named_transport_the_engine_lacks_goes_by_disk_and_says_so(caplog):
    with caplog.at_level(logging.WARNING, logger="graft.sync.transport"):
        assert choose("shm", BlobEngine("http://node:2")) == "disk"
        assert choose("memory", BlobEngine("http://node:2")) == "memory"
    assert "sync.transport shm: not offered" in caplog.text


def test_an_unknown_transport_is_refused(tmp_path):
    with pytest.raises(ValueError, match="transport must be"):
        make_sync(RecordingEngine(), tmp_path, keep=2, transport="carrier-pigeon")


@pytest.mark.parametrize("transport", ["memory", "shm"])
def test_memory_versions_carry_the_trainers_tensors_and_write_no_file(tmp_path, peft_model, transport):
    engine = BlobEngine()
    sync, _, publisher = make_sync(engine, tmp_path, keep=2, transport=transport)
    weights = policy_source(peft_model).adapter()
    tensors, config = weights.converted(), weights.config

    async def main():
        for version in (1, 2, 3):
            result = await sync.sync(peft_model, version, step=version)
            assert result.bytes == len(engine.blobs[f"graft-v{version}"])
        loaded = dict(engine.adapters)
        await sync.close()
        return loaded

    loaded = run(main())
    blob = engine.blobs["graft-v3"]
    decoded = safetensors.torch.load(blob)
    served_config, scaling = folded_scaling(config)  # the served form: scaling folded into lora_B
    assert scaling != 1 and blob_config(blob) == served_config
    assert decoded.keys() == tensors.keys()
    assert all(torch.equal(decoded[k], tensors[k] * scaling if ".lora_B." in k else tensors[k]) for k in tensors)
    assert engine.calls[:2] == [f"load graft-v1 by {'http' if transport == 'memory' else 'shm'}", "load graft-v2 by "
                                f"{'http' if transport == 'memory' else 'shm'}"]
    assert engine.adapters == {}  # the window's unloads went as with disk
    assert [p.name for p in publisher.root.iterdir() if p.name.startswith("adapter-")] == []
    # Every segment of this process released (another process's, e.g. a test beside this one, are its own).
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(f"graft-lora-{os.getpid()}-")]
    # Each version's label is unique and lies in the publish root (where graft.sync.owner looks).
    assert loaded == {f"graft-v{v}": str(publisher.root / f"adapter-v{v:06d}.memory") for v in (2, 3)}


def test_an_engine_refusing_the_memory_route_moves_the_run_to_disk_once(tmp_path, peft_model, caplog):
    engine = BlobEngine(refuse=True)
    sync, _, publisher = make_sync(engine, tmp_path, keep=2, transport="auto")

    async def main():
        with caplog.at_level(logging.WARNING, logger="graft.sync.adapter"):
            for version in (1, 2):
                await sync.sync(peft_model, version, step=version)
        await sync.close()

    run(main())
    assert sync.transport == "disk" and engine.calls[0] == "load graft-v1"
    assert caplog.text.count("go by disk from now on") == 1
    assert (publisher.root / "adapter-v000002.ready").exists()


def test_a_pool_member_refusing_the_route_leaves_no_memory_copy_on_the_others(tmp_path, peft_model):
    willing, refusing = BlobEngine("http://127.0.0.1:1"), BlobEngine("http://127.0.0.1:2", refuse=True)
    sync, _, _ = make_sync(EnginePool([willing, refusing]), tmp_path, keep=2, transport="memory")

    async def main():
        await sync.sync(peft_model, 1, step=1)
        return dict(willing.adapters), dict(refusing.adapters)

    on_willing, on_refusing = run(main())
    assert sync.transport == "disk"
    assert on_willing == on_refusing and on_willing.keys() == {"graft-v1"}
    assert Path(on_willing["graft-v1"]).resolve() == tmp_path / "weights" / "adapter-v000001"
    assert willing.calls == ["load graft-v1 by http", "unload graft-v1", "load graft-v1"]


@pytest.mark.parametrize("transport", ["memory", "shm"])
def test_keep_on_disk_publishes_each_memory_version_after_its_load(tmp_path, peft_model, transport):
    import safetensors.torch

    from graft.lora.adapter_io import ADAPTER_WEIGHTS, read_adapter_config
    from graft.sync.publish import read_version

    engine = BlobEngine()
    sync, _, publisher = make_sync(engine, tmp_path, keep=2, transport=transport, keep_on_disk=True)
    snapshots = []

    async def main():
        for version in (1, 2, 3):
            with torch.no_grad():
                for param in lora_parameters(peft_model).values():
                    param.add_(0.01)
            snapshots.append({k: t.clone() for k, t in policy_source(peft_model).adapter().converted().items()})
            await sync.sync(peft_model, version, step=10 * version)
        await sync.close()  # waits for the last write

    run(main())
    for version, want in zip((1, 2, 3), snapshots):
        published = read_version(publisher.root, "adapter", version)  # manifest and sha256 checked
        assert published.step == 10 * version and is_peft_adapter(published.path)
        assert read_adapter_config(published.path) == policy_source(peft_model).adapter().config
        got = safetensors.torch.load_file(published.path / ADAPTER_WEIGHTS)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert engine.adapters == {} and sync.transport == transport


def test_a_version_unloaded_while_its_kept_copy_is_written_keeps_its_segment_until_then(tmp_path, peft_model,
                                                                                         monkeypatch):
    """shm with keep_on_disk: the run closes (unloading every version) while the last version's files
    are still being written from its segment; the write reads the segment it held, not a freed one."""
    import threading
    import time

    from graft.rollout.adapter_blob import SegmentPool
    from graft.sync.publish import read_version

    contents, reading = SegmentPool.contents, threading.Event()

    def slow_contents(pool, key):
        reading.set()
        time.sleep(0.3)  # the loop unloads the version meanwhile
        return contents(pool, key)

    monkeypatch.setattr(SegmentPool, "contents", slow_contents)
    sync, _, publisher = make_sync(BlobEngine(), tmp_path, keep=2, transport="shm", keep_on_disk=True)

    async def main():
        await sync.sync(peft_model, 1, step=10)
        await asyncio.to_thread(reading.wait)
        await sync.close()

    run(main())
    assert read_version(publisher.root, "adapter", 1).step == 10  # written whole, manifest checked
