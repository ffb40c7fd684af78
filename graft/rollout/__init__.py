"""Rollout engines: launching inference servers and generating completions from them."""

from graft.rollout.launcher import ServerStartupError
from graft.rollout.vllm.launcher import VllmServer, VllmServerConfig

__all__ = ["ServerStartupError", "VllmServer", "VllmServerConfig"]
