"""How an adapter version gets from the trainer into the engines (`sync.transport`), registered by name.

- disk: the PEFT files published into the run's weights directory (atomic, manifest with sha256,
  `graft.sync.publish`), checked against their manifest again, and loaded by path. Works with any
  engine that shares the directory's filesystem.
- memory: one safetensors blob (graft.rollout.adapter_blob) in the body of one HTTP call per
  engine; nothing is written. Needs graft's memory route (servers graft launches or serves).
- shm: the same blob in a shared-memory segment of this host, named in the call; for engines on
  this host.
Both write the blob straight from the trainer's LoRA tensors, converting to the served dtype as they
copy, with the LoRA scaling folded into lora_B (graft.rollout.adapter_blob.folded_scaling), so vLLM's
build writes nothing (measured at the Qwen2.5-0.5B shape: `add_lora` 23 -> 13 ms).
With `sync.keep_on_disk`, the memory transports also publish each version's PEFT files (manifest and
all, as disk does) in the background once the engines loaded it: the next sync waits for that write
before it starts, never the one that made the version servable.

`auto` takes the fastest the engines offer (`choose`), measured by `graft bench sync` (adapter-memory
rows; docs/benchmarks.md). A memory transport an engine turns out not to offer (a vLLM not started
by graft answers 404) makes the sync fall back to disk for the rest of the run, logged once
(graft.sync.adapter).

A memory version has no directory, but it has a label where the path would be: `<weights
dir>/adapter-v000007.memory`, unique per version (vLLM's prefix-cache key holds it) and inside
the run's publish root, so a second run on the same server finds the root's owner lock as it
does for disk versions (graft.sync.owner).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from urllib.parse import urlparse

from graft.config import LOOPBACK_HOSTS
from graft.lora.adapter_io import AdapterWeights, write_adapter_blob_files, write_adapter_files
from graft.rollout.adapter_blob import SegmentPool, adapter_blob
from graft.rollout.engine import RolloutEngine
from graft.rollout.pool import pool_members
from graft.sync.publish import WeightPublisher, read_version, version_dir_name

KIND = "adapter"
MEMORY_LABEL_SUFFIX = ".memory"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prepared:
    """A version ready to load: its size, and the call that loads it into an engine under a name."""

    bytes: int
    load: Callable[[RolloutEngine, str], Awaitable[None]]


class DiskTransport:
    name = "disk"

    def __init__(self, publisher: WeightPublisher, *, keep_on_disk: bool = True) -> None:
        self.publisher = publisher

    async def loaded(self, version: int, step: int, protect: Collection[int]) -> None:
        """After a load: remove the versions no engine references (`protect`: the loaded ones)."""
        await asyncio.to_thread(self.publisher.garbage_collect, KIND, protect=set(protect))

    def unloaded(self, version: int) -> None:
        """`version` is loaded nowhere any more (garbage collection handles its files)."""

    async def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    async def prepare(self, version: int, step: int, weights: AdapterWeights, protect: Collection[int]) -> Prepared:
        """Publish the PEFT files (in a worker thread: generation on the event loop goes on)."""
        published = await asyncio.to_thread(
            self.publisher.publish, KIND, version, step,
            lambda tmp: write_adapter_files(weights.converted(), weights.config, tmp), protect=set(protect))
        path = await asyncio.to_thread(self.publisher.load_path, published)  # named by the weights (its docstring)

        async def load(engine: RolloutEngine, name: str) -> None:
            # The files the engine is about to read still match their manifest (size and sha256; one
            # read of a few MiB): a version changed on a shared filesystem is never loaded.
            await asyncio.to_thread(read_version, self.publisher.root, KIND, version)
            await engine.load_adapter(name, str(path))

        return Prepared(published.bytes, load)


class MemoryTransport:
    """`memory` (kind "http": the blob in bytes) or `shm` (kind "shm": in a segment of this host, one of
    the run's reused segments, held while its version is loaded): the engine's `load_adapter_blob`."""

    def __init__(self, publisher: WeightPublisher, kind: str, *, keep_on_disk: bool = False) -> None:
        self.publisher = publisher
        self.kind = kind
        self.name = "memory" if kind == "http" else kind
        self.keep_on_disk = keep_on_disk
        self._segments = SegmentPool() if kind == "shm" else None
        self._to_keep: tuple[int, bytes | None, dict] | None = None  # keep_on_disk: (version, bytes, config)
        self._writing: asyncio.Task | None = None
        self._writing_version: int | None = None

    async def prepare(self, version: int, step: int, weights: AdapterWeights, protect: Collection[int]) -> Prepared:
        """The blob (each tensor converted and copied once, in a worker thread; the scaling folded in
        unless the blob is also the kept PEFT file), once the previous version's files are written
        (`keep_on_disk`: one publisher writes a root at a time)."""
        await self.flush()
        options = {"dtype": weights.dtype, "fold_scaling": not self.keep_on_disk}
        if self._segments is not None:
            blob = await asyncio.to_thread(self._segments.write, version, weights.tensors, weights.config, **options)
            size = blob.size
        else:
            blob = await asyncio.to_thread(adapter_blob, weights.tensors, weights.config, **options)
            size = len(blob)
        if self.keep_on_disk:  # a segment's bytes are read from the pool when written
            self._to_keep = (version, None if self._segments is not None else blob, weights.config)
        label = str(self.publisher.root / (version_dir_name(KIND, version) + MEMORY_LABEL_SUFFIX))
        return Prepared(size, lambda engine, name: engine.load_adapter_blob(name, label, blob))

    async def loaded(self, version: int, step: int, protect: Collection[int]) -> None:
        """With `keep_on_disk`, publish the version's PEFT files in the background, off the sync's path
        (the blob is the weights file; a segment stays unchanged while its version is loaded)."""
        if self._to_keep is None or self._to_keep[0] != version:
            return
        _, blob, config = self._to_keep
        self._to_keep = None
        self._writing = asyncio.create_task(asyncio.to_thread(self._publish, version, step, blob, config,
                                                              set(protect)))
        self._writing_version = version

    def _publish(self, version: int, step: int, blob: bytes | None, config: dict, protect: set[int]) -> None:
        data = blob if blob is not None else self._segments.contents(version)
        self.publisher.publish(KIND, version, step, lambda tmp: write_adapter_blob_files(data, config, tmp),
                               protect=protect)
        self.publisher.garbage_collect(KIND, protect=protect | {version})

    async def flush(self) -> None:
        """Wait for the background write; raise what it raised (a version that could not be kept)."""
        if self._writing is not None:
            writing, self._writing = self._writing, None
            await writing

    def unloaded(self, version: int) -> None:
        """`version` is loaded nowhere any more (or never was): its segment may be rewritten, once its
        background write has read it (a run closing right after a sync unloads the version that write
        is keeping: a CI run's write found its segment gone)."""
        if self._segments is None:
            return
        writing = self._writing
        if writing is not None and not writing.done() and self._writing_version == version:
            writing.add_done_callback(lambda _: self._segments.release(version))
        else:
            self._segments.release(version)

    def close(self) -> None:
        if self._segments is not None:
            self._segments.close()


# (publisher, *, keep_on_disk) -> transport
TRANSPORTS: dict[str, Callable[..., DiskTransport | MemoryTransport]] = {
    "disk": DiskTransport,
    "memory": functools.partial(MemoryTransport, kind="http"),
    "shm": functools.partial(MemoryTransport, kind="shm"),
}


def offered(engine: RolloutEngine) -> set[str]:
    """The transports every live engine takes, by name: disk always, memory/shm where the engine
    has `load_adapter_blob`, shm only for engines on this host (a loopback URL)."""
    engines = pool_members(engine)
    names = {"disk", "memory", "shm"}
    for member in engines:
        kinds = set(getattr(member, "memory_transports", ())) if hasattr(member, "load_adapter_blob") else set()
        local = urlparse(getattr(member, "address", "")).hostname in LOOPBACK_HOSTS
        takes = {"memory": "http" in kinds, "shm": "shm" in kinds and local}
        names &= {"disk"} | {name for name, ok in takes.items() if ok}
    return names


def choose(requested: str, engine: RolloutEngine) -> str:
    """The transport a run uses: `requested`, or for "auto" the fastest the engines offer (shm, then
    memory, then disk; see the module docstring). A named memory transport an engine does not offer
    falls back to disk, logged."""
    available = offered(engine)
    if requested == "auto":
        chosen = next(name for name in ("shm", "memory", "disk") if name in available)
        log.info("sync.transport auto: %s (the engines offer %s)", chosen, ", ".join(sorted(available)))
        return chosen
    if requested not in available:
        log.warning("sync.transport %s: not offered by %s (offered: %s); adapters go by disk",
                    requested, getattr(engine, "address", engine), ", ".join(sorted(available)))
        return "disk"
    return requested
