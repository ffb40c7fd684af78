"""Runs inside the vLLM server process, not in the trainer: the entry point graft launches vLLM
through (`python -m graft.rollout.vllm.server.entry`), the routes and CPU ops it installs there."""
