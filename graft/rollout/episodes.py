"""Multi-turn episodes: the model and an environment (`graft.tasks.envs`) take turns, token in,
token out.

An episode is one sequence: the opening prompt (the environment's first messages in the chat
template, with the assistant turn opened), then the model's sampled tokens, the environment's turn
rendered as a token suffix, the model's next tokens, and so on. The ids the engine sampled are kept
exactly (text is decoded only to show the environment; it is never encoded back), and each model
turn is a request of the exact ids so far, so the engine's log-probs are of the tokens the trainer
scores. An environment turn is appended as the chat template renders it after a finished assistant
turn (`TurnRenderer`): earlier tokens are never re-tokenised. `loss_mask` is True at the model's
tokens only.

All episodes of a batch run concurrently (one task each), and the turn requests they make in the
same event-loop pass go to the engine in one call (`TurnBatcher`). An episode holds one lease
(`lease()`, e.g. `inflight.use(version)`) for its whole life: the sync never unloads the adapter
version it samples from between two of its turns.

Limits: `EpisodeLimits.max_turns` model turns, `max_tokens` tokens in all (prompt included; each
turn may generate `min(params.max_new_tokens, what is left)`). An episode the environment has not
ended when a limit stops it is `truncated`.

Shape suffixes: see graft/__init__.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, replace

from graft.config import GraftConfig
from graft.rollout.engine import Completion, GenerateRequest, RolloutEngine, SamplingParams
from graft.rollout.turn_batcher import TurnBatcher
from graft.tasks.envs.base import Env, EnvFactory, StepResult
from graft.tasks.examples import Example

_SENTINEL = "\x00graft-turn\x00"  # stands for an assistant turn's content when the template is probed

Lease = Callable[[], AbstractAsyncContextManager]


@dataclass(frozen=True)
class EpisodeLimits:
    """`max_turns` model turns; `max_tokens` tokens in all (None = no limit)."""

    max_turns: int
    max_tokens: int | None = None

    @classmethod
    def of(cls, config: GraftConfig) -> EpisodeLimits:
        """`data.max_turns`, and `data.max_episode_tokens` (null: a launched server's
        `rollout.max_model_len`, which no request may pass, else none)."""
        data, rollout = config.data, config.rollout
        max_tokens = data.max_episode_tokens
        if max_tokens is None and rollout.engine == "vllm" and not rollout.urls:
            max_tokens = rollout.max_model_len
        return cls(max_turns=data.max_turns, max_tokens=max_tokens)


@dataclass(frozen=True)
class Episode:
    """One finished episode as one sequence.

    Attributes:
        prompt_ids: The opening prompt's ids (chat template, assistant turn opened).
        completion_ids: Every id after the prompt: model turns and environment turns, in order.
        loss_mask: Per completion id, True where the model sampled it.
        logprobs: Per completion id, the engine's log-prob where the model sampled it, 0.0 elsewhere.
        reward: The sum of the environment's step rewards.
        turns: Model turns taken.
        truncated: A limit ended the episode, not the environment.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    loss_mask: list[bool]
    logprobs: list[float]
    reward: float
    turns: int
    truncated: bool


