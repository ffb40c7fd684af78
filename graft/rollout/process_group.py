"""Process groups of the servers graft launches, read from /proc: members, CPU seconds, memory,
liveness, and signalling that survives pid reuse (see `VllmServer._signal_group`).

A launched server leads its own process group (`start_new_session=True`), so its group id is the
leader's pid, and every process of one launch carries that launch's `SERVER_ID_ENV` token.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

# A token unique to one launch, in every process of that server.
SERVER_ID_ENV = "GRAFT_SERVER_ID"
# The launching process's pid; the server's watchdog (graft.rollout.vllm.server.entry, and the SGLang
# server's sitecustomize) stops the server once it is gone. Here, not in graft.rollout.launcher, so
# that the watchdog's server imports no launcher.
OWNER_ENV = "GRAFT_OWNER_PID"

# /proc/<pid>/stat fields after the command name: utime is field 14 (index 11 here), rss (pages) 24 (21).
_RSS_FIELD = 21


def group_members(pgid: int) -> Iterator[tuple[int, list[str]]]:
    """(pid, the /proc/<pid>/stat fields after the command name: state, ppid, pgrp, ..., utime at
    11, stime at 12) of every process now in process group `pgid`."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # the process exited while we looked
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid:
            yield int(entry.name), fields


def group_stats(pgid: int) -> Iterator[list[str]]:
    """The stat fields (see `group_members`) of every process now in process group `pgid`."""
    return (fields for _, fields in group_members(pgid))


def group_cpu_seconds(pgid: int) -> float:
    """CPU seconds (user + system) used so far by the live processes of process group `pgid`."""
    total_ticks = sum(int(fields[11]) + int(fields[12]) for fields in group_stats(pgid))
    return total_ticks / os.sysconf("SC_CLK_TCK")


def group_rss_bytes(pgid: int) -> int:
    """Resident memory of the live processes of process group `pgid` (a server and its engine
    processes), in bytes."""
    return sum(int(fields[_RSS_FIELD]) for fields in group_stats(pgid)) * os.sysconf("SC_PAGE_SIZE")


def group_alive(pgid: int) -> bool:
    """True while a live (non-zombie) process is in process group `pgid`.

    Zombies are skipped: an orphaned engine core that exited is a zombie until its new parent
    reaps it, which a container's init may never do.
    """
    if not os.path.isdir("/proc"):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    return any(fields[0] != "Z" for fields in group_stats(pgid))


def members_carrying(pgid: int, server_id: str) -> list[int]:
    """The live processes of group `pgid` whose environment holds `SERVER_ID_ENV=server_id`."""
    marker = f"{SERVER_ID_ENV}={server_id}".encode()
    pids = []
    for pid, fields in group_members(pgid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # exited, or not ours to read
            continue
        if fields[0] != "Z" and marker in environ:
            pids.append(pid)
    return pids


def send_to_group(sig: signal.Signals, pgid: int, members: list[int] | None) -> None:
    """`sig` to the whole group `pgid` (`members` None) or to each of `members`; gone ones skipped."""
    for kill, target in ([(os.killpg, pgid)] if members is None else [(os.kill, pid) for pid in members]):
        try:
            kill(target, sig)
        except ProcessLookupError:
            pass
