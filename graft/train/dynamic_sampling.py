"""DAPO's dynamic sampling (`train.filter_groups`): a step's batch made only of prompt groups with a
learning signal, as far as `train.max_sampling_rounds` rollouts allow.

A group whose rewards are all equal (every sample right, or every one wrong) has zero advantages:
it costs an update's compute and teaches nothing, and as the policy improves more groups are like
that, so the effective batch shrinks (Yu et al. 2025, section 3.2). Dropping such groups and
sampling more prompts with the same policy version keeps the batch full of signal. The refill
prompts and seeds of round k are a pure function of (seed, step, k) (`graft.train.step_plan`), so a
resumed run samples what the uninterrupted one did. Filtered on the task reward, before shaping
(verl's `filter_groups.metric` acc/score).

Shape suffixes: see graft/__init__.py.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace

import torch

from graft.rl.advantages import informative_groups
from graft.train.rollout_batch import RolloutBatch

# round -> the batch of that round's prompts (round 0: the step's own prompts).
RoundSampler = Callable[[int], Awaitable[RolloutBatch]]


async def sample_informative_groups(sample_round: RoundSampler, batch_prompts: int, max_rounds: int) -> RolloutBatch:
    """Rounds of `sample_round(0), sample_round(1), ...` until `batch_prompts` groups with unequal
    rewards are found or `max_rounds` were made; the batch is the first such groups, filled up with
    groups without signal when the rounds ran out (they then weigh in the update as without the
    filter). `reward_metrics` gains `sampling_rounds`, `informative_groups` (of the batch) and
    `filtered_groups` (dropped over all rounds)."""
    rounds: list[RolloutBatch] = []
    kept: list[tuple[int, int]] = []  # (round, prompt) of groups with a signal, in sampling order
    flat: list[tuple[int, int]] = []
    for round_ in range(max_rounds):
        batch = await sample_round(round_)
        rounds.append(batch)
        signal_P = informative_groups(batch.rewards_PG).tolist()
        kept += [(round_, p) for p, has in enumerate(signal_P) if has]
        flat += [(round_, p) for p, has in enumerate(signal_P) if not has]
        if len(kept) >= batch_prompts:
            break
    picks = kept[:batch_prompts] + flat[:max(0, batch_prompts - len(kept))]
    merged = select_groups(rounds, picks)
    return replace(merged, reward_metrics={**merged.reward_metrics, "sampling_rounds": len(rounds),
                                           "informative_groups": min(len(kept), batch_prompts),
                                           "filtered_groups": len(flat)})


def select_groups(batches: list[RolloutBatch], picks: list[tuple[int, int]]) -> RolloutBatch:
    """One batch of the groups `picks` ((batch index, prompt) pairs, in that order) of `batches`,
    which share a policy version; its seconds are all of theirs, its reward metrics the first's."""
    assert len({b.version for b in batches}) == 1, "one batch is one policy version"
    group = batches[0].rewards_PG.shape[1]
    sequences, logprobs, truncated, rewards_PG = [], [], [], []
    for b, p in picks:
        rows = range(p * group, (p + 1) * group)
        sequences += [batches[b].sequences[r] for r in rows]
        logprobs += [batches[b].engine_logprobs[r] for r in rows]
        truncated += [bool(batches[b].truncated) and batches[b].truncated[r] for r in rows]
        rewards_PG.append(batches[b].rewards_PG[p])
    multi_turn = batches[0].loss_masks is not None  # every round is built alike
    masks = [batches[b].loss_masks[r] for b, p in picks for r in range(p * group, (p + 1) * group)] if multi_turn \
        else None
    return RolloutBatch(sequences, logprobs, torch.stack(rewards_PG), batches[0].version,
                        sum(b.seconds for b in batches), tuple(truncated), dict(batches[0].reward_metrics),
                        loss_masks=masks, mask_truncated=batches[0].mask_truncated)
