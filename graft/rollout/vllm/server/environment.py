"""The environment variables the vLLM server process reads from the launcher that started it
(graft.rollout.vllm.launcher sets them). They live here, on the server's side, so that the server
imports no launcher: graft.rollout.vllm.launcher pulls in graft.config and pydantic, which put 28
graft modules into every server process where 16 do (measured in a real server's log:
`graft modules loaded`, tests/rollout/vllm/server/test_entry.py)."""

# vLLM-CPU only (`VllmServerConfig.lora_ops`). "grouped": the server's LoRA matmuls one per adapter
# (graft.rollout.vllm.server.lora_cpu); "vllm": vLLM's own.
LORA_OPS_ENV = "GRAFT_VLLM_LORA_OPS"
