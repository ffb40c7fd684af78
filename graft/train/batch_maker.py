"""The one place a step's batch is made: `BatchMaker.make(step, version)`.

It picks the step's prompts and seeds (`graft.train.step_plan`), samples them from the engines with
the given policy version (`graft.train.rollout_batch`, or multi-turn episodes through
`graft.train.episode_batch`), keeps only groups with a learning signal when `train.filter_groups`
is on (`graft.train.dynamic_sampling`), and shapes the rewards (`train.overlong_buffer_tokens`).
The rollout producer (`graft.train.staleness`) decides when a batch is made and from which version.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from graft.config import GraftConfig
from graft.models.loading import load_tokenizer
from graft.rollout.engine import RolloutEngine, SamplingParams
from graft.rollout.episodes import EpisodeLimits
from graft.sync.policy_sync import PolicySync
from graft.tasks.envs import EnvFactory, resolve_env
from graft.tasks.examples import Example
from graft.tasks.prompts import CHAT, PromptFormat, run_prompt_format
from graft.tasks.registry import load_task_data
from graft.tasks.reward_loading import load_eval_scorer, load_scorer
from graft.tasks.scoring import Scorer
from graft.train.dynamic_sampling import sample_informative_groups
from graft.train.episode_batch import build_episode_batch
from graft.train.rollout_batch import RolloutBatch, build_rollout_batch, with_overlong_penalty
from graft.train.step_plan import episode_sampling_params, round_inputs, step_sampling_params


@dataclass(frozen=True)
class TrainTask:
    """What the run trains on: prompts, held-out prompts, tokenizer, rewards."""

    train_set: list[Example]
    eval_set: list[Example]
    tokenizer: object
    scorer: Scorer | None
    eval_scorer: Scorer | None
    env: EnvFactory | None = None  # data.env: multi-turn episodes scored by the environment
    prompts: PromptFormat = CHAT  # data.prompt_format, resolved against the tokenizer


def load_train_task(config: GraftConfig) -> TrainTask:
    """The data, tokenizer and rewards of `config`; user reward (or environment) code imports, or
    fails, before the data is read."""
    env = resolve_env(config.data.env) if config.data.env is not None else None
    scorer, eval_scorer = (None, None) if env else (load_scorer(config.data), load_eval_scorer(config.data))
    train_set, eval_set = load_task_data(config.data)
    tokenizer = load_tokenizer(config.model.path)
    eval_set = eval_set[: config.train.eval_examples]
    prompts = run_prompt_format(config, tokenizer, train_set + eval_set)
    return TrainTask(train_set, eval_set, tokenizer, scorer, eval_scorer, env, prompts)


class BatchMaker:
    """Makes the batch of a step from a policy version, on the engines `sync` keeps up to date."""

    def __init__(self, config: GraftConfig, engine: RolloutEngine, sync: PolicySync, task: TrainTask) -> None:
        self.config, self.engine, self.sync, self.task = config, engine, sync, task

    async def make(self, step: int, version: int) -> RolloutBatch:
        """The batch of `step`, sampled from policy `version`: with `train.filter_groups` of groups
        with a learning signal (refilled), rewards shaped per `train`."""
        train = self.config.train
        params = (episode_sampling_params if self.task.env is not None else step_sampling_params)(self.config, step)
        sample_round = partial(self._sample_round, step, version, params)
        batch = (await sample_informative_groups(sample_round, train.batch_prompts, train.max_sampling_rounds)
                 if train.filter_groups else await sample_round(0))
        return with_overlong_penalty(batch, params.max_new_tokens, train.overlong_buffer_tokens,
                                     train.overlong_penalty)

    async def _sample_round(self, step: int, version: int, params: SamplingParams, round_: int) -> RolloutBatch:
        """Round `round_` of `step` (0: its own prompts; later: dynamic sampling's refills)."""
        train, task = self.config.train, self.task
        examples, round_params = round_inputs(task.train_set, step, round_, train.batch_prompts, train.seed, params)
        common = dict(adapter=self.sync.request_adapter(version), version=version, inflight=self.sync.inflight,
                      examples=examples, tokenizer=task.tokenizer, params=round_params)
        if task.env is not None:
            return await build_episode_batch(self.engine, **common, env_factory=task.env,
                                             limits=EpisodeLimits.of(self.config),
                                             mask_truncated=self.config.data.truncated == "mask")
        return await build_rollout_batch(self.engine, **common, scorer=task.scorer, prompts=task.prompts)
