"""The update runs only the forward passes it needs: one per micro-batch for a single optimizer step
without KL (the loss's forward is also the old policy), plus a reference pass when the KL is in the
loss, plus an old-policy pass when several optimizer steps need it. The loss is the same either way."""

import pytest
import torch

from graft.config import load_config
from graft.lora.attach import lora_parameters
from graft.train.update import _mini_batches, policy_update
from tests.helpers import trained_like_peft_model
from tests.parallel.test_parallelize import _batch


def _forwards_and_metrics(model_dir, overrides: list[str]) -> tuple[int, dict]:
    config = load_config(None, ["train.lr=1e-2", *overrides])
    model = trained_like_peft_model(model_dir)
    optimizer = torch.optim.AdamW(lora_parameters(model).values(), lr=config.train.lr)
    calls = []
    handle = model.get_base_model().model.register_forward_hook(lambda *_: calls.append(1))
    try:
        metrics = policy_update(model, optimizer, _batch(4, 3), config.train, pad_id=0)
    finally:
        handle.remove()
    return len(calls), metrics


@pytest.mark.parametrize(("overrides", "forwards"), [
    ([], 1),                                             # one step, no KL: the loss's own forward only
    (["train.kl_coef=0.05"], 2),                         # + the reference (adapter disabled)
    (["train.mini_batches=2"], 1 + 2),                   # + old policy once; one forward per mini-batch
    (["train.micro_batch_size=4"], 3),                   # 12 rows in micro-batches of 4
])
def test_update_runs_only_the_forward_passes_it_needs(base_dir, overrides, forwards):
    calls, metrics = _forwards_and_metrics(base_dir, overrides)
    assert calls == forwards
    assert (metrics["kl"] is None) == ("train.kl_coef=0.05" not in overrides)


def test_single_step_measures_the_engine_gap_from_the_loss_forward(base_dir):
    """The |engine - trainer| gap is taken before any optimizer step either way."""
    _, single = _forwards_and_metrics(base_dir, [])
    _, with_old_pass = _forwards_and_metrics(base_dir, ["train.mini_batches=2"])
    assert single["logprob_abs_diff_max"] == pytest.approx(with_old_pass["logprob_abs_diff_max"], abs=1e-6)
    assert single["logprob_abs_diff_max"] > 0
    assert single["ratio_mean"] == pytest.approx(1.0) and single["clip_fraction"] == 0.0


def test_adv_std_reaches_the_advantages(base_dir):
    """At ratio 1 the loss is linear in the advantages: the sample std scales it by sqrt((G-1)/G)."""
    _, population = _forwards_and_metrics(base_dir, [])
    _, sample = _forwards_and_metrics(base_dir, ["train.adv_std=sample"])
    assert population["loss"] != 0
    assert sample["loss"] == pytest.approx(population["loss"] * (2 / 3) ** 0.5, rel=1e-5)


def _poisoned_update(model_dir, on_nonfinite: str):
    """An update whose loss is NaN (an infinite reward makes the group's advantages NaN)."""
    from dataclasses import replace

    # Whole groups in order: the poisoned group lands in the first mini-batch only.
    config = load_config(None, ["train.mini_batches=2", "train.shuffle_mini_batches=false",
                                f"train.on_nonfinite={on_nonfinite}"])
    model = trained_like_peft_model(model_dir)
    before = {n: p.detach().clone() for n, p in lora_parameters(model).items()}
    optimizer = torch.optim.AdamW(lora_parameters(model).values(), lr=1e-2)
    batch = _batch(4, 3)
    rewards_PG = batch.rewards_PG.clone()
    rewards_PG[0, 0] = float("inf")  # poisons the first prompt's group, so the first mini-batch only
    return model, before, lambda: policy_update(model, optimizer, replace(batch, rewards_PG=rewards_PG),
                                                config.train, pad_id=0)


def test_a_nonfinite_gradient_stops_the_update_before_any_weight_changes(base_dir):
    from graft.train.update import NonFiniteUpdateError

    model, before, update = _poisoned_update(base_dir, "error")
    with pytest.raises(NonFiniteUpdateError, match="gradient norm is nan.*train.on_nonfinite=skip"):
        update()
    assert all(torch.equal(p, before[n]) for n, p in lora_parameters(model).items())


def test_a_nonfinite_step_can_be_skipped_and_counted(base_dir):
    model, before, update = _poisoned_update(base_dir, "skip")
    metrics = update()
    assert metrics["skipped_nonfinite_steps"] == 1 and metrics["optimizer_steps"] == 1
    assert torch.isfinite(torch.tensor(metrics["grad_norm"]))  # the finite step's norm only
    after = lora_parameters(model)
    assert all(torch.isfinite(p).all() for p in after.values())
    assert any(not torch.equal(p, before[n]) for n, p in after.items())  # the healthy mini-batch was applied


