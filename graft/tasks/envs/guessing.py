"""The built-in environment "guessing": find a secret number from "higher"/"lower" replies; the
fewer guesses, the more reward.

Each model turn's last number is its guess. A right guess ends the episode with reward
``1 - (guesses - 1) / max_guesses`` (1.0 for a first-time hit); a wrong one is answered "higher" or
"lower" (a turn without a number: "say a number"), with no reward; running out of turns (the run's
`data.max_turns`) scores 0. No model guesses the secret at once more than by chance, so doing well
takes using the replies: bisection finds any of 1..16 in at most 5 guesses. The task `guessing`
gives the examples: the secret is the answer.
"""

from __future__ import annotations

import random
import re

from graft.tasks.envs.base import StepResult
from graft.tasks.examples import Example, prompt_messages

MAX_GUESSES = 8  # the reward's scale: a hit at guess k earns 1 - (k - 1) / MAX_GUESSES
_INTEGER = re.compile(r"-?\d+")
PROMPT = "I am thinking of a number from {low} to {high}. Guess it: answer with one number."


class GuessingEnv:
    """One episode: guesses answered "higher"/"lower" until the secret is hit."""

    def reset(self, example: Example) -> list[dict]:
        self.secret, self.guesses = int(example.answer), 0
        return prompt_messages(example)

    def step(self, model_text: str) -> StepResult:
        self.guesses += 1
        numbers = _INTEGER.findall(model_text)
        if not numbers:
            return StepResult([{"role": "user", "content": "Say a number."}])
        guess = int(numbers[-1])
        if guess == self.secret:
            return StepResult(reward=max(0.0, 1.0 - (self.guesses - 1) / MAX_GUESSES), done=True)
        return StepResult([{"role": "user", "content": "Higher." if guess < self.secret else "Lower."}])


def guessing_task(seed: int = 0, n_train: int = 2000, n_eval: int = 200, low: int = 1, high: int = 16
                  ) -> tuple[list[Example], list[Example]]:
    """(train, eval) games with secrets drawn uniformly from [low, high], the same per seed (the eval
    games are other draws: a secret's game is the same prompt, so only the secret differs)."""
    rng = random.Random(seed)
    prompt = PROMPT.format(low=low, high=high)
    examples = [Example(prompt, str(rng.randint(low, high))) for _ in range(n_train + n_eval)]
    return examples[:n_train], examples[n_train:]
