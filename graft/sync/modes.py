"""Sync modes: how a new policy version reaches the engines, behind one interface, by name.

`sync.mode` names an entry of `SYNC_MODES`; outside `graft.sync` only the server launch asks about
the mode (`graft.rollout.factory`, through `sync.reloads_weights`: a merged run's vLLM gets the
weight-reload endpoints and no LoRA slots). A mode publishes a version and applies it (`sync`),
says which adapter name a rollout of a version requests (`request_adapter`: the one question
rollout code asks), whether a sync must not interleave with generation (`needs_engine_lock`), and
cleans up (`discard_from`, `close`).

| mode      | what reaches the engine                   | requests name        | engine lock |
|-----------|-------------------------------------------|----------------------|-------------|
| `adapter` | the PEFT adapter, as `<lora.name>-v<N>`   | `<lora.name>-v<N>`   | no          |
| `merged`  | base + LoRA merged in fp32, reloaded      | the base model       | yes         |
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from graft.config import GraftConfig
from graft.models.loading import resolve_dtype
from graft.rollout.engine import RolloutEngine
from graft.sync.adapter import AdapterSync
from graft.sync.inflight import InFlightVersions
from graft.sync.merged import MergedSync
from graft.sync.publish import WeightPublisher
from graft.sync.result import SyncResult
from graft.sync.source import Policy

# Merged weights are whole models: keep the one being served and the one before it on disk.
_MERGED_ON_DISK = 2


class SyncMode(Protocol):
    """One way of getting policy versions into the engines (see the module docstring)."""

    name: str  # the `sync.mode` value and the metrics' `sync_mode`
    needs_engine_lock: bool  # True: a sync changes what running requests compute (hold the engine lock)

    async def sync(self, policy: Policy, version: int, step: int) -> SyncResult:
        """Publish `policy` as `version` (trained at `step`) and make every engine serve it.

        `policy` is read through `graft.sync.source.policy_source`: a model held whole, or an
        FSDP2 run's sharded source (whose reads are collectives the other ranks join)."""
        ...

    def request_adapter(self, version: int) -> str | None:
        """The adapter name a rollout of `version` requests; None = the base model's name."""
        ...

    def discard_from(self, version: int) -> None:
        """Forget published versions >= `version` on disk before (re)publishing from `version`."""
        ...

    async def close(self, keep: int | None = None) -> None:
        """Leave shared engines clean (unload what this run loaded), but `keep` served: a run that
        did not finish leaves its last good version served and unloads the rest."""
        ...


# Builds a mode from the run's config, its engine(s), the weights directory and the in-flight counts
# (which the adapter mode needs to never unload a version a request still uses).
SyncModeFactory = Callable[[GraftConfig, RolloutEngine, Path, InFlightVersions], SyncMode]


def _adapter_mode(config: GraftConfig, engine: RolloutEngine, weights_dir: Path,
                  inflight: InFlightVersions) -> AdapterSync:
    keep = config.sync.resolved_keep_versions(config.rollout.max_staleness)
    # On disk: what the engine has loaded is protected anyway; keep one more for inspection.
    publisher = WeightPublisher(weights_dir, keep_versions=keep + 1 if keep else 0)
    return AdapterSync(engine, publisher, lora_name=config.lora.name, keep_versions=keep,
                       max_loras=config.rollout.max_loras, inflight=inflight, transport=config.sync.transport,
                       keep_on_disk=config.sync.keep_on_disk)


def _merged_mode(config: GraftConfig, engine: RolloutEngine, weights_dir: Path,
                 inflight: InFlightVersions) -> MergedSync:
    return MergedSync(engine, WeightPublisher(weights_dir, keep_versions=_MERGED_ON_DISK),
                      dtype=resolve_dtype(config.model.dtype))


SYNC_MODES: dict[str, SyncModeFactory] = {"adapter": _adapter_mode, "merged": _merged_mode}


def build_sync_mode(config: GraftConfig, engine: RolloutEngine, weights_dir: Path,
                    inflight: InFlightVersions) -> SyncMode:
    """The mode `config.sync.mode` names (the config only admits registered names)."""
    return SYNC_MODES[config.sync.mode](config, engine, weights_dir, inflight)
