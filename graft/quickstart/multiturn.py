"""Base models for the multi-turn quickstarts: a tiny Qwen2 that has watched a teacher play episodes
of a built-in environment (`graft.tasks.envs`), well enough to have every move in its repertoire and
not so well that GRPO has nothing left to learn.

- tools (`calculator`): the teacher calls the calculator (``calc: A * B``, then copies the value) in
  `TOOL_SHARE` of its episodes and otherwise answers at once with a rough product (its leading
  digits right, the rest wrong: no model multiplies three-digit numbers in its head). The base thus
  answers most questions wrongly by heart, but samples the tool call now and then; GRPO's job is the
  multi-turn skill of calling the tool, then copying its answer.
- guessing: the teacher guesses at random among the numbers the replies still allow. It uses the
  replies but never bisects on purpose (simulated over 1..16 with 4 turns: mean reward 0.44;
  bisection earns 0.67).

An episode is one token sequence built exactly as `graft.rollout.episodes` builds a sampled one
(`TurnRenderer`: the opening prompt, each model turn with its eos, each environment turn as the chat
template renders it after a finished turn), so the model learns the token layout it is sampled in.
The loss covers the teacher's tokens only.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch
from transformers import Qwen2ForCausalLM

from graft.atomic import require_empty_dir
from graft.models.tiny import tiny_config
from graft.models.tokenizer import train_tokenizer
from graft.quickstart.warmup import collate_labelled, save_base_model, train_on_sequences
from graft.rollout.episodes import TurnRenderer
from graft.tasks.envs import ENVS
from graft.tasks.examples import Example
from graft.tasks.registry import TASKS

LOW, HIGH = 1, 16  # guessing_task's default range
TOOL_SHARE = 0.3  # episodes in which the tools teacher calls the calculator
Game = tuple[list[int], list[bool]]  # (token ids, trained: True at the teacher's tokens)


class GuessingTeacher:
    """Guesses uniformly among the numbers the "Higher."/"Lower." replies still allow."""

    def __init__(self, example: Example, rng: random.Random) -> None:
        self.rng, self.low, self.high, self.guess = rng, LOW, HIGH, None

    def turn(self) -> str:
        self.guess = self.rng.randint(self.low, self.high)
        return str(self.guess)

    def observe(self, messages: list[dict]) -> None:
        if messages[0]["content"] == "Higher.":
            self.low = self.guess + 1
        else:
            self.high = self.guess - 1


class CalculatorTeacher:
    """Calls the calculator and copies its value in `TOOL_SHARE` of the episodes; otherwise answers a
    rough product (the exact product with every digit after the first two replaced at random)."""

    def __init__(self, example: Example, rng: random.Random) -> None:
        self.a, self.b, self.rng = example.metadata["a"], example.metadata["b"], rng
        self.uses_tool, self.value = rng.random() < TOOL_SHARE, None

    def turn(self) -> str:
        if self.value is not None:
            return self.value
        if self.uses_tool:
            return f"calc: {self.a} * {self.b}"
        exact = str(self.a * self.b)
        rough = exact[:2] + "".join(str(self.rng.randint(0, 9)) for _ in exact[2:])
        return rough if rough != exact else exact[:2] + str((int(exact[2]) + 1) % 10) + exact[3:]

    def observe(self, messages: list[dict]) -> None:
        self.value = messages[0]["content"]


TEACHERS = {"guessing": GuessingTeacher, "calculator": CalculatorTeacher}


def teacher_game(renderer: TurnRenderer, env_name: str, example: Example, rng: random.Random, max_turns: int) -> Game:
    """One episode of the teacher of `env_name` on `example`, as the ids an episode of it would have."""
    env, teacher = ENVS[env_name](), TEACHERS[env_name](example, rng)
    ids = renderer.prompt_ids(env.reset(example))
    trained = [False] * len(ids)
    for turn_index in range(max_turns):
        text = teacher.turn()
        turn = renderer.tokenizer.encode(text, add_special_tokens=False) + [renderer.tokenizer.eos_token_id]
        ids, trained = ids + turn, trained + [True] * len(turn)
        result = env.step(text)
        if result.done or turn_index == max_turns - 1:
            break
        teacher.observe(result.messages)
        reply = renderer.turn_ids(result.messages, model_closed_turn=True)
        ids, trained = ids + reply, trained + [False] * len(reply)
    return ids, trained


def sft_multiturn_base(out_dir: str | Path, *, env: str, hidden: int = 128, layers: int = 2, steps: int = 300,
                       batch: int = 64, lr: float = 3e-3, seed: int = 0, games: int = 4000, max_turns: int = 4,
                       progress: bool = True) -> Path:
    """Builds a random tiny Qwen2 and trains all of it on `games` teacher episodes of `env` (examples
    from the task of the same name's train split, seeded by `seed`), then saves it as
    `graft.quickstart.warmup.save_base_model` does. The same arguments give the same weights."""
    out_dir = require_empty_dir(out_dir)
    tokenizer = train_tokenizer()
    renderer, rng = TurnRenderer(tokenizer), random.Random(seed)
    train, _ = TASKS[env](seed=seed)
    rows = [teacher_game(renderer, env, train[i % len(train)], rng, max_turns) for i in range(games)]
    start = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(tiny_config(tokenizer, arch="qwen2", hidden=hidden, layers=layers))
        losses = train_on_sequences(model, rows, lambda chunk: collate_labelled(chunk, tokenizer.pad_token_id),
                                    steps=steps, batch=batch, lr=lr, seed=seed, progress=progress)
    record = {"env": env, "hidden": hidden, "layers": layers, "steps": steps, "batch": batch, "lr": lr,
              "seed": seed, "games": games, "max_turns": max_turns, "steps_run": len(losses),
              "train_seconds": round(time.perf_counter() - start, 2), "losses": [round(x, 5) for x in losses]}
    return save_base_model(out_dir, model, tokenizer, record)
