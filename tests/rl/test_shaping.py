"""Reward shaping against its references written out: DAPO's soft overlong punishment (TRL's
`get_soft_overlong_punishment`, verl's DAPO reward manager) and the summed KL penalty of the reward."""

import pytest
import torch

from graft.rl.advantages import group_advantages, informative_groups
from graft.rl.kl import KL_ESTIMATORS
from graft.rl.shaping import sequence_kl, soft_overlong_penalty


def _trl_soft_overlong_punishment(length: int, max_completion_len: int, soft_punish_cache: int) -> float:
    # TRL 1.16 trl/rewards/other_rewards.py, _SoftOverlongPunishment.__call__, per completion.
    if length <= max_completion_len - soft_punish_cache:
        return 0.0
    if max_completion_len - soft_punish_cache < length <= max_completion_len:
        return (max_completion_len - soft_punish_cache - length) / soft_punish_cache
    return -1.0


def _verl_overlong_reward(length: int, max_resp_len: int, buffer_len: int, factor: float) -> float:
    # verl/workers/reward_manager/dapo.py: min(-exceed_len / overlong_buffer_len * penalty_factor, 0)
    exceed_len = length - (max_resp_len - buffer_len)
    return min(-exceed_len / buffer_len * factor, 0)


@pytest.mark.parametrize("max_tokens, buffer", [(32, 8), (20, 19), (16, 1)])
def test_soft_overlong_penalty_is_trls_and_verls(max_tokens, buffer):
    lengths = torch.arange(0, max_tokens + 3)
    got = soft_overlong_penalty(lengths, max_tokens, buffer).tolist()
    want = [_trl_soft_overlong_punishment(n, max_tokens, buffer) for n in lengths.tolist()]
    assert got == pytest.approx(want, abs=1e-7)
    scaled = soft_overlong_penalty(lengths[: max_tokens + 1], max_tokens, buffer, penalty=0.5).tolist()
    assert scaled == pytest.approx([_verl_overlong_reward(n, max_tokens, buffer, 0.5)
                                    for n in range(max_tokens + 1)], abs=1e-7)


def test_soft_overlong_penalty_needs_a_buffer_inside_the_length():
    for buffer in (0, 16, 17):
        with pytest.raises(ValueError, match="buffer_tokens"):
            soft_overlong_penalty(torch.tensor([3]), 16, buffer)


@pytest.mark.parametrize("estimator", sorted(KL_ESTIMATORS))
def test_sequence_kl_sums_the_estimator_over_valid_tokens(estimator):
    gen = torch.Generator().manual_seed(0)
    logp_BT, ref_BT = -torch.rand(3, 5, generator=gen) * 3, -torch.rand(3, 5, generator=gen) * 3
    mask_BT = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
    logp_BT[~mask_BT] = float("nan")  # padding never reaches the sum
    got_B = sequence_kl(logp_BT, ref_BT, mask_BT, estimator)
    kl = KL_ESTIMATORS[estimator]
    want_B = [sum(kl(logp_BT[b, t], ref_BT[b, t]).item() for t in range(5) if mask_BT[b, t]) for b in range(3)]
    assert got_B.tolist() == pytest.approx(want_B, abs=1e-6)
    if estimator == "k1":  # the plain log-ratio, as PPO-RLHF's per-token penalty
        assert got_B[1].item() == pytest.approx((logp_BT[1] - ref_BT[1]).sum().item(), abs=1e-6)


def test_informative_groups_are_the_ones_with_nonzero_advantages():
    rewards_PG = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.3, 0.3, 0.3], [0.0, 0.0, 0.5]])
    assert informative_groups(rewards_PG).tolist() == [False, True, False, True]
    adv_PG = group_advantages(rewards_PG)
    assert (adv_PG.abs().sum(dim=1) > 0).tolist() == informative_groups(rewards_PG).tolist()
