"""Rollout engines: launching inference servers and generating completions from them."""

from graft.rollout.vllm.launcher import VllmServer, VllmServerConfig, VllmStartupError

__all__ = ["VllmServer", "VllmServerConfig", "VllmStartupError"]