class TurnRenderer:
    """Token ids of an episode's prompt and of each environment turn, from the chat template.

    An environment turn's text is what the template writes after a finished assistant turn: the
    close of that turn (e.g. ChatML's ``<|im_end|>\\n``, less the eos the model already sampled), the
    new messages, and the opened assistant turn. It is found by rendering a probe conversation with
    and without the new messages, and only that difference is encoded.

    Raises:
        ValueError: The template renders a conversation differently once a turn follows it (then no
            turn can be appended as a suffix).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]
        self._closed = self._render(self._probe, generation_prompt=False)
        self._close = self._closed[self._closed.rindex(_SENTINEL) + len(_SENTINEL):]
        self._eos = tokenizer.eos_token or ""

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The opening messages with the assistant turn opened (as `render_prompt_ids`)."""
        return self._encode(self._render(messages, generation_prompt=True))

    def turn_ids(self, messages: list[dict], model_closed_turn: bool) -> list[int]:
        """The ids after a model turn that carry `messages` and open the next assistant turn;
        `model_closed_turn`: the model's last token was the eos that closes its turn."""
        full = self._render(self._probe + list(messages), generation_prompt=True)
        if not full.startswith(self._closed):
            raise ValueError("the chat template renders a conversation differently once another turn follows, so "
                             "an environment turn cannot be appended to the sampled tokens")
        close = self._close
        if model_closed_turn and self._eos and close.startswith(self._eos):
            close = close[len(self._eos):]
        return self._encode(close + full[len(self._closed):])

    def model_text(self, token_ids: tuple[int, ...]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def closes_turn(self, completion: Completion) -> bool:
        return bool(completion.token_ids) and completion.token_ids[-1] == self.tokenizer.eos_token_id


async def _maybe_await(value):
    return await value if inspect.isawaitable(value) else value


def _as_step_result(value) -> StepResult:
    """A `StepResult`, or a ``(messages, reward, done)`` tuple (environments need not import graft)."""
    if isinstance(value, StepResult):
        return value
    if isinstance(value, tuple) and len(value) == 3:
        return StepResult(list(value[0] or []), float(value[1]), bool(value[2]))
    raise TypeError(f"an environment's step() returned {type(value).__name__}; expected StepResult(messages, "
                    "reward, done) or a (messages, reward, done) tuple")


async def run_episode(engine: RolloutEngine, adapter: str | None, env: Env, example: Example,
                      renderer: TurnRenderer, params: SamplingParams, limits: EpisodeLimits) -> Episode:
    """One episode of `env` on `example`; model turn t samples with seed `params.seed + t`.

    Raises:
        ValueError: The opening prompt leaves no room under `limits.max_tokens`.
    """
    prompt = renderer.prompt_ids(await _maybe_await(env.reset(example)))
    ids: list[int] = []
    mask: list[bool] = []
    logprobs: list[float] = []
    reward, truncated, turns = 0.0, True, 0

    def room() -> int:
        left = params.max_new_tokens if limits.max_tokens is None else limits.max_tokens - len(prompt) - len(ids)
        return min(params.max_new_tokens, left)

    if room() < 1:
        raise ValueError(f"an episode's prompt has {len(prompt)} tokens: no room for a model turn under "
                         f"data.max_episode_tokens ({limits.max_tokens})")
    while turns < limits.max_turns and room() >= 1:
        turn_params = replace(params, n=1, max_new_tokens=room(),
                              seed=None if params.seed is None else params.seed + turns)
        [[completion]] = await engine.generate([GenerateRequest(tuple(prompt + ids), turn_params)], adapter=adapter)
        turns += 1
        ids += completion.token_ids
        mask += [True] * len(completion.token_ids)
        logprobs += completion.logprobs
        result = _as_step_result(await _maybe_await(env.step(renderer.model_text(completion.token_ids))))
        reward += float(result.reward)
        if result.done:
            truncated = False
            break
        if turns == limits.max_turns:
            break
        suffix = renderer.turn_ids(result.messages, renderer.closes_turn(completion))
        if limits.max_tokens is not None and len(prompt) + len(ids) + len(suffix) >= limits.max_tokens:
            break  # the environment's turn would leave no room for the model's next one
        ids += suffix
        mask += [False] * len(suffix)
        logprobs += [0.0] * len(suffix)
    return Episode(prompt, ids, mask, logprobs, reward, turns, truncated)


async def run_episodes(engine: RolloutEngine, adapter: str | None, env_factory: EnvFactory,
                       examples_E: list[Example], renderer: TurnRenderer, params: SamplingParams,
                       limits: EpisodeLimits, lease: Lease | None = None) -> list[Episode]:
    """One episode per example, all at once, each with a fresh environment and inside its own
    `lease()` for its whole life. Episode e's turn t samples with seed `params.seed + e * max_turns + t`
    (no two episodes or turns share one)."""

    batcher = TurnBatcher(engine)  # each turn of the batch's episodes in one engine call

    async def one(e: int, example: Example) -> Episode:
        seed = None if params.seed is None else params.seed + e * limits.max_turns
        async with lease() if lease is not None else contextlib.nullcontext():
            return await run_episode(batcher, adapter, env_factory(), example, renderer, replace(params, seed=seed),
                                     limits)

    return list(await asyncio.gather(*(one(e, ex) for e, ex in enumerate(examples_E))))


async def evaluate_episodes(engine: RolloutEngine, adapter: str | None, env_factory: EnvFactory,
                            examples: list[Example], tokenizer, max_new_tokens: int, limits: EpisodeLimits) -> float:
    """Mean reward of greedy episodes on `examples` (held-out evaluation of a multi-turn run)."""
    params = SamplingParams(temperature=0, max_new_tokens=max_new_tokens)
    episodes = await run_episodes(engine, adapter, env_factory, examples, TurnRenderer(tokenizer), params, limits)
    return sum(e.reward for e in episodes) / len(episodes)
