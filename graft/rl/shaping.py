"""Reward shaping before advantages: DAPO's soft overlong punishment and the KL penalty in the reward.

Both change a completion's scalar reward, not the loss: they act through the group advantages like
the task's reward does. Shape suffixes: see graft/__init__.py.
"""

import torch
from torch import Tensor

from graft.rl.kl import get_kl_estimator


def soft_overlong_penalty(lengths_B: Tensor, max_tokens: int, buffer_tokens: int, penalty: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), a reward term ``<= 0`` per completion.

    0 up to ``max_tokens - buffer_tokens`` tokens, then ``-penalty * excess / buffer_tokens``,
    reaching ``-penalty`` at ``max_tokens`` and staying there beyond (verl's DAPO reward manager
    ``min(-exceed / buffer * factor, 0)``; TRL's ``get_soft_overlong_punishment`` gives -1 past the
    maximum). Long answers are discouraged gradually, before the hard cut truncates them.

    Raises:
        ValueError: If ``buffer_tokens`` is not in ``[1, max_tokens)``.
    """
    if not 1 <= buffer_tokens < max_tokens:
        raise ValueError(f"buffer_tokens must be in [1, max_tokens={max_tokens}), got {buffer_tokens}")
    excess_B = (lengths_B.to(torch.float32) - (max_tokens - buffer_tokens)).clamp(0.0, float(buffer_tokens))
    return -penalty * excess_B / buffer_tokens


def sequence_kl(logprobs_BT: Tensor, ref_logprobs_BT: Tensor, mask_BT: Tensor, estimator: str = "k1") -> Tensor:
    """Each completion's KL estimate to the reference, ``kl_B = sum_t kl_t`` over its valid tokens.

    For the KL penalty in the reward (``r - beta * kl_B``, as PPO-RLHF and verl's
    ``use_kl_in_reward``, whose per-token penalties sum into GRPO's outcome score). ``logprobs_BT``
    are the sampling policy's, so the estimate is the KL of what was actually sampled.

    Raises:
        ValueError: If ``estimator`` is not a registered KL estimator.
    """
    kl_BT = get_kl_estimator(estimator)(logprobs_BT, ref_logprobs_BT)
    return torch.where(mask_BT, kl_BT, 0.0).sum(dim=-1)
