"""graft.config.objective: the objective's variants in `train`, their defaults (plain GRPO) and the
combinations refused because a switch is off."""

import pytest

from graft.config import GraftConfig, load_config, save_config
from tests.config.common import config_error as _error

_MENU = ["train.ratio_level=sequence", "train.clip_eps_low=0.1", "train.clip_eps_high=0.28", "train.dual_clip_c=3.0",
         "train.kl_coef=0.01", "train.kl_estimator=k3-clamped", "train.kl_bias_correction=true",
         "train.loss_agg=seq-mean-token-sum-norm", "train.tis_cap=2.0", "train.tis_mode=sequence-mask",
         "train.adv_baseline=leave-one-out", "train.overlong_filter=true", "train.overlong_buffer_tokens=16",
         "train.overlong_penalty=0.5", "train.filter_groups=true", "train.max_sampling_rounds=5"]


def test_defaults_are_plain_grpo():
    train = GraftConfig().train
    assert (train.ratio_level, train.clip_eps_low, train.clip_eps_high) == ("token", None, None)
    assert train.dual_clip_c is None
    assert (train.kl_estimator, train.kl_bias_correction, train.loss_norm_tokens) == ("k3", False, None)
    assert (train.tis_mode, train.adv_baseline, train.loss_agg) == ("token-truncate", "mean", "token-mean")
    assert (train.kl_in, train.overlong_filter, train.overlong_buffer_tokens, train.filter_groups) == \
        ("loss", False, None, False)


def test_the_whole_menu_loads_and_round_trips(tmp_path):
    cfg = load_config(None, [*[o for o in _MENU if "kl_bias" not in o], "train.kl_in=reward",
                             "rollout.max_new_tokens=48"])
    assert cfg.train.loss_norm_tokens == 48  # Dr. GRPO's constant: the longest completion a rollout gives
    assert load_config(None, [*_MENU, "train.loss_norm_tokens=64"]).train.loss_norm_tokens == 64
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg


@pytest.mark.parametrize("overrides, keys", [
    (["train.tis_mode=token-mask"], ("train.tis_mode", "train.tis_cap")),
    (["train.kl_estimator=k2"], ("train.kl_estimator", "train.kl_coef")),
    (["train.kl_bias_correction=true"], ("train.kl_bias_correction", "train.kl_coef")),
    (["train.loss_norm_tokens=512"], ("train.loss_norm_tokens", "train.loss_agg")),
    (["train.kl_in=reward"], ("train.kl_in", "train.kl_coef")),
    (["train.kl_coef=0.1", "train.kl_in=reward", "train.kl_bias_correction=true"],
     ("train.kl_bias_correction", "train.kl_in")),
    (["train.overlong_penalty=0.5"], ("train.overlong_penalty", "train.overlong_buffer_tokens")),
    (["train.max_sampling_rounds=5"], ("train.max_sampling_rounds", "train.filter_groups")),
    (["train.overlong_buffer_tokens=32"], ("train.overlong_buffer_tokens", "rollout.max_new_tokens")),
])
def test_a_variant_whose_switch_is_off_is_refused_naming_both_keys(overrides, keys):
    message = _error(overrides=overrides)
    assert all(key in message for key in keys), message


@pytest.mark.parametrize("override, expected", [
    ("train.dual_clip_c=1.0", "train.dual_clip_c: Input should be greater than 1"),
    ("train.clip_eps_low=1.0", "train.clip_eps_low: Input should be less than 1"),
    ("train.ratio_level=sentence", "train.ratio_level: Input should be 'token' or 'sequence'"),
    ("train.adv_baseline=rloo", "train.adv_baseline: Input should be 'mean' or 'leave-one-out'"),
])
def test_out_of_range_values_name_their_key(override, expected):
    assert _error(overrides=[override]).startswith(expected)
