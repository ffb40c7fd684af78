"""The objective menu through the whole update: every aggregation and variant gives the same update
micro-batched as in one batch (one process), and on 2 FSDP2 ranks as on one; each config key reaches
the loss; the mismatch metrics come back every step."""
# The micro-batch cases take about a minute each on 2 shared cores, the 2-rank ones a little more.

import json

import pytest
import safetensors.torch
import torch
import torch.multiprocessing as mp

from graft.config import load_config
from graft.lora.attach import lora_parameters
from graft.rl.aggregations import AGGREGATIONS
from graft.rl.losses import LossOptions
from graft.train.distributed import Dist
from graft.train.update import policy_update
from tests.helpers import trained_like_peft_model
from tests.train.test_distributed import _COMPARED, WORLD, _batch, _rank_main, _updates

# Two optimizer steps per batch (the second mini-batch's ratio is off 1: the clip and the old policy matter) and
# the engine's log-probs (-1.0 per token in the test batches) far from the trainer's: every
# correction acts.
_BASE = ["train.mini_batches=2", "train.tis_cap=2.0", "train.lr=1e-3"]
_MENU = ["train.ratio_level=sequence", "train.clip_eps_high=0.28", "train.dual_clip_c=3.0",
         "train.kl_estimator=k3-clamped", "train.kl_bias_correction=true", "train.tis_mode=sequence-mask",
         "train.adv_baseline=leave-one-out", "train.normalize_adv_std=false"]
_METRICS = (*_COMPARED, "tis_weight_mean", "tis_capped_fraction", "mismatch_kl")
# The test batches' engine log-probs (-1.0) sit far above the tiny model's (about -6): engine ratios
# are about 0.0025, so caps there mask part of the tokens and rows, not none or all (measured 0.4-0.8
# of the tokens with SEQ_CAP, 0.03-0.3 with TOKEN_CAP).
SEQ_CAP, TOKEN_CAP = "train.tis_cap=0.0025", "train.tis_cap=0.003"


def _some_masked(metrics: list[dict]) -> bool:
    return any(0 < m["tis_capped_fraction"] < 1 for m in metrics)


def _assert_close_updates(run_a, run_b, tol: float) -> None:
    (metrics_a, weights_a), (metrics_b, weights_b) = run_a, run_b
    for a, b in zip(metrics_a, metrics_b, strict=True):
        for key in _METRICS:
            assert b[key] == pytest.approx(a[key], rel=tol, abs=1e-6), key
    for name, weight in weights_a.items():
        torch.testing.assert_close(weights_b[name], weight, rtol=tol, atol=tol)


@pytest.mark.parametrize("overrides", [[f"train.loss_agg={agg}"] for agg in sorted(AGGREGATIONS)]
                         + [["train.loss_agg=seq-mean-token-sum-norm", "train.loss_norm_tokens=7", *_MENU, SEQ_CAP],
                            ["train.tis_mode=token-mask", "train.kl_estimator=k2", "train.clip_eps_low=0.1",
                             TOKEN_CAP]],
                         ids=[*sorted(AGGREGATIONS), "menu", "token-mask-k2"])
def test_micro_batches_update_like_one_batch(tiny_model_dirs, overrides):
    """One row per micro-batch gives the metrics and LoRA weights of one micro-batch (<= 1e-5)."""
    model_dir = tiny_model_dirs["qwen2"]
    whole = _updates(model_dir, Dist(), 4, 3, [*_BASE, *overrides, "train.max_tokens_per_micro_batch="])
    split = _updates(model_dir, Dist(), 4, 3, [*_BASE, *overrides, "train.micro_batch_size=1"])
    _assert_close_updates(whole, split, tol=1e-5)
    assert _some_masked(whole[0]) == any("mask" in o for o in overrides)


