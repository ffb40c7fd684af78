"""Seeded rollouts: every sample of a batch draws its own random numbers (an identical prompt twice
in a batch gets different samples), and the same seed repeats the batch; the whole batch is scored at once."""

import asyncio

import pytest

from graft.models.loading import load_tokenizer
from graft.rollout.engine import SamplingParams
from graft.rollout.reference import ReferenceEngine
from graft.sync.inflight import InFlightVersions
from graft.tasks.examples import Example
from graft.tasks.rewards import exact_numeric
from graft.tasks.scoring import RewardTerm, Scorer
from graft.train.rollout_batch import build_rollout_batch


def _batch(base_dir, seed: int, scorer=Scorer([RewardTerm("exact_numeric", exact_numeric)]), examples=None):
    engine = ReferenceEngine(base_dir)
    example = Example(prompt="What is 2 + 3?", answer="5")
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=seed, ignore_eos=True)
    return asyncio.run(build_rollout_batch(engine, adapter=None, version=0, inflight=InFlightVersions(),
                                           examples=examples or [example, example], tokenizer=load_tokenizer(base_dir),
                                           params=params, scorer=scorer))


def _completions(base_dir, seed: int) -> list[list[int]]:
    return [completion for _, completion in _batch(base_dir, seed).sequences]


def test_the_same_prompt_twice_in_a_batch_gets_different_samples_and_the_seed_repeats_them(base_dir):
    first = _completions(base_dir, seed=100)
    assert first[:4] != first[4:]  # one seed for every prompt would make these equal
    assert len({tuple(c) for c in first}) == 8
    assert _completions(base_dir, seed=100) == first


def test_the_batch_is_scored_in_one_call_grouped_by_prompt(base_dir):
    seen = []

    def by_prompt(completions, examples):  # batched: gets every completion of the batch with its example
        seen.append(len(completions))
        return [float(ex.metadata["p"]) + len(c) / 1000 for c, ex in zip(completions, examples)]

    tokenizer = load_tokenizer(base_dir)
    examples = [Example("a", "1", {"p": 0}), Example([{"role": "user", "content": "b"}], "2", {"p": 1}),
                Example("c", "3", {"p": 2})]
    batch = _batch(base_dir, 7, Scorer([RewardTerm("by_prompt", by_prompt, 2.0, batched=True)]), examples)
    texts = [tokenizer.decode(c, skip_special_tokens=True) for _, c in batch.sequences]
    assert seen == [12] and batch.rewards_PG.shape == (3, 4)
    expected = [p + len(texts[p * 4 + g]) / 1000 for p in range(3) for g in range(4)]  # sample g of prompt p
    assert batch.rewards_PG.flatten().tolist() == pytest.approx([2 * e for e in expected])
    assert batch.reward_metrics["reward/by_prompt"] == pytest.approx(sum(expected) / 12)
    assert batch.reward_metrics["reward_errors"] == 0
