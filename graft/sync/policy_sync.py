"""`PolicySync`: the one object the trainer calls after each optimizer step.

It builds the configured `SyncMode` (`graft.sync.modes`), syncs each new version through it,
verifies delivery when `sync.verify` is on, and returns the per-step metrics the run directory
contract names (`sync_mode`, `sync_seconds`, `sync_bytes`, `engine_adapters_loaded`,
`policy_version`), the delivery check's gap (`sync_logprob_abs_diff_max`; the update's own
`logprob_abs_diff_max` is the batch's gap), and `engines_live`: the engines still serving the run
(a pool drops those that fail, see `graft.rollout.pool`).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from graft.atomic import atomic_write_text
from graft.config import GraftConfig
from graft.rollout.engine import RolloutEngine
from graft.rollout.pool import live_engine_count
from graft.sync.guard import check_finite_policy
from graft.sync.inflight import InFlightVersions
from graft.sync.modes import SyncMode, build_sync_mode
from graft.sync.result import SyncResult
from graft.sync.served import ServedVersion
from graft.sync.source import Policy, PolicySource, policy_source
from graft.sync.verify import DEFAULT_TOLERANCE, calibrated_tolerance, noise_floor, verify_delivery

log = logging.getLogger(__name__)


def weights_dir_of(config: GraftConfig, run_dir: str | Path) -> Path:
    """Where a run publishes its versions: RUN_DIR/weights, or SYNC_DIR/<lora.name> — a directory of
    its own inside a shared `sync.dir`, so a fresh run never discards another run's versions."""
    return Path(config.sync.dir) / config.lora.name if config.sync.dir else Path(run_dir) / "weights"


@dataclass(frozen=True)
class AppliedVersion:
    """A version published and applied to the engines, its delivery not yet verified."""

    source: PolicySource
    result: SyncResult


class PolicySync:
    """Sync + verify + metrics for one run.

    `mode` is the `SyncMode`; `inflight` counts the running requests per version (rollout code
    enters `inflight.use(version)` around each request so that no version in use is unloaded);
    `served` is the version rollouts may sample from, which the trainer releases after each sync.
    """

    def __init__(self, config: GraftConfig, engine: RolloutEngine, run_dir: str | Path,
                 inflight: InFlightVersions | None = None) -> None:
        self.engine = engine
        self.inflight = inflight or InFlightVersions()
        self.verify = config.sync.verify
        self.dtype = config.model.dtype
        self.tolerance = config.sync.verify_tolerance or DEFAULT_TOLERANCE[self.dtype]
        # `sync.verify_tolerance: null` on a half-precision model: measured at version 0 (`calibrate`),
        # kept in the run directory for a resumed run.
        self.calibration = Path(run_dir) / "verify-tolerance.json"
        self.calibrating = config.sync.verify_tolerance is None and self.dtype != "float32"
        self.floor: float | None = None  # the engines' gap to version 0, where it was measured
        if self.calibrating and self.calibration.exists():
            saved = json.loads(self.calibration.read_text())
            self.tolerance, self.floor, self.calibrating = saved["tolerance"], saved.get("floor"), False
        self.warn_only = config.sync.verify_action == "warn"
        weights_dir = weights_dir_of(config, run_dir)
        self.mode: SyncMode = build_sync_mode(config, engine, weights_dir, self.inflight)
        self.served = ServedVersion()
        self.good_version: int | None = None  # the newest version confirmed (verified, where verify is on)

    def check_summary(self) -> str:
        """The delivery check in words, for the run's start line: its tolerance and where it came from."""
        if not self.verify:
            return "delivery check off"
        if self.floor is None:
            return f"delivery check within {self.tolerance:.3g}"
        return (f"delivery check within {self.tolerance:.3g} (the engines' {self.dtype} gap to version 0: "
                f"{self.floor:.3g})")

    def request_adapter(self, version: int) -> str | None:
        """The adapter name a rollout of `version` requests (None: the base model's name)."""
        return self.mode.request_adapter(version)

    async def __call__(self, policy: Policy, version: int, step: int) -> dict:
        """Publish `policy` as `version`, apply it to every engine, verify; the step's sync metrics.

        `policy` is a model, or (an FSDP2 run's rank 0) a source whose forwards and merged stream
        are collectives: the other ranks serve them meanwhile (`graft.train.ranks`).

        Raises:
            NonFinitePolicyError: `policy` is not finite (nothing is published; see graft.sync.guard).
            DeliveryError: the engines do not serve it (unless `sync.verify_action: warn`).
        """
        return await self.confirm(await self.apply(policy, version, step))

    async def apply(self, policy: Policy, version: int, step: int) -> AppliedVersion:
        """The first half of `__call__`: publish and apply, not yet verified. The trainer lets the
        next rollout start here and calls `confirm` beside it (see `graft.train.trainer`)."""
        source = policy_source(policy)
        check_finite_policy(source, version)
        return AppliedVersion(source, await self.mode.sync(source, version, step))

    async def confirm(self, applied: AppliedVersion, source: PolicySource | None = None) -> dict:
        """The second half: verify delivery of what `apply` applied, reading the trainer's side from
        `source` (default the applied one; a `SnapshotSource` once the model may move on); the step's
        sync metrics (`sync_seconds` counts publish, apply and verify, wherever the verify ran)."""
        result, gap, verify_seconds = applied.result, None, 0.0
        if self.verify:
            start = time.perf_counter()
            if self.calibrating and result.version == 0:
                await self.calibrate(source or applied.source)
            gap = await verify_delivery(self.engine, source or applied.source, adapter=result.adapter,
                                        requested=self.request_adapter(result.version),
                                        tolerance=self.tolerance, warn_only=self.warn_only)
            verify_seconds = time.perf_counter() - start
        self.good_version = result.version
        return {"sync_mode": result.mode, "sync_transport": result.transport or "disk",
                "sync_seconds": result.seconds + verify_seconds,
                "sync_publish_seconds": result.publish_seconds, "sync_apply_seconds": result.apply_seconds,
                "sync_verify_seconds": verify_seconds,
                "sync_bytes": result.bytes, "engine_adapters_loaded": result.engine_adapters_loaded,
                "sync_logprob_abs_diff_max": gap, "policy_version": result.version,
                "engines_live": live_engine_count(self.engine)}

    async def calibrate(self, source: PolicySource) -> None:
        """The delivery check's tolerance from the engines' gap to version 0, which adds nothing to the
        base (`graft.sync.verify.NOISE_MARGIN`): what the engines' rounding is for this model, not what
        another model's was. Only then: a later version's gap may include a failed delivery."""
        floor = await noise_floor(self.engine, source, self.request_adapter(0))
        self.tolerance, self.calibrating = calibrated_tolerance(floor, self.dtype), False
        self.floor = floor
        atomic_write_text(self.calibration, json.dumps({"tolerance": self.tolerance, "floor": floor,
                                                        "dtype": self.dtype}) + "\n")
        log.info("delivery check: the engines' %s gap to version 0 is %.3g: tolerance %.3g", self.dtype, floor,
                 self.tolerance)

    def discard_from(self, version: int) -> None:
        """Forget published versions >= `version` on disk, before (re)publishing from `version`."""
        self.mode.discard_from(version)

    async def close(self, keep_last_good: bool = False) -> None:
        """Leave the engines clean (adapter mode unloads what graft loaded); `keep_last_good`: all but
        the newest version that passed its delivery check (never one that failed it)."""
        await self.mode.close(self.good_version if keep_last_good else None)
