"""One rollout batch of multi-turn episodes (`data.env`): n episodes per prompt with the engine's
current policy, each scored by its environment, as a `RolloutBatch` with per-token loss masks.

Every episode holds the batch's policy version for all its turns (`inflight.use(version)` around the
whole episode), so a batch's staleness is the same for each of its episodes: one version per
episode, and one per batch, as for single-turn batches. Episode e of step s samples turn t with the
seed `episode_sampling_params(...).seed + e * max_turns + t` (`graft.train.step_plan`): a pure
function of (seed, step, episode, turn), so sampling is independent across episodes and turns, and
a resumed run samples what the uninterrupted one did.

Shape suffixes: see graft/__init__.py.
"""

from __future__ import annotations

import time

import torch

from graft.rollout.engine import RolloutEngine, SamplingParams
from graft.rollout.episodes import EpisodeLimits, TurnRenderer, run_episodes
from graft.sync.inflight import InFlightVersions
from graft.tasks.envs.base import EnvFactory
from graft.tasks.examples import Example
from graft.train.rollout_batch import RolloutBatch


async def build_episode_batch(engine: RolloutEngine, *, adapter: str | None, version: int,
                              inflight: InFlightVersions, examples: list[Example], tokenizer,
                              params: SamplingParams, env_factory: EnvFactory, limits: EpisodeLimits,
                              mask_truncated: bool = False) -> RolloutBatch:
    """`params.n` episodes per example with policy `version`, as one batch.

    `reward_metrics` gains `episode_turns_mean` and `episode_model_tokens_mean` (tokens the model
    sampled per episode: the ones the loss counts)."""
    start = time.perf_counter()
    examples_E = [example for example in examples for _ in range(params.n)]
    episodes_E = await run_episodes(engine, adapter, env_factory, examples_E, TurnRenderer(tokenizer), params,
                                    limits, lease=lambda: inflight.use(version))
    rewards_PG = torch.tensor([e.reward for e in episodes_E], dtype=torch.float32).view(len(examples), params.n)
    metrics = {"episode_turns_mean": sum(e.turns for e in episodes_E) / len(episodes_E),
               "episode_model_tokens_mean": sum(sum(e.loss_mask) for e in episodes_E) / len(episodes_E)}
    return RolloutBatch([(e.prompt_ids, e.completion_ids) for e in episodes_E], [e.logprobs for e in episodes_E],
                        rewards_PG, version, time.perf_counter() - start, tuple(e.truncated for e in episodes_E),
                        reward_metrics=metrics, loss_masks=[e.loss_mask for e in episodes_E],
                        mask_truncated=mask_truncated)
