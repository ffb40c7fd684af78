"""The learning-rate schedule (`train.lr_schedule`): the rate of each optimizer step, apart from the
optimizer and the policy that step it (graft.train.policy), as torchtitan, prime-rl and
tinker-cookbook keep theirs."""

from __future__ import annotations

import math

from graft.config import GraftConfig


def learning_rate(config: GraftConfig, step: int) -> float:
    """The learning rate of optimizer step `step` (from 1): `train.lr` x step / `train.warmup_steps`
    during the warmup, then `train.lr_schedule`'s decay to `train.min_lr_ratio` x `train.lr`. The decay
    is Hugging Face's `get_scheduler` (linear, cosine, cosine_with_min_lr) at its step `step - 1`, so a
    run set as a TRL one learns at the same rates (tests/train/test_lr_schedule.py holds them side by
    side); the last step's rate is above the floor, as there: no step is taken at a rate of 0."""
    train = config.train
    if step <= train.warmup_steps:
        return train.lr * step / train.warmup_steps
    progress = (step - 1 - train.warmup_steps) / max(1, train.steps - train.warmup_steps)
    decayed = {"constant": 1.0, "linear": 1.0 - progress, "cosine": 0.5 * (1.0 + math.cos(math.pi * progress))}
    floor = train.min_lr_ratio
    return train.lr * (floor + (1.0 - floor) * max(0.0, decayed[train.lr_schedule]))
