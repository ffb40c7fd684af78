"""Who uses a `lora.name` on a shared server now: the live run whose publish root holds the adapters.

A run's adapters are loaded from its publish root (RUN_DIR/weights, or SYNC_DIR/<lora.name>). The
run holds an exclusive flock on `<publish root>/.owner` while it syncs; the kernel drops it when the
run ends in any way (SIGKILL included), so the lock is a lease that never needs renewing or
clearing by hand. Before a run unloads `<lora.name>-v*` adapters it did not load (an ended run's
leftovers, `graft.sync.adapter`), it asks the server where each came from (vLLM's /v1/models names
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

OWNER_FILE = ".owner"


class LoraNameInUseError(ValueError):
    """Another live run loads adapters under this `lora.name` (or publishes into this root)."""


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
        handle = open(self.root / OWNER_FILE, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "pid unknown"
            handle.close()
            raise LoraNameInUseError(f"{self.root} is in use by a live run ({holder}): give this run another "
                                     f"lora.name or sync.dir") from None
        handle.truncate(0)
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        handle.flush()
        self._handle = handle

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
