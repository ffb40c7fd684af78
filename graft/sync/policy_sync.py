"""`PolicySync`: the one object the trainer calls after each optimizer step.

It picks the sync mode from `sync.mode` (a small registry, not an if/elif ladder), publishes and
applies the new version, verifies delivery when `sync.verify` is on, and returns the per-step
metrics the run directory contract names (`sync_mode`, `sync_seconds`, `sync_bytes`,
`engine_adapters_loaded`, `logprob_abs_diff_max`).
"""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path

from torch import nn

from graft.config import GraftConfig
from graft.models.loading import resolve_dtype
from graft.rollout.engine import RolloutEngine
from graft.sync.adapter import AdapterSync
from graft.sync.inflight import InFlightVersions
from graft.sync.merged import WeightsSync
from graft.sync.publish import WeightPublisher
from graft.sync.verify import DEFAULT_TOLERANCE, verify_delivery

# Merged weights are whole models: keep the one being served and the one before it on disk.
_MERGED_ON_DISK = 2
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def resolved_mode(config: GraftConfig) -> str:
    """`auto` is adapter sync: it works with every engine, local or remote, at any model size."""
    return "adapter" if config.sync.mode == "auto" else config.sync.mode


def check_sync_config(config: GraftConfig) -> None:
    """Reject sync settings that cannot work, before any process starts.

    Raises:
        ValueError: naming the keys at fault.
    """
    mode = resolved_mode(config)
    if mode == "full":
        raise ValueError("sync.mode 'full' publishes fully fine-tuned weights, but graft trains a LoRA adapter "
                         "on a frozen base: use sync.mode 'adapter' or 'merged'")
    if mode == "merged" and config.sync.dir is None:
        remote = [u for u in config.rollout.urls if urllib.parse.urlparse(u).hostname not in _LOOPBACK]
        if remote:
            raise ValueError(f"sync.mode 'merged' makes the engine reload weights from RUN_DIR/weights, which the "
                             f"remote engine(s) {', '.join(remote)} cannot read: set sync.dir to a directory they "
                             "share at the same path, or use sync.mode 'adapter'")


class PolicySync:
    """Sync + verify + metrics for one run. `adapter` is what rollout requests must name now."""

    def __init__(self, config: GraftConfig, engine: RolloutEngine, run_dir: str | Path,
                 inflight: InFlightVersions | None = None) -> None:
        check_sync_config(config)
        self.mode = resolved_mode(config)
        self.engine = engine
        self.inflight = inflight or InFlightVersions()
        self.verify = config.sync.verify
        self.tolerance = config.sync.verify_tolerance or DEFAULT_TOLERANCE[config.model.dtype]
        self.warn_only = config.sync.verify_action == "warn"
        weights_dir = Path(config.sync.dir) if config.sync.dir else Path(run_dir) / "weights"
        self._sync = _MODES[self.mode](config, engine, weights_dir, self.inflight)

    @property
    def adapter(self) -> str | None:
        return getattr(self._sync, "current", None)

    async def __call__(self, model: nn.Module, version: int, step: int) -> dict:
        """Publish `model` as `version`, apply it to every engine, verify; the step's sync metrics."""
        result = await self._sync.sync(model, version, step)
        gap, verify_seconds = None, 0.0
        if self.verify:
            start = time.perf_counter()
            gap = await verify_delivery(self.engine, model, adapter=result.adapter, tolerance=self.tolerance,
                                        warn_only=self.warn_only)
            verify_seconds = time.perf_counter() - start
        return {"sync_mode": result.mode, "sync_seconds": result.seconds + verify_seconds,
                "sync_bytes": result.bytes, "engine_adapters_loaded": result.engine_adapters_loaded,
                "logprob_abs_diff_max": gap, "policy_version": result.version}

    def discard_from(self, version: int) -> None:
        """Forget published versions >= `version` on disk, before (re)publishing from `version`."""
        self._sync.publisher.discard_from(self._sync.kind, version)

    async def close(self) -> None:
        """Unload what graft loaded (adapter mode), so a shared engine is left clean."""
        if isinstance(self._sync, AdapterSync):
            await self._sync.close()


def _adapter_sync(config: GraftConfig, engine: RolloutEngine, weights_dir: Path,
                  inflight: InFlightVersions) -> AdapterSync:
    keep = config.sync.resolved_keep_versions(config.rollout.max_staleness)
    # On disk: what the engine has loaded is protected anyway; keep one more for inspection.
    publisher = WeightPublisher(weights_dir, keep_versions=keep + 1 if keep else 0)
    return AdapterSync(engine, publisher, lora_name=config.lora.name, keep_versions=keep,
                       max_loras=config.rollout.max_loras, inflight=inflight)


def _merged_sync(config: GraftConfig, engine: RolloutEngine, weights_dir: Path,
                 inflight: InFlightVersions) -> WeightsSync:
    return WeightsSync(engine, WeightPublisher(weights_dir, keep_versions=_MERGED_ON_DISK), kind="merged",
                       dtype=resolve_dtype(config.model.dtype))


_MODES: dict[str, Callable[..., AdapterSync | WeightsSync]] = {"adapter": _adapter_sync, "merged": _merged_sync}