@pytest.mark.parametrize("n_prompts, group, overrides", [
    (3, 3, ["train.loss_agg=seq-mean-token-sum"]),
    (3, 3, ["train.loss_agg=seq-mean-token-sum-norm", "train.micro_batch_size=2"]),
    (2, 3, ["train.loss_agg=seq-mean-token-sum-norm", *_MENU, "train.mini_batches=2", SEQ_CAP]),
])
def test_two_ranks_update_like_one(tiny_model_dirs, tmp_path, n_prompts, group, overrides):
    """FSDP2 over 2 CPU ranks: the losses, metrics and LoRA weights of one process (<= 1e-5)."""
    model_dir = tiny_model_dirs["qwen2"]
    mp.spawn(_rank_main, args=(model_dir, tmp_path, tmp_path / "rendezvous", n_prompts, group, overrides),
             nprocs=WORLD, join=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank: same kernels, same rounding
    try:
        single = _updates(model_dir, Dist(), n_prompts, group, overrides)
    finally:
        torch.set_num_threads(threads)
    sharded = (json.loads((tmp_path / "metrics.json").read_text()),
               safetensors.torch.load_file(tmp_path / "lora.safetensors"))
    assert all(m["grad_norm"] > 0 for m in single[0])
    _assert_close_updates(single, sharded, tol=1e-5)
    assert _some_masked(single[0]) == (SEQ_CAP in overrides)


def test_each_key_reaches_the_loss(tiny_model_dirs, monkeypatch):
    """The update hands every variant to the math: the loss options, the mismatch mode and cap, the
    advantage baseline and the aggregation with its constant length."""
    import graft.train.update as update
    seen = {}

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            seen.setdefault(name, (args, kwargs))
            return fn(*args, **kwargs)
        monkeypatch.setattr(update, name, wrapped)

    for name in ("grpo_loss", "mismatch_weights", "group_advantages"):
        spy(name, getattr(update, name))
    config = load_config(None, ["train.kl_coef=0.05", "train.tis_cap=1.5", "train.loss_agg=seq-mean-token-sum-norm",
                                "train.loss_norm_tokens=7", "train.clip_eps_low=0.1", *_MENU])
    model = trained_like_peft_model(tiny_model_dirs["qwen2"])
    policy_update(model, torch.optim.AdamW(lora_parameters(model).values(), lr=1e-3), _batch(2, 3), config.train,
                  pad_id=0)
    assert seen["grpo_loss"][1]["options"] == LossOptions(
        clip_eps_low=0.1, clip_eps_high=0.28, dual_clip_c=3.0, ratio_level="sequence", kl_estimator="k3-clamped",
        kl_bias_correction=True, norm_tokens=7)
    assert seen["grpo_loss"][1]["agg"] == "seq-mean-token-sum-norm"
    assert seen["grpo_loss"][1]["divisor"] == 6 * 7  # the whole batch's rows x the constant length
    assert seen["mismatch_weights"][0][3:] == ("sequence-mask", 1.5)
    assert seen["group_advantages"][1] == {"normalize_std": False, "std": "population", "baseline": "leave-one-out"}


def test_mismatch_metrics_every_step(tiny_model_dirs):
    """Without any correction the mismatch is still measured; the sequence mask drops whole rows."""
    model_dir = tiny_model_dirs["qwen2"]
    off, _ = _updates(model_dir, Dist(), 2, 3, ["train.tis_cap="])
    masked, _ = _updates(model_dir, Dist(), 2, 3, [SEQ_CAP, "train.tis_mode=sequence-mask"])
    for m in off:
        assert m["mismatch_kl"] > 0 and m["tis_weight_mean"] == 1.0 and m["tis_capped_fraction"] == 0.0
    assert 0 < masked[0]["tis_capped_fraction"] < 1  # some whole rows dropped, the others kept
    assert all(m["tis_weight_mean"] <= 0.0025 for m in masked)
    assert masked[0]["mismatch_kl"] == pytest.approx(off[0]["mismatch_kl"])  # before any step: the same model
