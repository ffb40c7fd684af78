"""Group-relative advantages (GRPO).

Shape suffixes: see graft/__init__.py.
"""

from typing import Literal

from torch import Tensor

# Bessel correction of each std estimator: the sum of squared deviations is divided by G - correction.
STD_CORRECTIONS = {"population": 0, "sample": 1}
StdEstimator = Literal["population", "sample"]
# The baseline subtracted from each reward, as a multiple of (r - group mean): "mean" (GRPO) takes
# the group mean including the reward itself; "leave-one-out" (RLOO, Ahmadian et al. 2024) the mean
# of the other G - 1 rewards, r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean_j r_j), which
# keeps the baseline independent of the sample it scores (an unbiased policy gradient).
BASELINES = ("mean", "leave-one-out")
Baseline = Literal["mean", "leave-one-out"]


def group_advantages(rewards_PG: Tensor, normalize_std: bool = True, eps: float = 1e-6,
                     std: StdEstimator = "population", baseline: Baseline = "mean") -> Tensor:
    """GRPO advantages: each reward minus its group's mean, optionally over the group's std.

    ``A[p, g] = (r[p, g] - mean_g r[p]) / (std_g r[p] + eps)``. The population std (over G) gives
    every group's advantages unit RMS whatever G, so the policy term weighs the same against the KL
    and entropy terms at any group size; the sample std (over G - 1, what TRL and verl use) makes
    them ``sqrt((G-1)/G)`` as large. A group whose rewards are all equal carries no learning signal
    and gets exact zeros (never NaN, never rounding noise divided by ``eps``; a group of one too).

    Args:
        rewards_PG: Rewards, one row per prompt, one column per sampled completion.
        normalize_std: Divide by the group std (GRPO); False gives the plain centred reward
            (Dr. GRPO).
        eps: Added to the std before dividing.
        std: The std estimator, a name in ``STD_CORRECTIONS``.
        baseline: A name in ``BASELINES``; "leave-one-out" scales the centred reward by G / (G - 1)
            (before any std division).

    Returns:
        ``adv_PG``, float32 (or the input's floating dtype), same shape as ``rewards_PG``.

    Raises:
        ValueError: If ``rewards_PG`` is not 2-D, ``std`` is not a name in ``STD_CORRECTIONS`` or
            ``baseline`` not one in ``BASELINES``.
    """
    if rewards_PG.dim() != 2:
        raise ValueError(f"rewards_PG must be 2-D [prompts, group], got shape {tuple(rewards_PG.shape)}")
    if std not in STD_CORRECTIONS:
        raise ValueError(f"unknown std estimator {std!r}; known: {sorted(STD_CORRECTIONS)}")
    if baseline not in BASELINES:
        raise ValueError(f"unknown advantage baseline {baseline!r}; known: {list(BASELINES)}")
    rewards_PG = rewards_PG if rewards_PG.is_floating_point() else rewards_PG.float()
    adv_PG = rewards_PG - rewards_PG.mean(dim=1, keepdim=True)
    group = rewards_PG.shape[1]
    if baseline == "leave-one-out" and group > 1:
        adv_PG = adv_PG * (group / (group - 1))
    if normalize_std:
        adv_PG = adv_PG / (rewards_PG.std(dim=1, keepdim=True, correction=STD_CORRECTIONS[std]) + eps)
    # The mean of equal floats need not round back to them exactly; zero such groups explicitly.
    return adv_PG.masked_fill(~informative_groups(rewards_PG).unsqueeze(1), 0.0)


def informative_groups(rewards_PG: Tensor) -> Tensor:
    """``[P]`` bool: the groups whose rewards are not all equal. The others get zero advantages and
    teach nothing (DAPO's dynamic sampling drops and replaces them)."""
    return rewards_PG.amax(dim=1) != rewards_PG.amin(dim=1)
