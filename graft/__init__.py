"""graft: reinforcement-learning post-training of LLMs with a LoRA adapter on a frozen base model."""

__version__ = "0.1.0"
