"""RL maths: group advantages, PPO/GRPO losses and sequence packing — plain functions on tensors."""
