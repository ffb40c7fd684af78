"""graft.rl.losses: PPO-clip/GRPO maths, aggregations, masks, and a bit-for-bit reference.

Shape suffixes: see graft/__init__.py.
"""

import math

import pytest
import torch

from graft.rl.aggregations import AGGREGATIONS
from graft.rl.importance import truncated_importance_weights
from graft.rl.kl import kl_k3
from graft.rl.losses import LossInputs, LossOptions, grpo_loss

AGGS = ("token-mean", "seq-mean-token-mean")


def _batch(seed: int, b: int = 4, t: int = 7):
    """Random log-probs, advantages and a ragged right-padded mask (every row has >= 1 token)."""
    g = torch.Generator().manual_seed(seed)
    old_BT = -torch.rand(b, t, generator=g) * 3
    logprobs_BT = old_BT + 0.3 * torch.randn(b, t, generator=g)
    ref_BT = old_BT + 0.3 * torch.randn(b, t, generator=g)
    entropy_BT = torch.rand(b, t, generator=g) * 2
    adv_B = torch.randn(b, generator=g)
    lens_B = torch.randint(1, t + 1, (b,), generator=g)
    mask_BT = torch.arange(t)[None, :] < lens_B[:, None]
    return logprobs_BT, old_BT, ref_BT, entropy_BT, adv_B, mask_BT


def _grpo(logprobs_BT, old_BT, ref_BT, entropy_BT, adv_B, mask_BT, agg, tis_BT=None, kl_coef=0.05, ent=0.01):
    options = LossOptions(clip_eps=0.2, kl_coef=kl_coef, entropy_coef=ent, agg=agg)
    return grpo_loss(LossInputs(logprobs_BT, old_BT, adv_B, mask_BT, ref_logprobs_BT=ref_BT, entropy_BT=entropy_BT,
                                tis_weights_BT=tis_BT, options=options))


def _ppo(logprobs_BT, old_BT, adv_B, mask_BT, clip_eps, agg):
    """PPO-clip alone: the GRPO loss without KL, entropy or importance weights."""
    return grpo_loss(LossInputs(logprobs_BT, old_BT, adv_B, mask_BT,
                                options=LossOptions(clip_eps=clip_eps, kl_coef=0.0, entropy_coef=0.0, agg=agg)))


@pytest.mark.parametrize("agg", AGGS)
def test_gradient_at_ratio_one_is_minus_advantage_times_grad_logp(agg):
    _, old_BT, _, _, adv_B, mask_BT = _batch(1)
    logprobs_BT = old_BT.clone().requires_grad_(True)
    loss, stats = _ppo(logprobs_BT, old_BT, adv_B, mask_BT, clip_eps=0.2, agg=agg)
    loss.backward()
    # d loss / d logp_bt = -A_b * (aggregation weight of token bt).
    if agg == "token-mean":
        weight_BT = mask_BT.float() / mask_BT.sum()
    else:
        weight_BT = mask_BT.float() / mask_BT.sum(1, keepdim=True) / mask_BT.shape[0]
    torch.testing.assert_close(logprobs_BT.grad, -adv_B[:, None] * weight_BT)
    assert {k: stats[k] for k in ("clip_fraction", "ratio_mean")} == {"clip_fraction": 0.0, "ratio_mean": 1.0}


def test_clipping_only_beyond_eps_in_the_direction_of_the_advantage():
    eps = 0.2
    ratio_T = torch.tensor([0.5, 0.79, 0.81, 1.0, 1.19, 1.21, 2.0])
    old_BT = torch.full((2, 7), -1.0)
    logprobs_BT = (old_BT + ratio_T.log()).requires_grad_(True)
    adv_B = torch.tensor([1.0, -1.0])
    mask_BT = torch.ones(2, 7, dtype=torch.bool)
    loss, stats = _ppo(logprobs_BT, old_BT, adv_B, mask_BT, clip_eps=eps, agg="token-mean")
    loss.backward()
    grad_BT = logprobs_BT.grad
    # A > 0: the objective stops rewarding a ratio above 1+eps (zero gradient); below, never clipped.
    assert torch.equal(grad_BT[0] == 0, ratio_T > 1 + eps)
    # A < 0: the objective stops penalising a ratio below 1-eps; above, never clipped.
    assert torch.equal(grad_BT[1] == 0, ratio_T < 1 - eps)
    assert stats["clip_fraction"] == pytest.approx(4 / 14)
    # Values: -min(rA, clip(r)A) token by token.
    r_BT = logprobs_BT.detach().sub(old_BT).exp()
    expected_BT = -torch.minimum(r_BT * adv_B[:, None], r_BT.clamp(1 - eps, 1 + eps) * adv_B[:, None])
    torch.testing.assert_close(loss, expected_BT.mean())
    assert expected_BT[0, -1].item() == pytest.approx(-1.2)  # r = 2, A = +1: capped gain
    assert expected_BT[1, 0].item() == pytest.approx(0.8)  # r = 0.5, A = -1: capped gain
    assert expected_BT[1, -1].item() == pytest.approx(2.0)  # r = 2, A = -1: loss never capped


