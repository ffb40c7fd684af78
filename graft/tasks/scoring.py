"""Scoring completions with the run's rewards: the weighted sum that drives the advantages, and per
reward its batch mean and error count for the metrics.

A reward is called once per completion, ``fn(completion, example) -> float``, or once per batch
when batched, ``fn(completions, examples) -> list[float]``. Either may be ``async def`` (a verifier
calling a service): the per-completion calls of one reward are then awaited concurrently, at most
`max_concurrency` at a time. Plain functions run in the event loop, one call after another.

What a reward that raises (or returns anything but a finite number) does is the run's choice
(`data.reward_errors`): "raise" stops with a `RewardError` naming the reward and the example and
showing the end of the reward's own traceback; "zero" scores that completion 0 for that reward and
counts it in the metrics (`reward_errors`), logging the first failure of each reward once.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from graft.tasks.examples import Example, prompt_messages, shorten

log = logging.getLogger(__name__)

_TRACEBACK_FRAMES = 4  # frames of the reward's traceback an error shows


@dataclass(frozen=True)
class RewardTerm:
    """One reward of the sum: `weight` x `fn`, logged as ``reward/<name>``; `batched` = called once
    per batch with lists (see the module docstring)."""

    name: str
    fn: Callable[..., Any]
    weight: float = 1.0
    batched: bool = False


@dataclass(frozen=True)
class Scores:
    """The scores of one batch of completions.

    Attributes:
        rewards: The weighted sum of the rewards, one per completion, in input order.
        metrics: ``reward/<name>``: each reward's mean over the batch (unweighted, failures as 0);
            ``reward_errors``: completions whose reward failed, summed over the rewards.
    """

    rewards: list[float]
    metrics: dict[str, float]


class RewardError(ValueError):
    """A reward raised, or returned something other than a finite number (data.reward_errors: raise)."""


class _NotANumber(ValueError):
    """A reward's return value that is not a finite number."""


class Scorer:
    """Scores batches of completions with weighted rewards.

    Args:
        terms: The rewards, each with its weight.
        on_error: "raise" or "zero" (data.reward_errors).
        max_concurrency: Per-completion calls of an async reward awaited at once.
    """

    def __init__(self, terms: Sequence[RewardTerm], on_error: Literal["raise", "zero"] = "raise",
                 max_concurrency: int = 64) -> None:
        assert terms and on_error in ("raise", "zero")
        self.terms, self.on_error, self.max_concurrency = list(terms), on_error, max_concurrency
        self._logged: set[str] = set()

    async def __call__(self, completions: Sequence[str], examples: Sequence[Example]) -> Scores:
        """Scores `completions[i]` against `examples[i]` with every reward.

        Raises:
            RewardError: A reward failed on a completion and on_error is "raise".
        """
        assert len(completions) == len(examples)
        total = [0.0] * len(completions)
        metrics: dict[str, float] = {}
        failed = 0
        for term in self.terms:
            call = self._batched if term.batched else self._per_completion
            values, errors = await call(term, completions, examples)
            if errors:
                index, error = next(iter(errors.items()))
                message = _describe(term, error, completions[index], examples[index], len(errors), len(values))
                if self.on_error == "raise":
                    raise RewardError(f"{message}\n(data.reward_errors: zero would score such completions 0 and "
                                      "count them in the metrics instead of stopping the run)") from error
                if term.name not in self._logged:
                    self._logged.add(term.name)
                    log.warning("%s (data.reward_errors: zero: scored 0 and counted in reward_errors; only the "
                                "first failure of each reward is logged)", message)
                failed += len(errors)
            metrics[f"reward/{term.name}"] = sum(values) / len(values) if values else 0.0
            total = [t + term.weight * v for t, v in zip(total, values)]
        metrics["reward_errors"] = failed
        return Scores(total, metrics)

    async def _per_completion(self, term: RewardTerm, completions: Sequence[str],
                              examples: Sequence[Example]) -> tuple[list[float], dict[int, Exception]]:
        results: list[Any] = [0.0] * len(completions)
        errors: dict[int, Exception] = {}
        pending: dict[int, Any] = {}
        for i, (completion, example) in enumerate(zip(completions, examples)):
            try:
                results[i] = term.fn(completion, example)
            except Exception as error:
                errors[i] = error
                continue
            if inspect.isawaitable(results[i]):
                pending[i] = results[i]
        if pending:
            limit = asyncio.Semaphore(self.max_concurrency)

            async def bounded(awaitable):
                async with limit:
                    return await awaitable

            done = await asyncio.gather(*(bounded(a) for a in pending.values()), return_exceptions=True)
            for i, result in zip(pending, done):
                if isinstance(result, Exception):
                    errors[i] = result
                elif isinstance(result, BaseException):
                    raise result
                else:
                    results[i] = result
        return _checked(results, errors)

    async def _batched(self, term: RewardTerm, completions: Sequence[str],
                       examples: Sequence[Example]) -> tuple[list[float], dict[int, Exception]]:
        try:
            results = term.fn(list(completions), list(examples))
            if inspect.isawaitable(results):
                results = await results
            results = list(results)
            if len(results) != len(completions):
                raise _NotANumber(f"returned {len(results)} scores for {len(completions)} completions")
        except Exception as error:  # the whole batch failed: every completion counts
            return [0.0] * len(completions), dict.fromkeys(range(len(completions)), error)
        return _checked(results, {})


def _checked(results: list[Any], errors: dict[int, Exception]) -> tuple[list[float], dict[int, Exception]]:
    """Every result as a float; a failed or non-numeric one scores 0 and is added to `errors`."""
    values = []
    for i, result in enumerate(results):
        if i not in errors:
            try:
                values.append(_as_reward(result))
                continue
            except _NotANumber as error:
                errors[i] = error
        values.append(0.0)
    return values, dict(sorted(errors.items()))


def _as_reward(value: Any) -> float:
    # bool counts (True = 1.0: a verifier's verdict); numpy scalars and 0-d tensors have __float__.
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        raise _NotANumber(f"returned {shorten(repr(value))} ({type(value).__name__}), not a number")
    number = float(value)
    if not math.isfinite(number):
        raise _NotANumber(f"returned {number}, not a finite number")
    return number


def _describe(term: RewardTerm, error: Exception, completion: str, example: Example, failed: int,
              total: int) -> str:
    """One message: which reward, what went wrong, on which example, and the end of its traceback."""
    what = str(error) if isinstance(error, _NotANumber) else f"raised {type(error).__name__}: {error}"
    batch = f" (batched: all {total} completions of the batch failed)" if term.batched and failed == total else ""
    if failed > 1 and not batch:
        batch = f" ({failed} of {total} completions of the batch failed; the first:)"
    prompt = prompt_messages(example)[-1]["content"]
    lines = [f"reward {term.name!r} {what}{batch} on the example with prompt {shorten(repr(prompt))}, "
             f"answer {shorten(repr(example.answer))}, completion {shorten(repr(completion))}"]
    if not isinstance(error, _NotANumber):
        # The reward's own frames: this module's call sites say nothing the user can act on.
        frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename != __file__]
        lines.append("end of the reward's traceback:")
        lines.append("".join(traceback.format_list(frames[-_TRACEBACK_FRAMES:])).rstrip("\n"))
        lines.append("".join(traceback.format_exception_only(error)).rstrip("\n"))
    return "\n".join(line for line in lines if line)
