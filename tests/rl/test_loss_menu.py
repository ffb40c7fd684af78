"""The objective menu against formulas written out from the papers and reference code, values and
gradients: GSPO's sequence ratio, asymmetric and dual clipping, the Dr. GRPO and token-sum
aggregations, the KL estimators and TRL's bias-corrected KL.

Shape suffixes: see graft/__init__.py.
"""

import math
import typing

import pytest
import torch

from graft.config import TrainConfig
from graft.rl.aggregations import AGGREGATIONS
from graft.rl.importance import RATIO_LEVELS
from graft.rl.kl import KL_ESTIMATORS
from graft.rl.losses import LossInputs, LossOptions, grpo_loss


def _batch(seed: int, b: int = 5, t: int = 7, spread: float = 0.3):
    """Random log-probs, advantages and a ragged right-padded mask (every row has >= 1 token)."""
    g = torch.Generator().manual_seed(seed)
    old_BT = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    logprobs_BT = old_BT + spread * torch.randn(b, t, generator=g, dtype=torch.float64)
    ref_BT = old_BT + spread * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv_B = torch.randn(b, generator=g, dtype=torch.float64)
    lens_B = torch.randint(1, t + 1, (b,), generator=g)
    mask_BT = torch.arange(t)[None, :] < lens_B[:, None]
    return logprobs_BT, old_BT, ref_BT, adv_B, mask_BT


def _loss_and_grad(logprobs_BT, old_BT, adv_B, mask_BT, agg, ref_BT=None, kl_coef=0.0, tis_BT=None, **options):
    lp_BT = logprobs_BT.clone().requires_grad_(True)
    options = LossOptions(clip_eps=0.2, kl_coef=kl_coef, entropy_coef=0.0, agg=agg, **options)
    loss, stats = grpo_loss(LossInputs(lp_BT, old_BT, adv_B, mask_BT, ref_logprobs_BT=ref_BT, tis_weights_BT=tis_BT,
                                       options=options))
    loss.backward()
    return loss, lp_BT.grad, stats


def _reference_and_grad(per_token_loss, logprobs_BT, mask_BT, aggregate):
    """``aggregate(per_token_loss(lp), mask)`` and its gradient in lp, for a formula written out."""
    lp_BT = logprobs_BT.clone().requires_grad_(True)
    loss = aggregate(per_token_loss(lp_BT), mask_BT.double())
    loss.backward()
    return loss, lp_BT.grad