def test_aggregations_match_hand_computed_values_and_differ_on_uneven_lengths():
    values_BT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 99.0, -99.0]])
    mask_BT = torch.tensor([[True, True, True], [True, False, False]])
    assert AGGREGATIONS["token-mean"].reduce(values_BT, mask_BT, None).item() == pytest.approx(10 / 4)
    assert AGGREGATIONS["seq-mean-token-mean"].reduce(values_BT, mask_BT, None).item() == pytest.approx((2 + 4) / 2)
    # Through the loss at ratio 1: every token of row b is -A_b.
    adv_B = torch.tensor([1.0, -3.0])
    zeros_BT = torch.zeros(2, 3)
    token, _ = _ppo(zeros_BT, zeros_BT, adv_B, mask_BT, clip_eps=0.2, agg="token-mean")
    seq, _ = _ppo(zeros_BT, zeros_BT, adv_B, mask_BT, clip_eps=0.2, agg="seq-mean-token-mean")
    assert token.item() == pytest.approx(-(3 * 1.0 + 1 * -3.0) / 4)
    assert seq.item() == pytest.approx(-(1.0 - 3.0) / 2)
    assert token.item() != seq.item()


def test_unknown_aggregation_lists_registered_names():
    x_BT = torch.zeros(1, 2)
    mask_BT = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="seq-mean-token-mean.*token-mean"):
        _ppo(x_BT, x_BT, torch.ones(1), mask_BT, clip_eps=0.2, agg="sum")
    with pytest.raises(ValueError, match="token-mean"):
        _grpo(x_BT, x_BT, None, None, torch.ones(1), mask_BT, "seq-sum", kl_coef=0.0, ent=0.0)


def test_missing_tensor_for_a_nonzero_coefficient_raises():
    x_BT = torch.zeros(1, 2)
    mask_BT = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="ref_logprobs_BT"):
        _grpo(x_BT, x_BT, None, None, torch.ones(1), mask_BT, "token-mean", kl_coef=0.1, ent=0.0)
    with pytest.raises(ValueError, match="entropy_BT"):
        _grpo(x_BT, x_BT, None, None, torch.ones(1), mask_BT, "token-mean", kl_coef=0.0, ent=0.1)


def test_kl_k3_is_nonnegative_and_zero_when_equal():
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        scale = 10.0 ** torch.randint(-9, 2, (1,), generator=g).item()
        logprobs_BT = -torch.rand(3, 50, generator=g) * 5
        ref_BT = logprobs_BT + scale * torch.randn(3, 50, generator=g)
        kl_BT = kl_k3(logprobs_BT, ref_BT)
        assert (kl_BT >= 0).all(), seed
        d_BT = (ref_BT - logprobs_BT).double()
        torch.testing.assert_close(kl_BT.double(), d_BT.exp() - d_BT - 1, atol=1e-6, rtol=1e-4)
        assert torch.equal(kl_k3(logprobs_BT, logprobs_BT), torch.zeros(3, 50))


def test_truncated_importance_weights():
    trainer_BT = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    engine_BT = torch.tensor([[-1.0, -1.0, -3.0]])
    w_BT = truncated_importance_weights(trainer_BT, engine_BT, cap=2.0)
    torch.testing.assert_close(w_BT, torch.tensor([[1.0, math.exp(-1.0), 2.0]]))
    assert not w_BT.requires_grad
    with pytest.raises(ValueError, match="cap"):
        truncated_importance_weights(trainer_BT, engine_BT, cap=0.0)


