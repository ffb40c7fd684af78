"""Which prompts and random seeds each step uses: the one home of the rules.

Every rule is a pure function of (train.seed, step, ...), so a checkpoint's data cursor is just its
step and a resumed run samples, shuffles and refills exactly what the uninterrupted one did:

- `step_examples`: the step's prompts, consecutive slices of per-epoch shuffles of the train set;
- `step_sampling_params` / `episode_sampling_params`: the step's sampling settings and first seed
  (one seed per sample, or per episode turn), no two steps sharing one;
- `round_inputs`: the prompts and seeds of a dynamic-sampling refill round (`train.filter_groups`);
- `mini_batch_shuffle_seed`: the order of the PPO mini-batches (`train.shuffle_mini_batches`).
"""

from __future__ import annotations

import random
from dataclasses import replace

from graft.config import GraftConfig
from graft.rollout.engine import SamplingParams
from graft.tasks.examples import Example

# Seeds of refill round k are the step's seeds plus k times this: far above any seed a step uses
# (`sampling_seed`), so no two rounds or steps share a seed.
REFILL_SEED_STRIDE = 2**48


def mix_seed(seed: int, n: int) -> int:
    """One integer from the run's seed and a counter (an epoch, a step): distinct for every pair of
    small values, so no two (seed, n) pairs share a generator."""
    return seed * 1_000_003 + n


def step_examples(train_set: list[Example], step: int, batch_prompts: int, seed: int) -> list[Example]:
    """The prompts of `step` (1-based): consecutive slices of per-epoch shuffles of the train set."""
    n = len(train_set)
    first = (step - 1) * batch_prompts
    out, orders = [], {}
    for i in range(first, first + batch_prompts):
        epoch, at = divmod(i, n)
        if epoch not in orders:
            orders[epoch] = random.Random(mix_seed(seed, epoch)).sample(range(n), n)
        out.append(train_set[orders[epoch][at]])
    return out


def sampling_seed(seed: int, step: int, samples_per_step: int) -> int:
    """The first of step `step`'s `samples_per_step` consecutive seeds (one per sample, see
    `graft.train.rollout_batch.build_rollout_batch`); no two (seed, step) pairs share one."""
    return mix_seed(seed, step) * samples_per_step


def step_sampling_params(config: GraftConfig, step: int) -> SamplingParams:
    """`rollout.n_samples` completions per prompt with the rollout settings, seeded per step."""
    rollout, train = config.rollout, config.train
    return SamplingParams(n=rollout.n_samples, temperature=rollout.temperature, top_p=rollout.top_p,
                          max_new_tokens=rollout.max_new_tokens, stop=tuple(config.data.stop),
                          seed=sampling_seed(train.seed, step, train.batch_prompts * rollout.n_samples))


def episode_sampling_params(config: GraftConfig, step: int) -> SamplingParams:
    """`step_sampling_params` with room for `data.max_turns` seeds per episode: the step's seeds span
    batch_prompts x n_samples x max_turns, so no two steps share one."""
    params = step_sampling_params(config, step)
    per_step = config.train.batch_prompts * config.rollout.n_samples * config.data.max_turns
    return replace(params, seed=sampling_seed(config.train.seed, step, per_step))


def refill_examples(train_set: list[Example], step: int, round_: int, batch_prompts: int, seed: int) -> list[Example]:
    """The prompts of refill round `round_` >= 1 of `step`: drawn without replacement (with, from a
    train set smaller than the batch) by a generator seeded with (seed, step, round)."""
    rng = random.Random(f"graft-refill:{seed}:{step}:{round_}")
    n = len(train_set)
    picks = rng.sample(range(n), batch_prompts) if batch_prompts <= n else rng.choices(range(n), k=batch_prompts)
    return [train_set[i] for i in picks]


def round_inputs(train_set: list[Example], step: int, round_: int, batch_prompts: int, seed: int,
                 params: SamplingParams) -> tuple[list[Example], SamplingParams]:
    """The prompts and sampling settings of round `round_` of `step`: round 0 is the step's own batch
    (`step_examples`, `params`), later rounds are refills with their own seeds."""
    if round_ == 0:
        return step_examples(train_set, step, batch_prompts, seed), params
    refill_params = params if params.seed is None else replace(params, seed=params.seed + round_ * REFILL_SEED_STRIDE)
    return refill_examples(train_set, step, round_, batch_prompts, seed), refill_params


def mini_batch_shuffle_seed(seed: int, step: int, shuffle: bool) -> int | None:
    """The seed that orders step `step`'s PPO mini-batches (None: in batch order)."""
    return mix_seed(seed, step) if shuffle else None
