"""The objective menu through the whole update: every aggregation and variant gives the same update
micro-batched as in one batch (one process), and on 2 FSDP2 ranks as on one; each config key reaches
the loss; the mismatch metrics come back every step."""
# On 2 shared cores (one thread a process, tests/conftest.py): ~1.5 s a micro-batch case; the 4
# two-rank cases ~10 s together, in one spawn.

import json

import pytest
import safetensors.torch
import torch

from graft.config import load_config
from graft.lora.attach import adapter_disabled, lora_parameters
from graft.parallel.dist import Dist
from graft.rl.aggregations import AGGREGATIONS
from graft.rl.losses import LossOptions
from graft.train.update import policy_update
from tests.helpers import assert_adam_weights_close, trained_like_peft_model
from tests.parallel.test_parallelize import _COMPARED, WORLD, _batch, _lr, _updates, run_cases_on_ranks

# Two optimizer steps per batch (the second mini-batch's ratio is off 1: the clip and the old policy matter) and
# the engine's log-probs (-1.0 per token in the test batches) far from the trainer's: every
# correction acts.
_BASE = ["train.mini_batches=2", "train.tis_cap=2.0", "train.lr=1e-3"]
_MENU = ["train.ratio_level=sequence", "train.clip_eps_high=0.28", "train.dual_clip_c=3.0",
         "train.kl_estimator=k3-clamped", "train.kl_bias_correction=true", "train.tis_mode=sequence-mask",
         "train.adv_baseline=leave-one-out", "train.normalize_adv_std=false"]
_METRICS = (*_COMPARED, "tis_weight_mean", "tis_capped_fraction", "mismatch_kl")
_SHAPING_METRICS = ("reward_kl_penalty", "loss_rows")
# The test batches' engine log-probs (-1.0) sit far above the tiny model's (about -6): engine ratios
# are about 0.0025, so caps there mask part of the tokens and rows, not none or all (measured 0.4-0.8
# of the tokens with SEQ_CAP, 0.03-0.3 with TOKEN_CAP).
SEQ_CAP, TOKEN_CAP = "train.tis_cap=0.0025", "train.tis_cap=0.003"
# The truncated completions (the test batches' longest) out of the loss, the KL (k1) in the reward.
_FILTERS = ["train.overlong_filter=true", "train.kl_in=reward", "train.kl_estimator=k1",
            "train.loss_agg=seq-mean-token-mean"]


def _some_masked(metrics: list[dict]) -> bool:
    return any(0 < m["tis_capped_fraction"] < 1 for m in metrics)


def _assert_close_updates(run_a, run_b, lr: float, rel: float = 1e-5) -> None:
    """The same metrics (<= `rel`) and LoRA weights (within Adam's rounding) from sums in another order."""
    (metrics_a, weights_a), (metrics_b, weights_b) = run_a, run_b
    for a, b in zip(metrics_a, metrics_b, strict=True):
        for key in _METRICS + tuple(k for k in _SHAPING_METRICS if k in a):
            assert b[key] == pytest.approx(a[key], rel=rel, abs=1e-6), key
    assert_adam_weights_close(weights_b, weights_a, lr)


@pytest.mark.parametrize("overrides", [[f"train.loss_agg={agg}"] for agg in sorted(AGGREGATIONS)]
                         + [["train.loss_agg=seq-mean-token-sum-norm", "train.loss_norm_tokens=7", *_MENU, SEQ_CAP],
                            ["train.tis_mode=token-mask", "train.kl_estimator=k2", "train.clip_eps_low=0.1",
                             TOKEN_CAP],
                            _FILTERS],
                         ids=[*sorted(AGGREGATIONS), "menu", "token-mask-k2", "overlong-filter-kl-in-reward"])
def test_micro_batches_update_like_one_batch(tiny_model_dirs, overrides):
    """One row per micro-batch gives the metrics and LoRA weights of one micro-batch (<= 1e-5)."""
    model_dir = tiny_model_dirs["qwen2"]
    whole = _updates(model_dir, Dist(), 4, 3, [*_BASE, *overrides, "train.max_tokens_per_micro_batch="])
    split = _updates(model_dir, Dist(), 4, 3, [*_BASE, *overrides, "train.micro_batch_size=1"])
    _assert_close_updates(whole, split, _lr([*_BASE, *overrides]))
    assert _some_masked(whole[0]) == any("mask" in o for o in overrides)


# name -> (n_prompts, group, overrides, rel): 2 FSDP2 ranks against one process.
TWO_RANK_CASES = {
    "token-sum": (3, 3, ["train.loss_agg=seq-mean-token-sum"], 1e-5),
    "token-sum-norm": (3, 3, ["train.loss_agg=seq-mean-token-sum-norm", "train.micro_batch_size=2"], 1e-5),
    "menu": (2, 3, ["train.loss_agg=seq-mean-token-sum-norm", *_MENU, "train.mini_batches=2", SEQ_CAP], 1e-5),
    # The KL sums reach the advantages from log-probs computed in other layouts per rank (prompts
    # shared by other rows): a group whose rewards tie has a std made of KL sums alone, and dividing
    # by it moved the loss 3e-5 apart (1.5e-6 of 0.051); a layout bug moves it by ~1e-2.
    "filters": (3, 3, [*_FILTERS, "train.mini_batches=2", "train.lr=1e-3"], 1e-4),
}


@pytest.fixture(scope="module")
def two_rank_runs(tiny_model_dirs, tmp_path_factory):
    """Every TWO_RANK_CASES case on 2 ranks, in one spawn; each case's results in its own directory."""
    root, model_dir = tmp_path_factory.mktemp("two-ranks"), tiny_model_dirs["qwen2"]
    run_cases_on_ranks(WORLD, None, [(model_dir, root / name, n, g, o) for name, (n, g, o, _) in TWO_RANK_CASES.items()],
                       root)
    return root


