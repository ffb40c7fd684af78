"""The engine(s) a run talks to, built from the `rollout:` config section.

`rollout.engine` picks the backend by name; `rollout.urls` connects to servers the user runs (one
client each, pooled when there are several, with failover down to `rollout.min_engines`); with no
URLs and `rollout.launch: true`, graft starts and owns one vLLM server, logging to RUN_DIR/logs,
and always stops it on the way out. Every client gets the run's timeouts and API key.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from graft.config import ConfigError, GraftConfig, RolloutConfig
from graft.rollout.engine import RolloutEngine
from graft.rollout.pool import EnginePool
from graft.rollout.reference import ReferenceEngine
from graft.rollout.sglang_client import SglangClient
from graft.rollout.vllm_client import VllmClient
from graft.rollout.vllm_launcher import VllmServer, VllmServerConfig

# Backends reachable by URL, by `rollout.engine` name; each takes (url, *, request_timeout_s,
# control_timeout_s, api_key).
HTTP_CLIENTS: dict[str, Callable[..., RolloutEngine]] = {"vllm": VllmClient, "sglang": SglangClient}


def resolve_api_key(rollout: RolloutConfig) -> str | None:
    """The servers' API key: `rollout.api_key`, else the environment variable `rollout.api_key_env`
    names (unset or empty: no key).

    Raises:
        ConfigError: `rollout.api_key_env` was set explicitly to a variable that is not set, which
            would otherwise surface later as the server's "Unauthorized".
    """
    if rollout.api_key is not None:
        return rollout.api_key.get_secret_value() or None
    if rollout.api_key_env is None:
        return None
    key = os.environ.get(rollout.api_key_env)
    if key is None and "api_key_env" in rollout.model_fields_set:
        raise ConfigError(f"rollout.api_key_env names the environment variable {rollout.api_key_env}, which is "
                          "not set", keys=("rollout.api_key_env",))
    return key or None


@contextlib.asynccontextmanager
async def open_engine(config: GraftConfig, run_dir: str | Path) -> AsyncIterator[RolloutEngine]:
    """Yield the run's engine: one client, a pool of clients, or the in-process reference engine.

    The config has already ruled out engines graft cannot reach (`GraftConfig` validators).

    Raises:
        ConfigError: no model.path where graft must load or serve the model itself; an API-key
            variable named in the config is not set.
    """
    rollout = config.rollout
    if rollout.engine == "reference":
        yield ReferenceEngine(config.require_model_path("load the model"), dtype=config.model.dtype)
        return
    api_key = resolve_api_key(rollout)
    async with contextlib.AsyncExitStack() as stack:
        urls = list(rollout.urls)
        if not urls:
            server = VllmServer(VllmServerConfig(
                model=config.require_model_path("launch vLLM"), dtype="float32" if config.model.dtype == "float32" else "bfloat16",
                max_lora_rank=rollout.max_lora_rank, max_loras=rollout.max_loras, log_dir=Path(run_dir) / "logs"))
            await asyncio.to_thread(server.start)
            stack.callback(server.stop)
            urls = [server.url]
        clients = [HTTP_CLIENTS[rollout.engine](url, request_timeout_s=rollout.request_timeout_s,
                                                control_timeout_s=rollout.control_timeout_s, api_key=api_key)
                   for url in urls]
        for client in clients:
            stack.push_async_callback(client.aclose)
        yield clients[0] if len(clients) == 1 else EnginePool(clients, min_engines=rollout.min_engines,
                                                              probe_after_s=rollout.control_timeout_s)