def test_the_update_never_holds_more_than_one_chunk_of_float32_vocab_logits():
    """At a real vocabulary (151,936) the update's largest float32 `[.., vocab]` tensor, forward and
    backward, KL and entropy bonus on, is one chunk's: never the `[tokens, vocab]` of the batch."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from graft.lora.attach import attach_lora
    from graft.train.rollout_batch import RolloutBatch

    vocab, chunk = 151_936, 16
    torch.manual_seed(0)
    base = Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))
    model = attach_lora(base, rank=4, alpha=8, seed=0)
    g = torch.Generator().manual_seed(0)
    # 136 completion tokens: 8.5 chunks
    sequences = [(torch.randint(3, vocab, (12,), generator=g).tolist(),
                  torch.randint(3, vocab, (n,), generator=g).tolist()) for n in (40, 25, 40, 31)]
    batch = RolloutBatch(sequences, [[-5.0] * len(c) for _, c in sequences], torch.tensor([[0.0, 1.0], [1.0, 0.5]]),
                         version=0, seconds=0.0)
    config = load_config(None, [f"train.logit_chunk_tokens={chunk}", "train.kl_coef=0.05", "train.entropy_coef=0.01",
                                "train.tis_cap=2.0", "train.mini_batches=2"])

    class LargestVocabTensor(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() and t.shape[-1] == vocab
                        and not func.is_view):  # a transposed view of the head weight allocates nothing
                    type(self).largest = max(type(self).largest, t.numel() // vocab)
            return out

    optimizer = torch.optim.AdamW(lora_parameters(model).values(), lr=1e-3)
    with LargestVocabTensor():
        metrics = policy_update(model, optimizer, batch, config.train, pad_id=0)
    assert metrics["optimizer_steps"] == 2 and metrics["entropy"] > 0
    assert 0 < LargestVocabTensor.largest <= chunk  # rows of vocab logits alive at once


def test_micro_batches_respect_the_token_budget_and_the_row_limit():
    from graft.train.micro_batches import micro_batches
    from graft.train.rollout_batch import RolloutBatch

    lengths = [(3, 2), (2, 2), (6, 4), (1, 1), (4, 4), (2, 1)]  # sequence lengths 5, 4, 10, 2, 8, 3
    batch = RolloutBatch([([1] * p, [2] * c) for p, c in lengths], [[0.0] * c for _, c in lengths],
                         torch.zeros(2, 3), version=0, seconds=0.0)
    config = load_config(None, ["train.max_tokens_per_micro_batch=16", "train.pack_sequences=false"])
    # in order, greedy: 2x5, 10 alone, 2x8, then 3 (3x8 would pass 16)
    assert micro_batches(list(range(6)), batch, config.train) == [[0, 1], [2], [3, 4], [5]]
    # packed, the budget counts packed rows x longest: 5 | 4 (2x5), then 10 | 5+4 (2x10) fits 20; 8 | 3+2 (2x8)
    config = load_config(None, ["train.max_tokens_per_micro_batch=20", "train.pack_sequences=false"])
    assert micro_batches(list(range(6)), batch, config.train) == [[0, 1], [2, 3], [4, 5]]
    config = load_config(None, ["train.max_tokens_per_micro_batch=20", "train.pack_sequences=true"])
    assert micro_batches(list(range(6)), batch, config.train) == [[0, 1, 2], [3, 4, 5]]
    config = load_config(None, ["train.max_tokens_per_micro_batch=100", "train.micro_batch_size=2"])
    assert micro_batches(list(range(6)), batch, config.train) == [[0, 1], [2, 3], [4, 5]]
    config = load_config(None, ["train.max_tokens_per_micro_batch=", "train.micro_batch_size="])
    assert micro_batches(list(range(6)), batch, config.train) == [list(range(6))]


def test_mini_batches_of_whole_groups_keep_each_prompts_samples_together():
    assert _mini_batches(5, 2, 2) == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9]]
    assert _mini_batches(5, 2, 2, left_out=frozenset({1, 6, 7})) == [[0, 2, 3, 4, 5], [8, 9]]


def test_shuffled_mini_batches_deal_every_row_once_evenly_and_the_same_for_the_same_seed():
    minis = _mini_batches(32, 8, 4, shuffle_seed=7)
    assert sorted(r for rows in minis for r in rows) == list(range(256))
    assert [len(rows) for rows in minis] == [64] * 4 and all(rows == sorted(rows) for rows in minis)
    assert _mini_batches(32, 8, 4, shuffle_seed=7) == minis  # every rank, and a resumed run, deal the same
    assert _mini_batches(32, 8, 4, shuffle_seed=8) != minis
    # Each optimizer step sees samples of most prompts, not all 8 samples of a quarter of them.
    prompts_per_step = [len({r // 8 for r in rows}) for rows in minis]
    assert min(prompts_per_step) > 16
    odd = _mini_batches(5, 3, 2, left_out=frozenset({0, 14}), shuffle_seed=1)
    assert sorted(r for rows in odd for r in rows) == list(range(1, 14))
    assert [len(rows) for rows in _mini_batches(5, 3, 2, shuffle_seed=1)] == [8, 7]


def test_the_update_deals_its_mini_batches_by_step(base_dir):
    """With shuffle_mini_batches the step seeds the deal: the same step repeats the update exactly, another
    step deals (and so updates) differently; with whole groups the step does not matter."""
    def lora_after(step, *overrides):
        config = load_config(None, ["train.lr=1e-2", "train.mini_batches=2", *overrides])
        model = trained_like_peft_model(base_dir)
        optimizer = torch.optim.AdamW(lora_parameters(model).values(), lr=config.train.lr)
        policy_update(model, optimizer, _batch(4, 3), config.train, pad_id=0, step=step)
        return torch.cat([p.detach().flatten() for p in lora_parameters(model).values()])

    assert torch.equal(lora_after(3), lora_after(3))
    assert not torch.allclose(lora_after(3), lora_after(4))
    groups = "train.shuffle_mini_batches=false"
    assert torch.equal(lora_after(3, groups), lora_after(4, groups))