# The aggregations as TRL writes its loss types (trl/trainer/grpo_trainer.py, GRPOTrainer._compute_loss):
# grpo = ((l * mask).sum(-1) / mask.sum(-1)).mean(); bnpo/dapo = (l * mask).sum() / mask.sum();
# dr_grpo = (l * mask).sum() / (B * max_completion_length); and verl's agg_loss (core_algos.py)
# seq-mean-token-sum = (l * mask).sum(-1).mean().
NORM_TOKENS = 9
TRL_AGGREGATIONS = {
    "seq-mean-token-mean": lambda x, m: ((x * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean(),
    "token-mean": lambda x, m: (x * m).sum() / m.sum().clamp(min=1.0),
    "seq-mean-token-sum-norm": lambda x, m: (x * m).sum() / (x.size(0) * NORM_TOKENS),
    "seq-mean-token-sum": lambda x, m: (x * m).sum(-1).mean(),
}


def _trl_sequence_loss(old_BT, adv_B, mask_BT, eps_low, eps_high):
    """TRL importance_sampling_level="sequence" (GSPO): one ratio per row, [B, 1], from the masked mean
    of the token log-ratios; -min(coef_1 A, clamp(coef_1, 1 - eps_low, 1 + eps_high) A) at every token."""
    def per_token(lp_BT):
        log_ratio = torch.where(mask_BT, lp_BT - old_BT, 0.0)  # where: padding may hold anything
        log_iw = (log_ratio * mask_BT).sum(-1) / mask_BT.sum(-1).clamp(min=1.0)
        coef_1 = torch.exp(log_iw).unsqueeze(-1)
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        adv = adv_B.unsqueeze(-1)
        return -torch.min(coef_1 * adv, coef_2 * adv).expand_as(lp_BT)
    return per_token


@pytest.mark.parametrize("agg", sorted(AGGREGATIONS))
def test_sequence_ratio_is_trls_gspo_in_value_and_gradient(agg):
    """With one weight per row (no per-token corrections) GSPO-token's gradient trick equals TRL's
    sequence-level GSPO exactly: same loss, same gradient, under every aggregation."""
    for seed in range(10):
        logprobs_BT, old_BT, _, adv_B, mask_BT = _batch(seed, spread=0.1)
        loss, grad_BT, stats = _loss_and_grad(logprobs_BT, old_BT, adv_B, mask_BT, agg, ratio_level="sequence",
                                              clip_eps_high=0.28, norm_tokens=NORM_TOKENS)
        expected, expected_grad_BT = _reference_and_grad(_trl_sequence_loss(old_BT, adv_B, mask_BT, 0.2, 0.28),
                                                         logprobs_BT, mask_BT, TRL_AGGREGATIONS[agg])
        torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad_BT, expected_grad_BT, rtol=1e-10, atol=1e-12)
        seq_B = ((logprobs_BT - old_BT) * mask_BT).sum(-1).div(mask_BT.sum(-1)).exp()
        assert stats["ratio_mean"] == pytest.approx((seq_B[:, None] * mask_BT).sum().item() / mask_BT.sum().item())


def test_sequence_ratio_with_token_weights_is_gspo_token():
    """GSPO paper (Zheng et al. 2025, eq. 13-14), GSPO-token: ``s_t = sg[s] * pi_t / sg[pi_t]``, so
    ``d loss / d logp_t = w_t * a_t * (-A s)`` where ``a_t`` is the aggregation's weight of the token,
    and 0 where the clip is active (``A > 0, s > 1 + eps`` or ``A < 0, s < 1 - eps``)."""
    logprobs_BT, old_BT, _, adv_B, mask_BT = _batch(3, spread=0.2)
    w_BT = torch.rand(logprobs_BT.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64) + 0.5
    _, grad_BT, _ = _loss_and_grad(logprobs_BT, old_BT, adv_B, mask_BT, "seq-mean-token-mean", tis_BT=w_BT,
                                   ratio_level="sequence")
    s_B = ((logprobs_BT - old_BT) * mask_BT).sum(-1).div(mask_BT.sum(-1)).exp()
    clipped_B = ((adv_B > 0) & (s_B > 1.2)) | ((adv_B < 0) & (s_B < 0.8))
    assert clipped_B.any() and not clipped_B.all()
    a_BT = mask_BT.double() / mask_BT.sum(-1, keepdim=True) / mask_BT.shape[0]
    expected_BT = torch.where(clipped_B[:, None], 0.0, w_BT * a_BT * (-adv_B * s_B)[:, None])
    torch.testing.assert_close(grad_BT, expected_BT, rtol=1e-10, atol=1e-14)


def _verl_dual_clip_loss(old_BT, adv_B, eps_low, eps_high, clip_ratio_c):
    """verl compute_policy_loss_vanilla (trainer/ppo/core_algos.py), written out:
    pg1 = -A r; pg2 = -A clip(r, 1 - low, 1 + high); c1 = max(pg1, pg2); pg3 = -A c;
    c2 = min(pg3, c1); loss = where(A < 0, c2, c1)."""
    def per_token(lp_BT):
        ratio = torch.exp(lp_BT - old_BT)
        adv = adv_B.unsqueeze(-1)
        pg_losses1 = -adv * ratio
        pg_losses2 = -adv * torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
        clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
        if clip_ratio_c is None:
            return clip_pg_losses1
        clip_pg_losses2 = torch.min(-adv * clip_ratio_c, clip_pg_losses1)
        return torch.where(adv < 0, clip_pg_losses2, clip_pg_losses1)
    return per_token


@pytest.mark.parametrize("eps_low, eps_high, dual", [(0.2, 0.28, None), (0.1, 0.3, None), (0.2, 0.2, 3.0),
                                                     (0.2, 0.28, 1.5)])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_asymmetric_and_dual_clip_match_verl(eps_low, eps_high, dual, agg):
    """DAPO clip-higher (Yu et al. 2025, eq. 10) and dual-clip PPO (Ye et al. 2020) as verl computes
    them; wide log-prob spreads so every clip region is visited."""
    for seed in range(10):
        logprobs_BT, old_BT, _, adv_B, mask_BT = _batch(seed, spread=1.0)
        loss, grad_BT, _ = _loss_and_grad(logprobs_BT, old_BT, adv_B, mask_BT, agg, clip_eps_low=eps_low,
                                          clip_eps_high=eps_high, dual_clip_c=dual)
        expected, expected_grad_BT = _reference_and_grad(_verl_dual_clip_loss(old_BT, adv_B, eps_low, eps_high, dual),
                                                         logprobs_BT, mask_BT, TRL_AGGREGATIONS[agg])
        torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad_BT, expected_grad_BT, rtol=1e-10, atol=1e-14)


