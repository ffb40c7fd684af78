"""DAPO's dynamic sampling: groups without a learning signal are dropped and refilled with the same
policy version, within the round cap; overlong shaping reaches the rewards."""

import asyncio

import pytest
import torch

from graft.train.dynamic_sampling import sample_informative_groups, select_groups
from graft.train.rollout_batch import RolloutBatch, with_overlong_penalty

G = 2


def _round_batch(round_: int, rewards_PG: list[list[float]], version: int = 3) -> RolloutBatch:
    """A round whose group p is tagged (round, p) in its token ids, so picks can be traced."""
    sequences = [([round_, p], [100 + g]) for p in range(len(rewards_PG)) for g in range(G)]
    return RolloutBatch(sequences, [[-0.5]] * len(sequences), torch.tensor(rewards_PG), version, seconds=1.0,
                        truncated=tuple(g == 1 for _ in rewards_PG for g in range(G)),
                        reward_metrics={"round": round_})


def _sampler(rounds: list[list[list[float]]], calls: list[int]):
    async def sample_round(round_: int) -> RolloutBatch:
        calls.append(round_)
        return _round_batch(round_, rounds[round_])
    return sample_round


def _picked(batch: RolloutBatch) -> list[tuple[int, int]]:
    return [tuple(batch.sequences[p * G][0]) for p in range(len(batch.rewards_PG))]


def test_groups_without_signal_are_replaced_by_refills_in_sampling_order():
    rounds = [[[1, 1], [0, 1], [0, 0]], [[1, 0], [1, 1], [0, 0]], [[0, 1], [1, 0], [1, 0]]]
    calls = []
    batch = asyncio.run(sample_informative_groups(_sampler(rounds, calls), batch_prompts=3, max_rounds=5))
    assert calls == [0, 1, 2]  # stops as soon as 3 groups with a signal are found
    assert _picked(batch) == [(0, 1), (1, 0), (2, 0)]
    assert batch.rewards_PG.tolist() == [[0, 1], [1, 0], [0, 1]]
    assert batch.reward_metrics == {"round": 0, "sampling_rounds": 3, "informative_groups": 3, "filtered_groups": 4}
    assert batch.version == 3 and batch.seconds == 3.0 and batch.truncated == (False, True) * 3


def test_when_the_rounds_run_out_the_batch_is_filled_with_groups_without_signal():
    rounds = [[[1, 1], [0, 1], [0, 0]], [[1, 1], [0, 0], [1, 1]]]
    calls = []
    batch = asyncio.run(sample_informative_groups(_sampler(rounds, calls), batch_prompts=3, max_rounds=2))
    assert calls == [0, 1]
    assert _picked(batch) == [(0, 1), (0, 0), (0, 2)]  # the signal first, then the earliest dropped
    assert batch.reward_metrics["informative_groups"] == 1 and batch.reward_metrics["sampling_rounds"] == 2


def test_a_first_round_with_signal_everywhere_samples_once():
    calls = []
    batch = asyncio.run(sample_informative_groups(_sampler([[[0, 1], [1, 0]]], calls), batch_prompts=2, max_rounds=3))
    assert calls == [0] and _picked(batch) == [(0, 0), (0, 1)]
    assert batch.reward_metrics["filtered_groups"] == 0


def test_one_batch_is_one_policy_version():
    with pytest.raises(AssertionError, match="one policy version"):
        select_groups([_round_batch(0, [[0, 1]], version=1), _round_batch(1, [[0, 1]], version=2)], [(0, 0), (1, 0)])


def test_overlong_penalty_shapes_the_rewards_by_length():
    sequences = [([1], [5] * n) for n in (4, 13, 16, 10)]
    batch = RolloutBatch(sequences, [[0.0] * len(c) for _, c in sequences], torch.tensor([[1.0, 1.0], [0.0, 0.0]]),
                         version=0, seconds=0.0)
    shaped = with_overlong_penalty(batch, max_tokens=16, buffer_tokens=4, penalty=0.5)
    assert shaped.rewards_PG.flatten().tolist() == pytest.approx([1.0, 1.0 - 0.5 * 1 / 4, -0.5, 0.0])
    assert shaped.reward_metrics["overlong_penalty_mean"] == pytest.approx(-(0.125 + 0.5) / 4)
    assert with_overlong_penalty(batch, 16, None, 1.0) is batch
