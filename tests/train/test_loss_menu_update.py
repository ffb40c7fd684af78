"""The objective menu through the whole update: every aggregation and variant gives the same update
micro-batched as in one batch (one process), and on 2 FSDP2 ranks as on one; each config key reaches
the loss; the mismatch metrics come back every step."""

import json

import pytest
import safetensors.torch
import torch
import torch.multiprocessing as mp

from graft.rl.aggregations import AGGREGATIONS
from graft.train.distributed import Dist
from tests.train.test_distributed import _COMPARED, WORLD, _rank_main, _updates

# Several optimizer steps per batch (the ratio moves off 1, the clip and the old policy matter) and
# the engine's log-probs (-1.0 per token in the test batches) far from the trainer's: every
# correction acts.
_BASE = ["train.mini_batches=2", "train.epochs=2", "train.tis_cap=2.0", "train.lr=1e-3"]
_MENU = ["train.ratio_level=sequence", "train.clip_eps_high=0.28", "train.dual_clip_c=3.0",
         "train.kl_estimator=k3-clamped", "train.kl_bias_correction=true", "train.tis_mode=sequence-mask",
         "train.adv_baseline=leave-one-out", "train.normalize_adv_std=false"]
_METRICS = (*_COMPARED, "tis_weight_mean", "tis_capped_fraction", "mismatch_kl")


def _assert_close_updates(run_a, run_b, tol: float) -> None:
    (metrics_a, weights_a), (metrics_b, weights_b) = run_a, run_b
    for a, b in zip(metrics_a, metrics_b, strict=True):
        for key in _METRICS:
            assert b[key] == pytest.approx(a[key], rel=tol, abs=1e-6), key
    for name, weight in weights_a.items():
        torch.testing.assert_close(weights_b[name], weight, rtol=tol, atol=tol)


@pytest.mark.parametrize("overrides", [[f"train.loss_agg={agg}"] for agg in sorted(AGGREGATIONS)]
                         + [["train.loss_agg=seq-mean-token-sum-norm", "train.loss_norm_tokens=7", *_MENU],
                            ["train.tis_mode=token-mask", "train.kl_estimator=k2", "train.clip_eps_low=0.1"]],
                         ids=[*sorted(AGGREGATIONS), "menu", "token-mask-k2"])
def test_micro_batches_update_like_one_batch(tiny_model_dirs, overrides):
    """One row per micro-batch gives the metrics and LoRA weights of one micro-batch (<= 1e-5)."""
    model_dir = tiny_model_dirs["qwen2"]
    whole = _updates(model_dir, Dist(), 4, 3, [*_BASE, *overrides, "train.max_tokens_per_micro_batch="])
    split = _updates(model_dir, Dist(), 4, 3, [*_BASE, *overrides, "train.micro_batch_size=1"])
    _assert_close_updates(whole, split, tol=1e-5)


@pytest.mark.parametrize("n_prompts, group, overrides", [
    (3, 3, ["train.loss_agg=seq-mean-token-sum"]),
    (3, 3, ["train.loss_agg=seq-mean-token-sum-norm", "train.micro_batch_size=2"]),
    (2, 3, ["train.loss_agg=seq-mean-token-sum-norm", *_MENU, "train.mini_batches=2", "train.tis_cap=1.5"]),
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


_DEFAULT_RUNS: dict = {}  # the default objective's run, shared by the cases below


@pytest.mark.parametrize("override", _MENU + ["train.loss_agg=seq-mean-token-sum", "train.tis_mode=token-mask",
                                              "train.kl_estimator=k1", "train.clip_eps_low=0.05"])
def test_each_key_reaches_the_update(tiny_model_dirs, override):
    """Each variant changes the update's losses or weights: the key is wired through to the loss."""
    model_dir = tiny_model_dirs["qwen2"]
    if model_dir not in _DEFAULT_RUNS:
        _DEFAULT_RUNS[model_dir] = _updates(model_dir, Dist(), 4, 3, [*_BASE, "train.tis_cap=1.2"])
    base = _DEFAULT_RUNS[model_dir]
    varied = _updates(model_dir, Dist(), 4, 3, [*_BASE, "train.tis_cap=1.2", override])
    assert [m["loss"] for m in varied[0]] != [m["loss"] for m in base[0]] or any(
        not torch.equal(varied[1][name], weight) for name, weight in base[1].items())


def test_mismatch_metrics_every_step(tiny_model_dirs):
    """Without any correction the mismatch is still measured; the sequence mask drops whole rows."""
    model_dir = tiny_model_dirs["qwen2"]
    off, _ = _updates(model_dir, Dist(), 2, 2, ["train.tis_cap="])
    masked, _ = _updates(model_dir, Dist(), 2, 2, ["train.tis_cap=1.5", "train.tis_mode=sequence-mask"])
    for m in off:
        assert m["mismatch_kl"] > 0 and m["tis_weight_mean"] == 1.0 and m["tis_capped_fraction"] == 0.0
    for m, o in zip(masked, off):
        assert 0 <= m["tis_capped_fraction"] <= 1 and m["tis_weight_mean"] <= 1.5
    assert masked[0]["mismatch_kl"] == pytest.approx(off[0]["mismatch_kl"])  # before any step: the same model
