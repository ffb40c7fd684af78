"""Merged sync: publish whole model weights and have the engines reload them.

Merged mode streams `base + LoRA` through graft's zero-drift merge (fp32 math, one rounding, into
new tensors: the trainer's base weights are never written) into a versioned directory, then every
engine reloads its base weights from it (pause → reload → reset prefix cache → resume, inside the
engine client). Requests then name the base model: serving runs at base speed, without the LoRA
kernels.

A reload swaps what every request sees, so `needs_engine_lock`: the trainer holds the rollout
producer's engine lock across the sync and no batch mixes two versions.
"""

from __future__ import annotations

import time

import peft
import torch

from graft.lora.export import write_merged_model
from graft.rollout.engine import RolloutEngine
from graft.sync.publish import WeightPublisher
from graft.sync.result import SyncResult
from graft.sync.source import Policy, policy_source


class MergedSync:
    """The `merged` sync mode: publish merged weight versions and reload them into `engine`.
    Implements `graft.sync.modes.SyncMode`.

    Args:
        dtype: dtype of the published weights: what the engine serves (e.g. bfloat16).
    """

    needs_engine_lock = True

    def __init__(self, engine: RolloutEngine, publisher: WeightPublisher, *, dtype: torch.dtype) -> None:
        self.engine = engine
        self.publisher = publisher
        self.kind = self.name = "merged"
        self.dtype = dtype

    def request_adapter(self, version: int) -> None:
        """Requests name the base model: the engine's base weights are the policy."""
        return None

    def discard_from(self, version: int) -> None:
        """Forget published versions >= `version` on disk (an interrupted run's), before republishing."""
        self.publisher.discard_from(self.kind, version)

    async def close(self, keep: int | None = None) -> None:
        """Nothing to unload: the engine keeps serving the last reloaded weights."""

    async def sync(self, policy: Policy, version: int, step: int) -> SyncResult:
        """Publish `policy`'s weights as `version` and make every engine serve them.

        The weights stream from `PolicySource.merged_weights` into the shards: in an FSDP2 run the
        other ranks gather each module with rank 0, which merges and writes it (no model copy).
        """
        source = policy_source(policy)
        model = source.model
        if not isinstance(model, peft.PeftModel):
            raise ValueError(f"merged sync needs a LoRA (PEFT) model, got {type(model).__name__}")
        start = time.perf_counter()
        published = self.publisher.publish(
            self.kind, version, step,
            lambda out_dir: write_merged_model(model, out_dir, dtype=self.dtype,
                                               weights=source.merged_weights(self.dtype)))
        published_at = time.perf_counter()
        await self.engine.reload_weights(str(published.path))
        done = time.perf_counter()
        return SyncResult(mode=self.kind, version=version, adapter=None, seconds=done - start,
                          publish_seconds=published_at - start, apply_seconds=done - published_at,
                          bytes=published.bytes, engine_adapters_loaded=0, unload_failures=0)