def test_clip_regions_by_hand():
    """A > 0 grows up to 1 + high (not 1 + eps); A < 0 with dual-clip: the loss stops at c|A|."""
    ratio_T = torch.tensor([0.5, 0.85, 1.0, 1.25, 1.3, 2.0, 4.0], dtype=torch.float64)
    old_BT = torch.full((2, 7), -1.0, dtype=torch.float64)
    adv_B = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask_BT = torch.ones(2, 7, dtype=torch.bool)
    loss, grad_BT, stats = _loss_and_grad(old_BT + ratio_T.log(), old_BT, adv_B, mask_BT, "token-mean",
                                          clip_eps_low=0.1, clip_eps_high=0.28, dual_clip_c=3.0)
    assert torch.equal(grad_BT[0] == 0, ratio_T > 1.28)  # 1.25 still learns, 1.3 is clipped
    assert torch.equal(grad_BT[1] == 0, (ratio_T < 0.9) | (ratio_T > 3.0))
    per_token = torch.tensor([[-0.5, -0.85, -1.0, -1.25, -1.28, -1.28, -1.28],
                              [0.9, 0.9, 1.0, 1.25, 1.3, 2.0, 3.0]], dtype=torch.float64)
    torch.testing.assert_close(loss, per_token.mean())
    assert stats["clip_fraction"] == pytest.approx(6 / 14)


@pytest.mark.parametrize("name", sorted(KL_ESTIMATORS))
def test_kl_estimators_match_verl(name):
    """verl kl_penalty_forward (core_algos.py) written out, ``kl = ref - logp``:
    k1 = logp - ref; k2 = 0.5 (logp - ref)^2; k3 = exp(kl) - kl - 1;
    low_var_kl = clamp(exp(clamp(kl, -20, 20)) - clamp(kl, -20, 20) - 1, -10, 10)."""
    def verl(lp_BT, ref_BT):
        if name == "k1":
            return lp_BT - ref_BT
        if name == "k2":
            return 0.5 * (lp_BT - ref_BT).square()
        kl = ref_BT - lp_BT
        if name == "k3":
            return torch.exp(kl) - kl - 1
        kl = torch.clamp(kl, min=-20, max=20)
        return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)

    # Spread 2.0: some tokens' k3 exceeds 10, so the clamp (and its zero gradient) is exercised.
    logprobs_BT, old_BT, ref_BT, adv_B, mask_BT = _batch(0, spread=2.0)
    assert name != "k3-clamped" or (verl(logprobs_BT, ref_BT) == 10).any()
    ppo = _verl_dual_clip_loss(old_BT, adv_B, 0.2, 0.2, None)
    loss, grad_BT, stats = _loss_and_grad(logprobs_BT, old_BT, adv_B, mask_BT, "token-mean", ref_BT=ref_BT,
                                          kl_coef=0.1, kl_estimator=name)
    expected, expected_grad_BT = _reference_and_grad(lambda lp: ppo(lp) + 0.1 * verl(lp, ref_BT), logprobs_BT,
                                                     mask_BT, TRL_AGGREGATIONS["token-mean"])
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad_BT, expected_grad_BT, rtol=1e-10, atol=1e-12)
    assert stats["kl"] == pytest.approx((verl(logprobs_BT, ref_BT) * mask_BT).sum().item() / mask_BT.sum().item())


