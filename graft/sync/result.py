"""What one sync reports (one row of metrics per optimizer step draws from it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SyncResult:
    """One sync of one policy version into the engines.

    Attributes:
        mode: "adapter", "merged" or "full" (metrics key `sync_mode`).
        version: the policy version now served.
        adapter: the engine adapter name requests must use, or None (merged/full: the base name).
        seconds: publish + engine apply (+ verify, when the caller adds it) (`sync_seconds`).
        publish_seconds, apply_seconds: the two parts.
        servable_seconds: from the start until requests could name the new version (adapter mode:
            publish + load, before retiring old versions); None where the mode does not say.
        transport: how the version reached the engines (adapter mode: `sync.transport` as chosen,
            metrics key `sync_transport`); None for the modes that reload weights from disk.
        bytes: bytes published (`sync_bytes`).
        engine_adapters_loaded: graft adapters the engine lists after the sync.
        unload_failures: best-effort unloads that failed in this sync.
    """

    mode: str
    version: int
    adapter: str | None
    seconds: float
    publish_seconds: float
    apply_seconds: float
    bytes: int
    engine_adapters_loaded: int
    unload_failures: int
    servable_seconds: float | None = None
    transport: str | None = None
