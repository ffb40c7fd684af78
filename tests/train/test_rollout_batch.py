"""Seeded rollouts: every sample of a batch draws its own random numbers (an identical prompt twice
in a batch gets different samples), and the same seed repeats the batch."""

import asyncio

from graft.models.loading import load_tokenizer
from graft.rollout.engine import SamplingParams
from graft.rollout.reference import ReferenceEngine
from graft.sync.inflight import InFlightVersions
from graft.tasks.examples import Example
from graft.tasks.rewards import exact_numeric
from graft.train.rollout_batch import build_rollout_batch, sampling_seed


def _completions(base_dir, seed: int) -> list[list[int]]:
    engine = ReferenceEngine(base_dir)
    example = Example(prompt="What is 2 + 3?", answer="5")
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=seed, ignore_eos=True)
    batch = asyncio.run(build_rollout_batch(engine, adapter=None, version=0, inflight=InFlightVersions(),
                                         examples=[example, example], tokenizer=load_tokenizer(base_dir),
                                         params=params, reward_fn=exact_numeric))
    return [completion for _, completion in batch.sequences]


def test_the_same_prompt_twice_in_a_batch_gets_different_samples_and_the_seed_repeats_them(base_dir):
    first = _completions(base_dir, seed=100)
    assert first[:4] != first[4:]  # one seed for every prompt would make these equal
    assert len({tuple(c) for c in first}) == 8
    assert _completions(base_dir, seed=100) == first


def test_sampling_seeds_of_different_steps_and_runs_never_overlap():
    span = 32 * 8
    firsts = {sampling_seed(seed, step, span) for seed in range(3) for step in range(1, 500)}
    assert len(firsts) == 3 * 499
    ordered = sorted(firsts)
    assert min(b - a for a, b in zip(ordered, ordered[1:])) >= span
