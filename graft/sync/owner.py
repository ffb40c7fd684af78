"""Who uses a `lora.name` on a shared server now: the live run whose publish root holds the adapters.

A policy version's engine name is `<lora.name>-v<N>` (`adapter_name`): `lora.name` is the run's
identity on the server, and two live runs must not share it. Before its first sync a run unloads
the `<lora.name>-v*` adapters it did not load (`earlier_runs_adapters`): what a killed or failed
run with the same `lora.name` left on a server the user runs, which would otherwise make this
run's load of the same version fail with "has already been loaded".

A run's adapters are loaded from its publish root (RUN_DIR/weights, or SYNC_DIR/<lora.name>). The
run holds an exclusive flock on `<publish root>/.owner` while it syncs; the kernel drops it when the
run ends in any way (SIGKILL included), so the lock is a lease that never needs renewing or
clearing by hand. Before a run unloads `<lora.name>-v*` adapters it did not load (an ended run's
leftovers), it asks the server where each came from (vLLM's /v1/models names
the path) and checks that root's lock: held means a live run uses this `lora.name` on this server,
and unloading its adapters would break it mid-run, so this run refuses to start instead. A path
this machine cannot open (the other run on another host, without a shared filesystem) cannot be
checked and counts as left over, as before.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path
from typing import TextIO

from graft.rollout.engine import EngineError, RolloutEngine
from graft.rollout.pool import EnginePool, engine_address

OWNER_FILE = ".owner"


class LoraNameInUseError(ValueError):
    """Another live run loads adapters under this `lora.name` (or publishes into this root)."""


class LockHeldError(RuntimeError):
    """Another live process holds the lock; the message is who (what it wrote in the file)."""


def adapter_name(lora_name: str, version: int) -> str:
    """The engine's name of policy `version`: `<lora_name>-v<version>`. The one place names are made."""
    return f"{lora_name}-v{version}"


def adapter_version(lora_name: str, name: str) -> int | None:
    """The version in `name` if `adapter_name(lora_name, version)` made it, else None."""
    digits = name.removeprefix(f"{lora_name}-v")
    if digits == name or not digits.isascii() or not digits.isdigit() or str(int(digits)) != digits:
        return None
    return int(digits)


def hold_lock(path: Path) -> TextIO:
    """Take an exclusive flock on `path` (created if missing) without waiting, and write in it who
    holds it ("pid N on HOST"). The lock lasts while the returned file is open; the kernel drops it
    when its process ends in any way (SIGKILL included), so no stale lock is ever left to clear.

    Raises:
        LockHeldError: another live process holds it (the message: what that process wrote).
    """
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "pid unknown"
        handle.close()
        raise LockHeldError(holder) from None
    handle.truncate(0)
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    handle.flush()
    return handle


class PublishRootLease:
    """This run's hold on its publish root: `claim()` at the first sync, `release()` at close.

    Raises (claim):
        LoraNameInUseError: a live process holds the root (two runs sharing `sync.dir` and `lora.name`).
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._handle = None

    def claim(self) -> None:
        if self._handle is not None:
            return
        try:
            self._handle = hold_lock(self.root / OWNER_FILE)
        except LockHeldError as held:
            raise LoraNameInUseError(f"{self.root} is in use by a live run ({held}): give this run another "
                                     f"lora.name or sync.dir") from None

    def release(self) -> None:
        if self._handle is not None:
            self._handle.close()  # closing the last descriptor drops the flock
            self._handle = None


def live_owner(adapter_path: str | os.PathLike) -> str | None:
    """Who holds the publish root `adapter_path` lies in ("pid N on HOST"), if a live process does;
    None when nobody does or the root cannot be opened from here."""
    try:
        handle = open(Path(adapter_path).parent / OWNER_FILE)
    except OSError:
        return None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return handle.read().strip() or "pid unknown"
        return None  # closing the handle drops the shared lock taken just now


async def listed_adapters(engine: RolloutEngine, lora_name: str) -> list[str]:
    """`<lora_name>-v*` adapters the engine(s) list, oldest version first (a pool: on any member, not
    only those on all of them)."""
    if isinstance(engine, EnginePool):
        names = set().union(*(await engine.adapters_by_engine()).values())
    else:
        names = set(await engine.list_adapters())
    return sorted((n for n in names if adapter_version(lora_name, n) is not None),
                  key=lambda n: adapter_version(lora_name, n))


async def earlier_runs_adapters(engine: RolloutEngine, lora_name: str, root: Path) -> list[str]:
    """The `<lora_name>-v*` adapters on the engine(s) before this run's first sync (this run, publishing
    into `root`, has loaded none yet), for it to unload (module docstring).

    Raises:
        LoraNameInUseError: a live run loaded one of them (its publish root's lock is held).
    """
    names = await listed_adapters(engine, lora_name)
    for name, path in (await _adapter_paths(engine)).items() if names else ():
        if name in names and Path(path).parent != root and (holder := live_owner(path)):
            raise LoraNameInUseError(
                f"lora.name {lora_name!r} is in use on {engine_address(engine)} by a live run ({holder}; its "
                f"adapters are in {Path(path).parent}): give this run another lora.name")
    return names


async def _adapter_paths(engine: RolloutEngine) -> dict[str, str]:
    """Adapter name -> the path an engine loaded it from, where engines say (vLLM); else empty."""
    engines = engine.engines if isinstance(engine, EnginePool) else [engine]
    paths: dict[str, str] = {}
    for member in engines:
        if hasattr(member, "adapter_paths"):
            try:
                paths.update(await member.adapter_paths())
            except EngineError:  # a dead pool member holds nobody's adapters
                continue
    return paths