@pytest.mark.parametrize("name", TWO_RANK_CASES)
def test_two_ranks_update_like_one(tiny_model_dirs, two_rank_runs, name):
    """FSDP2 over 2 CPU ranks: the losses, metrics and LoRA weights of one process (<= 1e-5)."""
    n_prompts, group, overrides, rel = TWO_RANK_CASES[name]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank: same kernels, same rounding
    try:
        single = _updates(tiny_model_dirs["qwen2"], Dist(), n_prompts, group, overrides)
    finally:
        torch.set_num_threads(threads)
    sharded = (json.loads((two_rank_runs / name / "metrics.json").read_text()),
               safetensors.torch.load_file(two_rank_runs / name / "lora.safetensors"))
    assert all(m["grad_norm"] > 0 for m in single[0])
    _assert_close_updates(single, sharded, _lr(overrides), rel)
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
    (inputs,), _ = seen["grpo_loss"]
    assert inputs.options == LossOptions(
        clip_eps_low=0.1, clip_eps_high=0.28, dual_clip_c=3.0, ratio_level="sequence", kl_coef=0.05,
        kl_estimator="k3-clamped", kl_bias_correction=True, agg="seq-mean-token-sum-norm", norm_tokens=7)
    assert inputs.options.agg == "seq-mean-token-sum-norm"
    assert inputs.divisor == 6 * 7  # the whole batch's rows x the constant length
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


def _one_update(model_dir, batch, overrides: list[str]) -> tuple[dict, dict]:
    config = load_config(None, ["train.kl_coef=0.05", "train.lr=1e-2", *overrides])
    model = trained_like_peft_model(model_dir)
    metrics = policy_update(model, torch.optim.AdamW(lora_parameters(model).values(), lr=1e-2), batch, config.train,
                            pad_id=0)
    return metrics, {name: p.detach().clone() for name, p in lora_parameters(model).items()}


def test_overlong_filter_leaves_truncated_completions_out_of_the_loss(tiny_model_dirs):
    """Under the filter, what a truncated completion says cannot move the update (its reward still
    counts in its group's baseline); without it, it does. All truncated: no optimizer step."""
    model_dir = tiny_model_dirs["qwen2"]
    batch = _batch(3, 3)
    cut = [r for r, t in enumerate(batch.truncated) if t]
    assert 0 < len(cut) < len(batch.sequences)
    other = [(p, [7] * len(c)) if r in cut else (p, c) for r, (p, c) in enumerate(batch.sequences)]
    changed = type(batch)(other, batch.engine_logprobs, batch.rewards_PG, 0, 0.0, batch.truncated)
    on = ["train.overlong_filter=true", "train.mini_batches=2"]
    (metrics, weights), (metrics_changed, weights_changed) = (_one_update(model_dir, b, on) for b in (batch, changed))
    assert metrics["loss_rows"] == len(batch.sequences) - len(cut) and metrics["optimizer_steps"] == 2
    assert metrics_changed["loss"] == pytest.approx(metrics["loss"], abs=1e-7)
    for name, weight in weights.items():
        torch.testing.assert_close(weights_changed[name], weight, rtol=0, atol=1e-7)
    _, off, _, off_changed = (*_one_update(model_dir, batch, on[1:]), *_one_update(model_dir, changed, on[1:]))
    assert any(not torch.allclose(off[n], off_changed[n], atol=1e-5) for n in off)

    all_cut = type(batch)(batch.sequences, batch.engine_logprobs, batch.rewards_PG, 0, 0.0,
                          (True,) * len(batch.sequences))
    metrics, weights = _one_update(model_dir, all_cut, on)
    untouched = {name: p.detach() for name, p in lora_parameters(trained_like_peft_model(model_dir)).items()}
    assert metrics["optimizer_steps"] == 0 and metrics["loss_rows"] == 0
    assert all(torch.equal(weights[n], untouched[n]) for n in weights)


def _completion_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
    return logprobs[positions, torch.tensor(completion)]


def test_kl_in_the_reward_takes_each_completions_summed_kl_off_its_reward(tiny_model_dirs, monkeypatch):
    """`kl_in: reward`: the advantages see `r - kl_coef * sum_t k1(policy, base)` (the sampling policy's
    log-probs, PPO-RLHF's penalty), and the loss has no KL term of its own."""
    import graft.train.update as update
    seen = {}
    for name in ("group_advantages", "grpo_loss"):
        real = getattr(update, name)
        monkeypatch.setattr(update, name, lambda *a, _real=real, _name=name, **k: (
            seen.setdefault(_name, (a, k)), _real(*a, **k))[1])
    model_dir = tiny_model_dirs["qwen2"]
    batch = _batch(2, 3)
    metrics, _ = _one_update(model_dir, batch, ["train.kl_in=reward", "train.kl_estimator=k1"])

    model = trained_like_peft_model(model_dir)
    kl_R = []
    for prompt, completion in batch.sequences:
        policy = _completion_logprobs(model, prompt, completion)
        with adapter_disabled(model):
            base = _completion_logprobs(model, prompt, completion)
        kl_R.append((policy - base).sum().item())
    want_PG = batch.rewards_PG - 0.05 * torch.tensor(kl_R).view(2, 3)
    torch.testing.assert_close(seen["group_advantages"][0][0], want_PG, rtol=0, atol=1e-5)
    assert metrics["reward_kl_penalty"] == pytest.approx(0.05 * sum(kl_R) / 6, abs=1e-6)
    assert seen["grpo_loss"][0][0].options.kl_coef == 0.0  # still measured: the token mean of the same estimates
    assert metrics["kl"] == pytest.approx(sum(kl_R) / batch.tokens, abs=1e-6)
