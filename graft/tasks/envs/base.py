"""The environment protocol of multi-turn episodes, and the registry of built-in environments.

An episode starts from an `Example`: `reset(example)` gives the opening messages (the prompt the
model answers), then the model and the environment take turns: the model writes one assistant turn,
`step(model_text)` answers with the next observation (messages the chat template renders as the
next turn, e.g. a tool result or the user's reply), a reward and whether the episode is done. The
episode's reward is the sum of its steps' rewards. One `Env` object lives for one episode, so it
may keep the episode's state on itself; graft makes a fresh one per episode by calling the
environment class (or factory) with no arguments.

Either method may be `async def` (an environment calling a service or a sandbox); graft awaits it.
The episode loop itself (token ids, masks, limits) is `graft.rollout.episodes`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from graft.tasks.examples import Example


@dataclass(frozen=True)
class StepResult:
    """What an environment answers to one model turn.

    Attributes:
        messages: The next observation, chat messages (``{"role", "content"}``; e.g. a ``user``
            reply or a ``tool`` result) rendered after the model's turn by the chat template;
            ignored when `done`.
        reward: This step's reward (the episode's reward is the sum over its steps).
        done: The episode is over (answered, solved, failed); graft asks for no further model turn.
    """

    messages: list[dict] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False


@runtime_checkable
class Env(Protocol):
    """One episode's environment (see the module docstring); methods may be sync or async."""

    def reset(self, example: Example) -> list[dict] | Awaitable[list[dict]]:
        """The opening chat messages of the episode on `example` (what the model answers first)."""
        ...

    def step(self, model_text: str) -> StepResult | Awaitable[StepResult]:
        """Answer the model's turn (its text, special tokens left out)."""
        ...


EnvFactory = Callable[[], Env]

ENV_SIGNATURES = ("a class (or factory) called with no arguments, whose objects have reset(example) -> "
                  "list of chat messages and step(model_text: str) -> StepResult(messages, reward, done); "
                  "either may be async")
