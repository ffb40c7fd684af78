"""The loss mask of multi-turn episodes, token by token: over random episodes (random turns and turn
lengths) an environment or template token has zero gradient through the loss, KL, entropy and TIS,
and no value at it changes the loss, the metrics or the update; every model token has a gradient; the
aggregations count model tokens only; and an all-model mask is the single-turn batch exactly."""

import random
from dataclasses import replace

import pytest
import torch

import graft.train.update as update_module
from graft.config import load_config
from graft.lora.attach import lora_parameters
from graft.rl.advantages import group_advantages
from graft.train.rollout_batch import RolloutBatch
from graft.train.update import policy_update
from tests.helpers import trained_like_peft_model


def _episodes(n_prompts: int, group: int, seed: int) -> RolloutBatch:
    """Random multi-turn sequences: 1-3 model turns of 1-5 tokens, environment turns of 1-4 between them."""
    rng = random.Random(seed)
    sequences, logprobs, masks = [], [], []
    for _ in range(n_prompts * group):
        prompt = [rng.randint(3, 200) for _ in range(rng.randint(2, 6))]
        completion, mask = [], []
        for turn in range(rng.randint(1, 3)):
            if turn:
                env = rng.randint(1, 4)
                completion += [rng.randint(3, 200) for _ in range(env)]
                mask += [False] * env
            model = rng.randint(1, 5)
            completion += [rng.randint(3, 200) for _ in range(model)]
            mask += [True] * model
        sequences.append((prompt, completion))
        masks.append(mask)
        logprobs.append([-rng.uniform(0.5, 6.0) if m else 0.0 for m in mask])
    # Distinct rewards in every group: every row has a nonzero advantage.
    rewards_PG = torch.tensor([rng.sample(range(10), group) for _ in range(n_prompts)], dtype=torch.float32)
    return RolloutBatch(sequences, logprobs, rewards_PG, version=0, seconds=0.0,
                        truncated=(False,) * len(sequences), loss_masks=masks)


def _update(model_dir, batch, overrides):
    config = load_config(None, ["train.lr=1e-2", *overrides])
    model = trained_like_peft_model(model_dir)
    optimizer = torch.optim.AdamW(lora_parameters(model).values(), lr=config.train.lr)
    metrics = policy_update(model, optimizer, batch, config.train, pad_id=0)
    return metrics, {n: p.detach().clone() for n, p in lora_parameters(model).items()}


_ALL_TERMS = ["train.kl_coef=0.05", "train.entropy_coef=0.01", "train.tis_cap=2.0"]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("layout", [["train.pack_sequences=true"], ["train.pack_sequences=false",
                                                                     "train.micro_batch_size=3"]])
def test_only_model_tokens_get_a_gradient(base_dir, monkeypatch, seed, layout):
    captured, real = [], update_module.completion_logprobs

    def spy(model, micro, train, with_entropy=False):
        logprobs_BC, entropy_BC = real(model, micro, train, with_entropy)
        if with_entropy:  # the loss's forward
            logprobs_BC.retain_grad()
            entropy_BC.retain_grad()
            captured.append((micro.rows, logprobs_BC, entropy_BC))
        return logprobs_BC, entropy_BC

    monkeypatch.setattr(update_module, "completion_logprobs", spy)
    batch = _episodes(3, 3, seed)
    _update(base_dir, batch, [*_ALL_TERMS, f"train.loss_agg={random.Random(seed).choice(_AGGS)}", *layout])
    checked = 0
    for rows, logprobs_BC, entropy_BC in captured:
        for b, r in enumerate(rows):
            for t, is_model in enumerate(batch.loss_masks[r]):
                for grad in (logprobs_BC.grad[b, t], entropy_BC.grad[b, t]):
                    assert (grad != 0).item() == is_model, (r, t, is_model, grad)
                checked += 1
    assert checked == sum(len(m) for m in batch.loss_masks) and checked > sum(map(sum, batch.loss_masks))


_AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def test_values_at_environment_tokens_change_nothing(base_dir):
    """The engine gives no log-prob at an environment token: whatever placeholder sits there (even a
    huge one, which TIS would weigh without the mask) leaves the update and its metrics as they were."""
    batch = _episodes(3, 3, seed=1)
    wild = [[lp if m else 1e4 for lp, m in zip(lps, mask)]
            for lps, mask in zip(batch.engine_logprobs, batch.loss_masks)]
    overrides = [*_ALL_TERMS, "train.mini_batches=2"]
    metrics, weights = _update(base_dir, batch, overrides)
    metrics_wild, weights_wild = _update(base_dir, replace(batch, engine_logprobs=wild), overrides)
    for key in ("loss", "kl", "entropy", "tis_weight_mean", "mismatch_kl", "grad_norm", "logprob_abs_diff_max"):
        assert metrics_wild[key] == metrics[key], key
    assert all(torch.equal(weights[n], weights_wild[n]) for n in weights)
    assert metrics["logprob_abs_diff_max"] < 10  # placeholders (0.0) are not compared with the trainer's


@pytest.mark.parametrize("agg", _AGGS)
def test_aggregations_count_model_tokens_only(base_dir, agg):
    """At ratio 1 without KL, entropy or TIS each model token's loss is -A, so the loss is -sum_b A_b c_b / D
    with c_b and D from the model-token counts m_b: token-mean m_b / sum m; seq-mean-token-mean 1 / B;
    seq-mean-token-sum m_b / B; seq-mean-token-sum-norm m_b / (B x norm)."""
    batch = _episodes(4, 3, seed=2)
    metrics, _ = _update(base_dir, batch, [f"train.loss_agg={agg}", "rollout.max_new_tokens=16"])
    adv_B = group_advantages(batch.rewards_PG).flatten()
    m_B = torch.tensor([sum(mask) for mask in batch.loss_masks], dtype=torch.float32)
    rows = len(m_B)
    per_row, divisor = {"token-mean": (m_B, m_B.sum()), "seq-mean-token-mean": (torch.ones(rows), rows),
                        "seq-mean-token-sum": (m_B, rows), "seq-mean-token-sum-norm": (m_B, rows * 16)}[agg]
    assert metrics["loss"] == pytest.approx((-(adv_B * per_row).sum() / divisor).item(), rel=1e-5, abs=1e-7)


def test_a_mask_of_model_tokens_only_is_the_single_turn_batch(base_dir):
    batch = _episodes(2, 3, seed=3)
    single = replace(batch, loss_masks=None)
    all_model = replace(batch, loss_masks=[[True] * len(c) for _, c in batch.sequences])
    overrides = [*_ALL_TERMS, "train.mini_batches=2"]
    metrics, weights = _update(base_dir, single, overrides)
    metrics_masked, weights_masked = _update(base_dir, all_model, overrides)
    assert {k: v for k, v in metrics_masked.items() if k != "train_seconds"} == \
        {k: v for k, v in metrics.items() if k != "train_seconds"}
    assert all(torch.equal(weights[n], weights_masked[n]) for n in weights)


def test_truncated_episodes_leave_the_loss_under_data_truncated_mask(base_dir):
    batch = _episodes(2, 3, seed=4)
    cut = replace(batch, truncated=(True, False, False, True, True, True))
    metrics = _update(base_dir, replace(cut, mask_truncated=True), [])[0]
    assert metrics["loss_rows"] == 2  # the group whose every episode was cut leaves the update; its rewards stay
    assert _update(base_dir, cut, [])[0]["loss_rows"] == 6
