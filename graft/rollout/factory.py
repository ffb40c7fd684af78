"""The engine(s) a run talks to, built from the `rollout:` config section.

`rollout.engine` picks the backend by name; `rollout.urls` connects to servers the user runs (one
client each, pooled when there are several); with no URLs and `rollout.launch: true`, graft starts
and owns one vLLM server, logging to RUN_DIR/logs, and always stops it on the way out.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from graft.config import GraftConfig
from graft.rollout.engine import RolloutEngine
from graft.rollout.pool import EnginePool
from graft.rollout.reference import ReferenceEngine
from graft.rollout.sglang_client import SglangClient
from graft.rollout.vllm_client import VllmClient
from graft.rollout.vllm_launcher import VllmServer, VllmServerConfig

# Backends reachable by URL, by `rollout.engine` name.
HTTP_CLIENTS: dict[str, Callable[[str], RolloutEngine]] = {"vllm": VllmClient, "sglang": SglangClient}


@contextlib.asynccontextmanager
async def open_engine(config: GraftConfig, run_dir: str | Path) -> AsyncIterator[RolloutEngine]:
    """Yield the run's engine: one client, a pool of clients, or the in-process reference engine.

    The config has already ruled out engines graft cannot reach (`GraftConfig` validators).

    Raises:
        ConfigError: no model.path where graft must load or serve the model itself.
    """
    rollout = config.rollout
    if rollout.engine == "reference":
        yield ReferenceEngine(config.require_model_path("load the model"), dtype=config.model.dtype)
        return
    async with contextlib.AsyncExitStack() as stack:
        urls = list(rollout.urls)
        if not urls:
            server = VllmServer(VllmServerConfig(
                model=config.require_model_path("launch vLLM"), dtype="float32" if config.model.dtype == "float32" else "bfloat16",
                max_lora_rank=rollout.max_lora_rank, max_loras=rollout.max_loras, log_dir=Path(run_dir) / "logs"))
            await asyncio.to_thread(server.start)
            stack.callback(server.stop)
            urls = [server.url]
        clients = [HTTP_CLIENTS[rollout.engine](url) for url in urls]
        for client in clients:
            stack.push_async_callback(client.aclose)
        yield clients[0] if len(clients) == 1 else EnginePool(clients)
