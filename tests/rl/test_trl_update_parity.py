"""graft's update is TRL's: the same rollout batches through graft's `policy_update` and through TRL's
real GRPOTrainer (its own loss, backward, clipping and AdamW step) from the same LoRA initialisation
end at the same LoRA weights. With equal batches the two learn alike per batch; what else differs
between them in `graft bench learning` is the sampling (vLLM against HF generate).

Settings as the benches set both sides (`graft.bench.trl.worker.trl_arguments`): one optimizer step
per batch, token-mean ("dapo") loss, clip 0.2, no KL, grad clip 1.0, AdamW with weight decay 0.01,
group-std advantages with the sample std (TRL's; graft's default is the population std).
"""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file

from graft.bench.trl.env import run_trl, trl_python
from graft.config import load_config
from graft.lora.attach import attach_lora, lora_parameters
from graft.models.cache import default_cache_dir
from graft.models.loading import load_model
from graft.train.rollout_batch import RolloutBatch
from graft.train.update import policy_update

PROMPTS, SAMPLES, STEPS, LR, RANK = 2, 4, 3, 1e-3, 4
REWARDS = [0.0, 0.3, 0.6, 1.0]  # one group's rewards, in some order


def _batches(vocab: int) -> list[tuple[list, list]]:
    """STEPS rollout batches of random tokens (ids >= 3: never the padding id 0); each group's rewards
    are a permutation of the same values, so every group has the same std. TRL adds 1e-4 to a group's
    std, graft 1e-6: with equal stds that is one factor for every advantage, which Adam's step does not
    see; with unequal ones it reweights the groups by ~1e-4 relative, and Adam's normalisation blows
    that up on elements whose gradient nearly cancels (measured: one of 256 moved 0.28 lr on one side,
    0.68 lr on the other)."""
    rng = random.Random(0)
    batches = []
    for _ in range(STEPS):
        rows = []
        for _ in range(PROMPTS):
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 6))]
            rows += [(prompt, [rng.randrange(3, vocab) for _ in range(rng.randint(2, 7))]) for _ in range(SAMPLES)]
        rewards_PG = [rng.sample(REWARDS, SAMPLES) for _ in range(PROMPTS)]
        batches.append((rows, rewards_PG))
    return batches


def _token_logprobs(model, rows) -> list[list[float]]:
    """The model's log-prob of each completion token (the engine's, for an on-policy batch)."""
    out = []
    with torch.no_grad():
        for prompt, completion in rows:
            logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1]
            out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist())
    return out


@pytest.mark.trl
def test_grafts_update_ends_where_trls_grpo_trainer_does_on_the_same_batches(base_dir, tmp_path):
    model = attach_lora(load_model(base_dir), rank=RANK, alpha=2.0 * RANK, seed=0)
    initial = {name: p.detach().clone() for name, p in lora_parameters(model).items()}
    batches = _batches(model.config.vocab_size)
    spec = {"base": str(base_dir), "rank": RANK, "alpha": 2.0 * RANK, "seed": 0, "samples": SAMPLES, "lr": LR,
            "batches": batches}
    trl = run_trl(trl_python(default_cache_dir()), spec, tmp_path / "trl", module="tests.rl.trl_update_worker")
    assert trl["optimizer_steps"] == STEPS

    train = load_config(None, [f"train.lr={LR}", "train.mini_batches=1", "train.adv_std=sample"]).train
    optimizer = torch.optim.AdamW(lora_parameters(model).values(), lr=LR)
    for step, (rows, rewards_PG) in enumerate(batches, 1):
        batch = RolloutBatch(rows, _token_logprobs(model, rows), torch.tensor(rewards_PG), version=step - 1,
                             seconds=0.0)
        policy_update(model, optimizer, batch, train, pad_id=0, step=step)

    graft_weights, trl_weights = lora_parameters(model), load_file(trl["weights"])
    assert graft_weights.keys() == trl_weights.keys()
    moved = sum((graft_weights[k].detach() - initial[k]).norm() ** 2 for k in initial) ** 0.5
    apart = sum((graft_weights[k].detach() - trl_weights[k]).norm() ** 2 for k in initial) ** 0.5
    assert moved > 0.01  # every step moved the adapter: B from zero, then A
    assert any(not torch.equal(graft_weights[k], initial[k]) for k in initial if "lora_A" in k)
    assert apart / moved < 1e-4, f"graft's update is {apart / moved:.2e} of its length away from TRL's"
