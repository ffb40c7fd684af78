"""One rollout batch: n samples per prompt from the engine's current policy, scored by the reward.

`build_rollout_batch` samples and scores the prompts of a step (which prompts and seeds:
`graft.train.step_plan`); `with_overlong_penalty` shapes the rewards.

Shape suffixes: see graft/__init__.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from graft.rl.shaping import soft_overlong_penalty
from graft.rollout.engine import GenerateRequest, RolloutEngine, SamplingParams
from graft.sync.inflight import InFlightVersions
from graft.tasks.examples import Example
from graft.tasks.prompts import CHAT, PromptFormat
from graft.tasks.scoring import Scorer


@dataclass(frozen=True)
class RolloutBatch:
    """Samples grouped by prompt: `sequences[p * G + g]` is sample g of prompt p."""

    sequences: list[tuple[list[int], list[int]]]  # (prompt ids, completion ids)
    engine_logprobs: list[list[float]]  # the engine's log-prob of each completion token
    rewards_PG: torch.Tensor
    version: int  # the policy version that generated every sample
    seconds: float
    truncated: tuple[bool, ...] = ()  # per sequence: cut at max_new_tokens (no end of sequence); () = none
    # reward/<name> means, reward_errors (graft.tasks.scoring), the sampling filters' and shaping's metrics
    reward_metrics: dict = field(default_factory=dict)
    # Multi-turn episodes (graft.train.episode_batch): per sequence, per completion token, True where the
    # model sampled it (the loss, KL, entropy and TIS count those only), False at environment and template
    # tokens (their engine log-probs are placeholders). None = every completion token is the model's.
    loss_masks: list[list[bool]] | None = None
    mask_truncated: bool = False  # data.truncated: mask (truncated sequences stay out of the loss)

    @property
    def tokens(self) -> int:
        return sum(len(c) for _, c in self.sequences)

    def loss_tokens(self, row: int) -> int:
        """Completion tokens of `row` the loss counts (the model's own)."""
        return len(self.sequences[row][1]) if self.loss_masks is None else sum(self.loss_masks[row])


async def build_rollout_batch(engine: RolloutEngine, *, adapter: str | None, version: int, inflight: InFlightVersions,
                           examples: list[Example], tokenizer, params: SamplingParams,
                           scorer: Scorer, prompts: PromptFormat = CHAT) -> RolloutBatch:
    """Sample `params.n` completions per example with policy `version` and score them.

    With a seed, prompt p's samples use seeds `seed + p * n ...`: engines seed sample g of a request
    with `seed + g`, so one seed for every prompt would draw every prompt's g-th sample from the same
    random numbers, and the batch's samples would err (or not) together."""
    start = time.perf_counter()
    prompts_P = [prompts.ids(tokenizer, ex) for ex in examples]
    requests = [GenerateRequest(tuple(prompt), params if params.seed is None else
                                replace(params, seed=params.seed + p * params.n))
                for p, prompt in enumerate(prompts_P)]
    async with inflight.use(version):  # the sync never unloads a version a request still uses
        completions_P = await engine.generate(requests, adapter=adapter)
    sequences, logprobs, texts, scored, truncated = [], [], [], [], []
    for prompt, example, completions in zip(prompts_P, examples, completions_P):
        for completion in completions:
            sequences.append((list(prompt), list(completion.token_ids)))
            logprobs.append(list(completion.logprobs))
            truncated.append(completion.finish_reason == "length")
            texts.append(prompts.completion_text(tokenizer, completion.token_ids))
            scored.append(example)
    scores = await scorer(texts, scored)  # the whole batch at once: batched and async rewards see all of it
    rewards_PG = torch.tensor(scores.rewards, dtype=torch.float32).view(len(examples), params.n)
    return RolloutBatch(sequences, logprobs, rewards_PG, version, time.perf_counter() - start, tuple(truncated),
                        reward_metrics=scores.metrics)


def with_overlong_penalty(batch: RolloutBatch, max_tokens: int, buffer_tokens: int | None,
                          penalty: float) -> RolloutBatch:
    """`batch` with DAPO's soft overlong punishment added to its rewards (`train.overlong_buffer_tokens`;
    None = unchanged) and its mean in `reward_metrics["overlong_penalty_mean"]`."""
    if buffer_tokens is None:
        return batch
    lengths = torch.tensor([len(c) for _, c in batch.sequences])
    penalty_PG = soft_overlong_penalty(lengths, max_tokens, buffer_tokens, penalty).view_as(batch.rewards_PG)
    return replace(batch, rewards_PG=batch.rewards_PG + penalty_PG,
                   reward_metrics={**batch.reward_metrics, "overlong_penalty_mean": penalty_PG.mean().item()})