@pytest.mark.parametrize("agg", AGGS)
def test_padding_changes_nothing(agg):
    for seed in range(10):
        logprobs_BT, old_BT, ref_BT, entropy_BT, adv_B, mask_BT = _batch(seed)
        tis_BT = torch.rand(logprobs_BT.shape, generator=torch.Generator().manual_seed(seed)) + 0.5
        results = []
        for garbage in (None, float("nan"), 1e30):
            tensors = [logprobs_BT, old_BT, ref_BT, entropy_BT, tis_BT]
            if garbage is not None:
                tensors = [x.masked_fill(~mask_BT, garbage) for x in tensors]
            lp_BT = tensors[0].clone().requires_grad_(True)
            loss, stats = _grpo(lp_BT, tensors[1], tensors[2], tensors[3], adv_B, mask_BT, agg, tis_BT=tensors[4])
            loss.backward()
            results.append((loss, stats, lp_BT.grad[mask_BT]))
        for loss, stats, grad in results[1:]:
            assert torch.equal(loss, results[0][0])
            assert stats == results[0][1]
            assert torch.equal(grad, results[0][2])


def _reference_grpo(logprobs_BT, old_BT, ref_BT, entropy_BT, adv_B, mask_BT, agg, tis_BT,
                    clip_eps=0.2, kl_coef=0.05, entropy_coef=0.01):
    """The GRPO loss written out straight, for the bit-for-bit refactor check."""
    ratio = torch.exp(logprobs_BT - old_BT)
    adv = adv_B.unsqueeze(-1)
    pg = -torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    pg = pg * tis_BT
    d = ref_BT - logprobs_BT
    per_token = pg + kl_coef * (torch.expm1(d) - d) - entropy_coef * entropy_BT
    masked = torch.where(mask_BT, per_token, 0.0)
    if agg == "token-mean":
        return masked.sum() / mask_BT.sum()
    return (masked.sum(-1) / mask_BT.sum(-1)).mean()


@pytest.mark.parametrize("agg", AGGS)
def test_loss_equals_reference_bit_for_bit(agg):
    for seed in range(25):
        logprobs_BT, old_BT, ref_BT, entropy_BT, adv_B, mask_BT = _batch(seed, b=1 + seed % 5, t=3 + seed % 9)
        tis_BT = truncated_importance_weights(logprobs_BT, old_BT + 0.01, cap=2.0)
        a_BT = logprobs_BT.clone().requires_grad_(True)
        b_BT = logprobs_BT.clone().requires_grad_(True)
        loss, _ = _grpo(a_BT, old_BT, ref_BT, entropy_BT, adv_B, mask_BT, agg, tis_BT=tis_BT)
        expected = _reference_grpo(b_BT, old_BT, ref_BT, entropy_BT, adv_B, mask_BT, agg, tis_BT)
        loss.backward()
        expected.backward()
        assert torch.equal(loss, expected), (seed, loss.item(), expected.item())
        assert torch.equal(a_BT.grad, b_BT.grad), seed


def test_grpo_stats():
    logprobs_BT, old_BT, ref_BT, entropy_BT, adv_B, mask_BT = _batch(3)
    _, stats = _grpo(logprobs_BT, old_BT, ref_BT, entropy_BT, adv_B, mask_BT, "token-mean")
    assert set(stats) == {"pg_loss", "kl", "entropy", "clip_fraction", "ratio_mean"}
    assert all(isinstance(v, float) for v in stats.values())
    assert stats["kl"] == pytest.approx(kl_k3(logprobs_BT, ref_BT)[mask_BT].mean().item())
    assert stats["entropy"] == pytest.approx(entropy_BT[mask_BT].mean().item())
    assert stats["ratio_mean"] == pytest.approx((logprobs_BT - old_BT).exp()[mask_BT].mean().item())
    _, bare = _grpo(logprobs_BT, old_BT, None, None, adv_B, mask_BT, "token-mean", kl_coef=0.0, ent=0.0)
    assert bare["kl"] == 0.0 and bare["entropy"] == 0.0


@pytest.mark.parametrize("agg", sorted(AGGREGATIONS))
def test_aggregation_of_split_batch_adds_up_to_the_whole(agg):
    """Ranks and micro-batches each see part of the batch; with the whole batch's divisor, the parts'
    losses sum to the whole batch's loss (so do their gradients)."""
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 1, 5, 2, 4]
    mask_BT = torch.arange(5)[None, :] < torch.tensor(lengths)[:, None]
    values_BT = torch.randn(5, 5, generator=gen)
    aggregation = AGGREGATIONS[agg]
    whole = aggregation.reduce(values_BT, mask_BT, None)
    divisor = aggregation.divisor(lengths)
    parts = sum(aggregation.reduce(values_BT[rows], mask_BT[rows], divisor) for rows in ([0, 1], [2], [3, 4]))
    torch.testing.assert_close(parts, whole)