@pytest.mark.parametrize("level", sorted(RATIO_LEVELS))
def test_bias_corrected_kl_matches_trl(level):
    """TRL use_bias_correction_kl: per_token_kl = k3 * coef_1, coef_1 = exp(log importance weights)
    with its gradient. At the token level that is TRL's tensor; at the sequence level the weight is
    the GSPO-token ratio (the sequence ratio's value, each token's own gradient)."""
    logprobs_BT, old_BT, ref_BT, adv_B, mask_BT = _batch(4)
    ppo = _verl_dual_clip_loss(old_BT, adv_B, 0.2, 0.2, None)

    def per_token(lp_BT):
        log_ratio = lp_BT - old_BT
        if level == "sequence":
            seq_B1 = (torch.where(mask_BT, log_ratio, 0.0).sum(-1, keepdim=True) / mask_BT.sum(-1, keepdim=True))
            log_ratio = lp_BT - lp_BT.detach() + seq_B1.detach()
        coef_1 = torch.exp(log_ratio)
        k3 = torch.exp(ref_BT - lp_BT) - (ref_BT - lp_BT) - 1
        pg = _trl_sequence_loss(old_BT, adv_B, mask_BT, 0.2, 0.2)(lp_BT) if level == "sequence" else ppo(lp_BT)
        return pg + 0.05 * k3 * coef_1

    loss, grad_BT, _ = _loss_and_grad(logprobs_BT, old_BT, adv_B, mask_BT, "seq-mean-token-mean", ref_BT=ref_BT,
                                      kl_coef=0.05, kl_bias_correction=True, ratio_level=level)
    expected, expected_grad_BT = _reference_and_grad(per_token, logprobs_BT, mask_BT,
                                                     TRL_AGGREGATIONS["seq-mean-token-mean"])
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad_BT, expected_grad_BT, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("agg", ["seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_token_sum_aggregations_by_hand(agg):
    """Per-token gradient at ratio 1: ``-A_b / B`` (token sums) and ``-A_b / (B L)`` (Dr. GRPO,
    Liu et al. 2025: no 1/|o_i|, a constant L), whatever the row's length."""
    values_BT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 99.0, -99.0]])
    mask_BT = torch.tensor([[True, True, True], [True, False, False]])
    norm = 8 if agg.endswith("norm") else 1
    aggregation = AGGREGATIONS[agg]
    assert aggregation.reduce(values_BT, mask_BT, None, 8).item() == pytest.approx((6 + 4) / (2 * norm))
    if agg.endswith("norm"):  # without a constant: the batch's longest completion
        assert aggregation.reduce(values_BT, mask_BT, None).item() == pytest.approx(10 / (2 * 3))
    assert aggregation.divisor([3, 1], 8) == 2 * norm
    _, old_BT, _, adv_B, mask_BT = _batch(2)
    _, grad_BT, _ = _loss_and_grad(old_BT, old_BT, adv_B, mask_BT, agg, norm_tokens=8)
    torch.testing.assert_close(grad_BT, -adv_B[:, None] * mask_BT / (mask_BT.shape[0] * norm))


@pytest.mark.parametrize("agg", sorted(AGGREGATIONS))
@pytest.mark.parametrize("norm_tokens", [None, 11])
def test_every_aggregation_of_a_split_batch_adds_up_to_the_whole(agg, norm_tokens):
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 1, 5, 2, 4]
    mask_BT = torch.arange(5)[None, :] < torch.tensor(lengths)[:, None]
    values_BT = torch.randn(5, 5, generator=gen)
    aggregation = AGGREGATIONS[agg]
    whole = aggregation.reduce(values_BT, mask_BT, None, norm_tokens)
    divisor = aggregation.divisor(lengths, norm_tokens)
    parts = sum(aggregation.reduce(values_BT[rows], mask_BT[rows], divisor, norm_tokens)
                for rows in ([0, 1], [2], [3, 4]))
    torch.testing.assert_close(parts, whole)


@pytest.mark.parametrize("options", [dict(ratio_level="sequence"), dict(dual_clip_c=2.0, clip_eps_high=0.3),
                                     dict(kl_estimator="k3-clamped", kl_bias_correction=True)])
def test_padding_changes_nothing_for_the_variants(options):
    for seed in range(5):
        logprobs_BT, old_BT, ref_BT, adv_B, mask_BT = _batch(seed, spread=0.5)
        results = []
        for garbage in (None, float("nan"), 1e30):
            tensors = [logprobs_BT, old_BT, ref_BT]
            if garbage is not None:
                tensors = [x.masked_fill(~mask_BT, garbage) for x in tensors]
            loss, grad_BT, stats = _loss_and_grad(tensors[0], tensors[1], adv_B, mask_BT, "seq-mean-token-sum",
                                                  ref_BT=tensors[2], kl_coef=0.05, **options)
            results.append((loss, stats, grad_BT[mask_BT]))
        for loss, stats, grad in results[1:]:
            assert torch.equal(loss, results[0][0]) and stats == results[0][1]
            assert torch.equal(grad, results[0][2])


def test_config_names_are_the_registered_variants():
    """Every name the config admits is registered, and every registered name can be chosen."""
    fields = TrainConfig.model_fields
    assert set(typing.get_args(fields["loss_agg"].annotation)) == set(AGGREGATIONS)
    assert set(typing.get_args(fields["ratio_level"].annotation)) == set(RATIO_LEVELS)
    assert set(typing.get_args(fields["kl_estimator"].annotation)) == set(KL_ESTIMATORS)
    assert LossOptions.from_config(TrainConfig()) == LossOptions()  # the defaults are plain GRPO
    assert math.isclose(TrainConfig().clip_eps, 0.2)
