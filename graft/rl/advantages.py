"""Group-relative advantages (GRPO).

Shape suffixes: ``_P`` prompts, ``_G`` completions per prompt (the group).
"""

from torch import Tensor


def group_advantages(rewards_PG: Tensor, normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO advantages: each reward minus its group's mean, optionally over the group's std.

    ``A[p, g] = (r[p, g] - mean_g r[p]) / (std_g r[p] + eps)`` with the population std
    (``correction=0``, so a group of one is defined). A group whose rewards are all equal carries
    no learning signal and gets exact zeros (never NaN, never rounding noise divided by ``eps``).

    Args:
        rewards_PG: Rewards, one row per prompt, one column per sampled completion.
        normalize_std: Divide by the group std (GRPO); False gives the plain centred reward
            (Dr. GRPO).
        eps: Added to the std before dividing.

    Returns:
        ``adv_PG``, float32 (or the input's floating dtype), same shape as ``rewards_PG``.

    Raises:
        ValueError: If ``rewards_PG`` is not 2-D.
    """
    if rewards_PG.dim() != 2:
        raise ValueError(f"rewards_PG must be 2-D [prompts, group], got shape {tuple(rewards_PG.shape)}")
    rewards_PG = rewards_PG if rewards_PG.is_floating_point() else rewards_PG.float()
    adv_PG = rewards_PG - rewards_PG.mean(dim=1, keepdim=True)
    if normalize_std:
        adv_PG = adv_PG / (rewards_PG.std(dim=1, keepdim=True, correction=0) + eps)
    # The mean of equal floats need not round back to them exactly; zero such groups explicitly.
    constant_P1 = rewards_PG.amax(dim=1, keepdim=True) == rewards_PG.amin(dim=1, keepdim=True)
    return adv_PG.masked_fill(constant_P1, 0.0)
