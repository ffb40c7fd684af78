"""The prompt and seed rules (`graft.train.step_plan`): pure functions of (seed, step, ...), so a
resumed run samples what the uninterrupted one did; no two steps, runs, rounds, episodes or turns
share a seed."""

from graft.config import load_config
from graft.rollout.engine import SamplingParams
from graft.tasks.examples import Example
from graft.train.step_plan import (
    REFILL_SEED_STRIDE,
    episode_sampling_params,
    refill_examples,
    round_inputs,
    sampling_seed,
    step_examples,
)


def test_sampling_seeds_of_different_steps_and_runs_never_overlap():
    span = 32 * 8
    firsts = {sampling_seed(seed, step, span) for seed in range(3) for step in range(1, 500)}
    assert len(firsts) == 3 * 499
    ordered = sorted(firsts)
    assert min(b - a for a, b in zip(ordered, ordered[1:])) >= span


def test_refill_prompts_are_a_pure_function_of_seed_step_and_round():
    train_set = [Example(prompt=str(i), answer=str(i)) for i in range(50)]
    first = refill_examples(train_set, step=4, round_=1, batch_prompts=8, seed=0)
    assert first == refill_examples(train_set, step=4, round_=1, batch_prompts=8, seed=0)
    assert len({ex.prompt for ex in first}) == 8  # without replacement
    others = [refill_examples(train_set, 4, 2, 8, 0), refill_examples(train_set, 5, 1, 8, 0),
              refill_examples(train_set, 4, 1, 8, 1)]
    assert all(o != first for o in others)
    assert len(refill_examples(train_set[:3], 1, 1, 8, 0)) == 8  # a small train set: with replacement

    params = SamplingParams(n=4, seed=1234)
    assert round_inputs(train_set, 4, 0, 8, 0, params) == (step_examples(train_set, 4, 8, 0), params)
    examples, refill_params = round_inputs(train_set, 4, 2, 8, 0, params)
    assert examples == refill_examples(train_set, 4, 2, 8, 0) and refill_params.seed == 1234 + 2 * REFILL_SEED_STRIDE
    assert round_inputs(train_set, 4, 2, 8, 0, SamplingParams(n=4))[1].seed is None  # unseeded stays unseeded


def test_episode_seeds_never_overlap_across_steps_episodes_and_turns():
    config = load_config(None, ["train.batch_prompts=4", "rollout.n_samples=3", "data.max_turns=5"])
    seeds = [episode_sampling_params(config, step).seed + e * 5 + t
             for step in (1, 2, 3) for e in range(12) for t in range(5)]
    assert len(set(seeds)) == len(seeds)
