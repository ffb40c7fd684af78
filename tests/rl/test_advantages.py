"""graft.rl.advantages: GRPO group advantages."""

import pytest
import torch

from graft.rl.advantages import group_advantages


def test_hand_computed_values():
    rewards_PG = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0]])
    # Row 0: mean 0.5, std 0.5. Row 1: mean 2, population std sqrt(0.5).
    expected_PG = torch.tensor([[1.0, -1.0, -1.0, 1.0], [1.0, -1.0, 0.0, 0.0]])
    expected_PG[1] /= 0.5**0.5
    torch.testing.assert_close(group_advantages(rewards_PG, eps=0.0), expected_PG)
    torch.testing.assert_close(group_advantages(rewards_PG, normalize_std=False), rewards_PG - rewards_PG.mean(1, True))


def test_constant_groups_give_exact_zeros():
    rewards_PG = torch.tensor([[0.1, 0.1, 0.1], [7.0, 7.0, 7.0], [0.0, 0.0, 0.0], [1.0, 2.0, 3.0]])
    for normalize_std in (True, False):
        adv_PG = group_advantages(rewards_PG, normalize_std=normalize_std)
        assert torch.isfinite(adv_PG).all()
        assert torch.equal(adv_PG[:3], torch.zeros(3, 3))
        assert (adv_PG[3] != 0).sum() == 2
    single_P1 = group_advantages(torch.tensor([[5.0], [-2.0]]))
    assert torch.equal(single_P1, torch.zeros(2, 1))


def test_random_groups_are_centred_and_scaled():
    for seed in range(50):
        g = torch.Generator().manual_seed(seed)
        num_prompts, group = torch.randint(1, 6, (2,), generator=g).tolist()
        group += 1
        rewards_PG = torch.randint(0, 3, (num_prompts, group), generator=g).float()
        adv_PG = group_advantages(rewards_PG)
        assert torch.isfinite(adv_PG).all()
        torch.testing.assert_close(adv_PG.mean(1), torch.zeros(num_prompts), atol=1e-5, rtol=0)
        varied_P = rewards_PG.amax(1) != rewards_PG.amin(1)
        std_P = adv_PG.std(1, correction=0)
        torch.testing.assert_close(std_P[varied_P], torch.ones(int(varied_P.sum())), atol=1e-4, rtol=0)
        assert torch.equal(std_P[~varied_P], torch.zeros(int((~varied_P).sum())))
        # Order within the group is preserved.
        assert torch.equal(adv_PG.argsort(dim=1, stable=True), rewards_PG.argsort(dim=1, stable=True))


def test_integer_rewards_are_accepted():
    assert group_advantages(torch.tensor([[0, 1]])).dtype == torch.float32


def test_non_2d_rewards_raise():
    with pytest.raises(ValueError, match="2-D"):
        group_advantages(torch.tensor([1.0, 2.0]))


def test_population_and_sample_std_by_hand():
    rewards_PG = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0]])
    centred_PG = torch.tensor([[0.5, -0.5, -0.5, 0.5], [1.0, -1.0, 0.0, 0.0]])
    # Squared deviations sum to 1 and 2: population variance 1/4 and 2/4, sample variance 1/3 and 2/3.
    population_P1 = torch.tensor([[(1 / 4) ** 0.5], [(2 / 4) ** 0.5]])
    sample_P1 = torch.tensor([[(1 / 3) ** 0.5], [(2 / 3) ** 0.5]])
    torch.testing.assert_close(group_advantages(rewards_PG, eps=0.0, std="population"), centred_PG / population_P1)
    torch.testing.assert_close(group_advantages(rewards_PG, eps=0.0, std="sample"), centred_PG / sample_P1)
    assert torch.equal(group_advantages(rewards_PG), group_advantages(rewards_PG, std="population"))
    # Without normalisation the estimator does not matter.
    assert torch.equal(group_advantages(rewards_PG, normalize_std=False, std="sample"),
                       group_advantages(rewards_PG, normalize_std=False))


@pytest.mark.parametrize("group", [2, 3, 8, 16])
def test_sample_std_is_torch_unbiased_std_and_population_is_sqrt_g_over_g_minus_1_larger(group):
    rewards_PG = torch.rand(5, group, generator=torch.Generator().manual_seed(group))
    centred_PG = rewards_PG - rewards_PG.mean(1, keepdim=True)
    sample_PG = group_advantages(rewards_PG, eps=0.0, std="sample")
    torch.testing.assert_close(sample_PG, centred_PG / torch.std(rewards_PG, dim=1, unbiased=True, keepdim=True))
    torch.testing.assert_close(sample_PG, centred_PG / rewards_PG.std(1, keepdim=True))  # torch's default
    population_PG = group_advantages(rewards_PG, eps=0.0, std="population")
    torch.testing.assert_close(population_PG / sample_PG, torch.full_like(sample_PG, (group / (group - 1)) ** 0.5))
    # Population: unit RMS per group whatever G; sample: sqrt((G-1)/G).
    torch.testing.assert_close(population_PG.pow(2).mean(1), torch.ones(5))
    torch.testing.assert_close(sample_PG.pow(2).mean(1), torch.full((5,), (group - 1) / group))


def test_sample_std_keeps_constant_groups_and_groups_of_one_at_zero():
    assert torch.equal(group_advantages(torch.tensor([[5.0], [-2.0]]), std="sample"), torch.zeros(2, 1))
    assert torch.equal(group_advantages(torch.tensor([[0.1, 0.1, 0.1]]), std="sample"), torch.zeros(1, 3))


def test_unknown_std_estimator_raises():
    with pytest.raises(ValueError, match=r"unknown std estimator 'bessel'.*'population', 'sample'"):
        group_advantages(torch.tensor([[1.0, 2.0]]), std="bessel")


def test_leave_one_out_baseline_is_the_mean_of_the_other_rewards():
    """RLOO (Ahmadian et al. 2024, eq. 6; verl compute_rloo_outcome_advantage):
    ``A_i = r_i - 1/(G-1) * sum_{j != i} r_j``, written out here reward by reward."""
    gen = torch.Generator().manual_seed(0)
    rewards_PG = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    expected_PG = torch.empty_like(rewards_PG)
    for p in range(5):
        for i in range(4):
            others = [rewards_PG[p, j] for j in range(4) if j != i]
            expected_PG[p, i] = rewards_PG[p, i] - sum(others) / 3
    loo_PG = group_advantages(rewards_PG, normalize_std=False, baseline="leave-one-out")
    torch.testing.assert_close(loo_PG, expected_PG)
    # With the std: the same centred rewards over the group's std.
    std_P1 = rewards_PG.std(dim=1, keepdim=True, correction=0)
    torch.testing.assert_close(group_advantages(rewards_PG, eps=0.0, baseline="leave-one-out"), expected_PG / std_P1)
    # Constant groups and groups of one carry no signal: exact zeros, as with the mean baseline.
    flat_PG = torch.tensor([[2.0, 2.0, 2.0], [1.0, 0.0, 0.0]])
    assert torch.equal(group_advantages(flat_PG, normalize_std=False, baseline="leave-one-out")[0], torch.zeros(3))
    assert torch.equal(group_advantages(torch.tensor([[3.0]]), baseline="leave-one-out"), torch.zeros(1, 1))
    with pytest.raises(ValueError, match="leave-one-out"):
        group_advantages(flat_PG, baseline="loo")
