"""graft.rl.importance: the train/inference mismatch corrections against their formulas (TRL's
vllm_importance_sampling_mode, verl's rollout correction with the geometric-mean sequence ratio),
and their statistics.

Shape suffixes: see graft/__init__.py.
"""

import math

import pytest
import torch

from graft.rl.importance import MISMATCH_CORRECTIONS, mismatch_weights, truncated_importance_weights


def _logprobs(seed: int, b: int = 6, t: int = 8):
    g = torch.Generator().manual_seed(seed)
    engine_BT = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    trainer_BT = engine_BT + 0.6 * torch.randn(b, t, generator=g, dtype=torch.float64)
    mask_BT = torch.arange(t)[None, :] < torch.randint(1, t + 1, (b,), generator=g)[:, None]
    return trainer_BT, engine_BT, mask_BT


def _expected(trainer_BT, engine_BT, mask_BT, mode, cap):
    """Written out from TRL (grpo_trainer.py, _generate_and_score_completions): ``diff = (old - sampling)
    * mask``; token modes take ``exp(diff)``; the sequence modes here take the geometric mean
    ``exp(diff.sum(-1) / mask.sum(-1))`` (TRL's takes the product, ``exp(diff.sum(-1))``); truncate =
    ``clamp(ratio, max=cap)``; mask = ``ratio.masked_fill(ratio > cap, 0)``."""
    diff_BT = torch.where(mask_BT, trainer_BT - engine_BT, 0.0) * mask_BT
    if mode.startswith("sequence"):
        diff_BT = (diff_BT.sum(-1, keepdim=True) / mask_BT.sum(-1, keepdim=True)).expand_as(diff_BT)
    ratio_BT = torch.exp(diff_BT)
    if mode.endswith("truncate"):
        return torch.clamp(ratio_BT, max=cap), ratio_BT
    return ratio_BT.masked_fill(ratio_BT > cap, 0.0), ratio_BT


@pytest.mark.parametrize("mode", sorted(MISMATCH_CORRECTIONS))
def test_weights_and_statistics_match_the_formula(mode):
    fractions = []
    for seed in range(10):
        trainer_BT, engine_BT, mask_BT = _logprobs(seed)
        cap = 1.3
        weights_BT, stats = mismatch_weights(trainer_BT, engine_BT, mask_BT, mode, cap)
        expected_BT, ratio_BT = _expected(trainer_BT, engine_BT, mask_BT, mode, cap)
        torch.testing.assert_close(weights_BT[mask_BT], expected_BT[mask_BT], rtol=1e-12, atol=0)
        n = mask_BT.sum().item()
        d_BT = trainer_BT - engine_BT  # k3 of KL(engine || trainer) on the engine's samples
        assert stats["mismatch_kl"] == pytest.approx(((d_BT.exp() - d_BT - 1) * mask_BT).sum().item() / n)
        assert stats["tis_weight_mean"] == pytest.approx((expected_BT * mask_BT).sum().item() / n)
        assert stats["tis_capped_fraction"] == pytest.approx(((ratio_BT > cap) & mask_BT).sum().item() / n)
        fractions.append(stats["tis_capped_fraction"])
    assert any(0 < f < 1 for f in fractions)  # the cap acts on some tokens, not all


def test_token_truncate_is_todays_tis_bit_for_bit():
    trainer_BT, engine_BT, mask_BT = _logprobs(0)
    weights_BT, _ = mismatch_weights(trainer_BT, engine_BT, mask_BT, "token-truncate", 2.0)
    assert torch.equal(weights_BT, truncated_importance_weights(trainer_BT, engine_BT, 2.0))


def test_sequence_modes_weigh_or_drop_whole_sequences():
    trainer_BT = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -2.0, 0.0]])
    engine_BT = torch.tensor([[-2.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    mask_BT = torch.tensor([[True, True, False], [True, True, True]])
    masked_BT, stats = mismatch_weights(trainer_BT, engine_BT, mask_BT, "sequence-mask", 1.5)
    # Row 0: mean log-ratio (1 + 0) / 2 = 0.5, exp(0.5) = 1.65 > 1.5: dropped. Row 1: mean 0: kept at 1.
    assert torch.equal(masked_BT[mask_BT], torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0]))
    assert stats["tis_capped_fraction"] == pytest.approx(2 / 5) and stats["tis_weight_mean"] == pytest.approx(3 / 5)
    truncated_BT, _ = mismatch_weights(trainer_BT, engine_BT, mask_BT, "sequence-truncate", 1.5)
    assert torch.equal(truncated_BT[mask_BT], torch.tensor([1.5, 1.5, 1.0, 1.0, 1.0]))


def test_off_measures_and_padding_is_ignored():
    trainer_BT, engine_BT, mask_BT = _logprobs(1)
    weights_BT, stats = mismatch_weights(trainer_BT, engine_BT, mask_BT, "token-truncate", None)
    assert weights_BT is None and stats["tis_weight_mean"] == 1.0 and stats["tis_capped_fraction"] == 0.0
    assert stats["mismatch_kl"] > 0
    _, same = mismatch_weights(trainer_BT, trainer_BT, mask_BT, "sequence-mask", 2.0)
    assert same == {"mismatch_kl": 0.0, "tis_weight_mean": 1.0, "tis_capped_fraction": 0.0}
    for mode in MISMATCH_CORRECTIONS:
        clean = mismatch_weights(trainer_BT, engine_BT, mask_BT, mode, 1.3)
        dirty = mismatch_weights(trainer_BT.masked_fill(~mask_BT, math.nan), engine_BT.masked_fill(~mask_BT, 1e30),
                                 mask_BT, mode, 1.3)
        assert torch.equal(clean[0][mask_BT], dirty[0][mask_BT]) and clean[1] == dirty[1]
    with pytest.raises(ValueError, match="sequence-mask"):
        mismatch_weights(trainer_BT, engine_BT, mask_BT, "sequence", 2.0)
    with pytest.raises(ValueError, match="cap"):
        mismatch_weights(trainer_BT, engine_BT, mask_BT, "token-mask", 0.0)
