"""The engine(s) a run talks to, built from the `rollout:` config section.

`rollout.engine` picks the backend by name; `rollout.urls` connects to servers the user runs (one
client each, pooled when there are several, with failover down to `rollout.min_engines`); with no
URLs and `rollout.launch: true`, graft starts and owns one server of `rollout.engine` (vLLM, or
SGLang from its own virtualenv: see docs/sglang-cpu.md), logging to RUN_DIR/logs, and always stops
it on the way out. Every client gets the run's timeouts and API key.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx

from graft.config import GraftConfig
from graft.models.loading import checkpoint_parameters, require_model_dir
from graft.rollout.api_key import resolve_api_key
from graft.rollout.engine import BadRequestError, EngineUnavailableError, EngineUnreachableError, RolloutEngine
from graft.rollout.launcher import ServerProcess
from graft.rollout.pool import EnginePool
from graft.rollout.reference import ReferenceEngine
from graft.rollout.sglang.client import SglangClient
from graft.rollout.sglang.launcher import SglangServer, SglangServerConfig, sglang_missing
from graft.rollout.vllm.client import VllmClient
from graft.rollout.vllm.launcher import VllmServer, VllmServerConfig

# Backends reachable by URL, by `rollout.engine` name; each takes (url, *, request_timeout_s,
# control_timeout_s, api_key).
HTTP_CLIENTS: dict[str, Callable[..., RolloutEngine]] = {"vllm": VllmClient, "sglang": SglangClient}
# How long a server that stopped answering gets to finish exiting before we say whether it died.
_EXIT_GRACE_S = 5.0
_RESUME = "`graft train ... --resume` (same config and --run-dir)"


def launch_config(config: GraftConfig, run_dir: str | Path, syncs: bool = True) -> VllmServerConfig:
    """The vLLM server graft launches for a run.

    vLLM gets the model's local directory (a hub id resolved in the local Hugging Face cache), checked
    to be a model directory before anything starts. The dev endpoints are on only for a run that
    `syncs` with a mode that reloads weights through them: vLLM never authenticates them; such a run
    serves no adapter, so its server has no LoRA.

    Raises:
        ConfigError: model.path is unset.
        ValueError: model.path is not a model directory or a cached hub id.
    """
    rollout = config.rollout
    model_dir = require_model_dir(config.require_model_path("launch vLLM"))
    return VllmServerConfig(
        model=str(model_dir), cpu_reserved_cores=rollout.resolved_cpu_reserved_cores(checkpoint_parameters(model_dir)),
        dtype="float32" if config.model.dtype == "float32" else "bfloat16",
        max_lora_rank=rollout.max_lora_rank, max_loras=rollout.max_loras, max_model_len=rollout.max_model_len,
        tensor_parallel_size=rollout.tensor_parallel_size, gpu_memory_utilization=_gpu_share(rollout),
        dev_endpoints=syncs and config.sync.reloads_weights, log_dir=Path(run_dir) / "logs",
        # A run that pushes merged weights serves no adapter: no LoRA slots. vLLM 0.20 cannot reload
        # weights into a model whose layers LoRA wrapped (KeyError on `...gate_up_proj.weight`).
        enable_lora=not (syncs and config.sync.reloads_weights))


def _gpu_share(rollout) -> float | None:
    """`rollout.gpu_memory_utilization` resolved: 'auto' = 90% of the GPU's free memory now, as a
    fraction of the whole (the trainer's model is already there); None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    if rollout.gpu_memory_utilization != "auto":
        return rollout.gpu_memory_utilization
    free_bytes, total_bytes = torch.cuda.mem_get_info()
    return round(0.9 * free_bytes / total_bytes, 2)


async def require_weight_reload(urls: list[str]) -> None:
    """Check that the vLLM servers at `urls` serve the weight-reload (dev) endpoints.

    Without them merged sync's first reload would fail mid-run on a bare 404 "Not Found"; asked
    once here instead (`GET /is_paused` exists exactly when they do). Unreachable servers are
    skipped: the engine reports those itself.

    Raises:
        BadRequestError: a server answers 404.
    """
    async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
        for url in urls:
            try:
                response = await http.get(url.rstrip("/") + "/is_paused")
            except httpx.HTTPError:
                continue
            if response.status_code == 404:
                raise BadRequestError(
                    "sync.mode 'merged' reloads weights through vLLM's dev endpoints (/pause, /collective_rpc, "
                    "/reset_prefix_cache, /resume), which this server does not serve (GET /is_paused: 404): start "
                    "it with `graft serve --weight-reload` (or VLLM_SERVER_DEV_MODE=1), or use sync.mode adapter",
                    address=url.rstrip("/"), status=404)


def launched_server(config: GraftConfig, run_dir: str | Path, syncs: bool = True) -> ServerProcess:
    """The server graft launches for a run of `rollout.engine` (not started yet).

    SGLang gets the same model directory, dtype, adapter limits and context length as vLLM would;
    it needs no opt-in for weight reloads (`/update_weights_from_disk` is always served).
    """
    vllm = launch_config(config, run_dir, syncs)
    if config.rollout.engine != "sglang":
        return VllmServer(vllm)
    if (missing := sglang_missing()) is not None:  # one line, before "starting a sglang server" is said
        raise FileNotFoundError(missing)
    return SglangServer(SglangServerConfig(model=vllm.model, dtype=vllm.dtype, max_lora_rank=vllm.max_lora_rank,
                                           max_loras=vllm.max_loras, context_length=vllm.max_model_len,
                                           log_dir=vllm.log_dir))


@contextlib.asynccontextmanager
async def open_engine(config: GraftConfig, run_dir: str | Path, *,
                      syncs: bool = True) -> AsyncIterator[RolloutEngine]:
    """Yield the run's engine: one client, a pool of clients, or the in-process reference engine.

    The config has already ruled out engines graft cannot reach (`GraftConfig` validators).
    `syncs`: the caller pushes policy versions the `sync.mode` way (training); False for a caller
    that only generates and loads adapters (evaluation), which then needs no weight-reload endpoints.

    Raises:
        ConfigError: no model.path where graft must load or serve the model itself; an API-key
            variable named in the config is not set.
        ValueError: model.path is not a model directory (before any server starts).
        BadRequestError: merged sync with a vLLM server at rollout.urls that cannot reload weights.
        EngineUnavailableError: from the body; when the server graft launched has died, one that
            says so, names its log and how to resume.
    """
    rollout = config.rollout
    if rollout.engine == "reference":
        yield ReferenceEngine(config.require_model_path("load the model"), dtype=config.model.dtype,
                              device=rollout.reference_device)
        return
    api_key = resolve_api_key(rollout)
    async with contextlib.AsyncExitStack() as stack:
        urls, server = list(rollout.urls), None
        if not urls:
            server = launched_server(config, run_dir, syncs)
            # Told, not silent: on 2 idle CPU cores vLLM answers after 12.5 s (SmolLM2), SGLang after a minute
            # or more; longer under load or for a larger model.
            took = "~15-40 s" if rollout.engine == "vllm" else "a minute or so"
            print(f"graft: starting a {rollout.engine} server for {config.model.path} (its log in "
                  f"{server.config.log_dir}); it takes {took} on CPU cores", file=sys.stderr, flush=True)
            try:
                await asyncio.to_thread(server.start)
            except BaseException:  # cancelled by Ctrl-C / SIGTERM: the starting thread stops the server
                server.abandon_start()
                raise
            stack.callback(server.stop)
            urls = [server.url]
        elif syncs and rollout.engine == "vllm" and config.sync.reloads_weights:
            await require_weight_reload(urls)
        clients = [HTTP_CLIENTS[rollout.engine](url, request_timeout_s=rollout.request_timeout_s,
                                                control_timeout_s=rollout.control_timeout_s, api_key=api_key)
                   for url in urls]
        for client in clients:
            stack.push_async_callback(client.aclose)
        try:
            yield clients[0] if len(clients) == 1 else EnginePool(clients, min_engines=rollout.min_engines,
                                                                  probe_after_s=rollout.control_timeout_s)
        except EngineUnavailableError as error:
            if server is None and isinstance(error, EngineUnreachableError):  # a server the user runs
                detail = str(error).removeprefix(f"{error.address}: ")
                raise EngineUnreachableError(
                    f"the server is gone: nothing answers any more ({detail}); once it serves again, a training run "
                    f"continues from its newest checkpoint with {_RESUME}", address=error.address) from error
            code = None if server is None else await asyncio.to_thread(server.exit_code, _EXIT_GRACE_S)
            if code is None:
                raise
            raise EngineUnavailableError(server.exit_report(code, then=f"; a training run continues from its newest "
                                                                       f"checkpoint with {_RESUME}"),
                                         address=server.url) from error
