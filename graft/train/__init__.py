"""The GRPO trainer: rollout from the engines, policy update of the LoRA adapter, sync, metrics."""
