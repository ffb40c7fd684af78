"""A pytest plugin (tests/conftest.py loads it) that fails every test during which a worker of an
inference server this test process launched died.

A vLLM worker that dies mid-run (seen: `Worker proc VllmWorker-0 died unexpectedly (exit code: -4)`,
a SIGILL) is said only in its server's log; a client hears `EngineDeadError`, or nothing at all when
the test's requests were already answered or its assertions do not look at the lost ones, so such a
death could pass unnoticed. Here `ServerProcess.start` reports each launch
(`LAUNCH_HOOKS`), and after each test's teardown the new bytes of every launched server's log are
read: a death line among them fails the test at teardown, naming the log and quoting the line.

Every launched server's log is read after every test, not only those of the test's own fixtures: a
server a test reaches through library code (a bench's, a module fixture's) is in no fixture of it,
and a death is blamed on the test that was running when it was written. Each log is read from where
the last check stopped, so a death is blamed once. Servers that `graft` subprocesses launch are
beyond reach.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from graft.rollout.launcher import LAUNCH_HOOKS, ServerProcess

# vLLM's words for a worker or engine process that exited on its own (vllm/v1/executor/multiproc_executor.py,
# vllm/v1/utils.py); not written when graft stops a server (its executor's monitor stands down once
# shutting down: none in the logs of the suite's stopped servers).
DEATH_MARK = b"died unexpectedly"
# graft's LoRA kernel's fault guard names a fatal fault's module, offset and bytes before it is handed on
# (graft/rollout/vllm/server/lora_guard.c): quoted beside the death it explains.
FAULT_MARK = b"graft: fatal "


class LogWatch:
    """The logs of the servers launched while it watches, each with how many of its bytes were read."""

    def __init__(self) -> None:
        self._read_bytes: dict[Path, int] = {}  # one entry per file: a server on a reused port appends to it

    def launched(self, server: ServerProcess) -> None:
        """Watch `server`'s log from its present end (a `LAUNCH_HOOKS` entry): what an earlier server
        on the same port wrote there is not this launch's."""
        try:
            self._read_bytes[server.log_path] = os.path.getsize(server.log_path)
        except FileNotFoundError:
            self._read_bytes[server.log_path] = 0

    def new_deaths(self) -> list[str]:
        """`<log path>: <line>` for each death line written since the last call, oldest first in each log.

        Only whole lines are read: a line still being written is read whole by the next call.
        """
        deaths = []
        for path, read_bytes in list(self._read_bytes.items()):  # a copy: a server thread may launch meanwhile
            try:
                if os.path.getsize(path) <= read_bytes:
                    continue
                with open(path, "rb") as log:
                    log.seek(read_bytes)
                    new = log.read()
            except FileNotFoundError:  # its test's temporary directory is gone
                continue
            whole = new[:new.rfind(b"\n") + 1]
            self._read_bytes[path] = read_bytes + len(whole)
            deaths += [f"{path}: {line.decode(errors='replace').strip()}"
                       for line in whole.splitlines() if DEATH_MARK in line or FAULT_MARK in line]
        return deaths


_WATCH = pytest.StashKey[LogWatch]()


def pytest_configure(config: pytest.Config) -> None:
    watch = config.stash[_WATCH] = LogWatch()
    LAUNCH_HOOKS.append(watch.launched)


def pytest_unconfigure(config: pytest.Config) -> None:
    LAUNCH_HOOKS.remove(config.stash[_WATCH].launched)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item):
    """After the test's fixtures are torn down (a module's or the session's server, stopped with its
    last test, included), fail it for every death written during its setup, call or teardown."""
    try:
        return (yield)
    finally:  # also after a failed teardown: the death is likely why, and must not go to the next test
        if deaths := item.config.stash[_WATCH].new_deaths():
            pytest.fail("a server's worker died during this test: " + "\n".join(deaths), pytrace=False)
