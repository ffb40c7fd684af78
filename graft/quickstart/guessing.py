"""The guessing quickstart's base model: a tiny Qwen2 that has watched games of the built-in
guessing environment (`graft.tasks.envs.guessing`) played by a teacher who guesses at random among
the numbers the replies still allow.

Such a player uses the replies but not well: it never bisects on purpose, so its games take more
guesses than they need (measured by simulation over 1..16 with 4 turns: mean reward 0.44 sampled,
0.24-0.59 for the greedy decision trees such a teacher leaves; bisection earns 0.67). GRPO then
has reward variance in every group and room above, and what it must learn is a multi-turn skill:
which number to try next given the earlier guesses and replies.

A game is one token sequence built exactly as `graft.rollout.episodes` builds a sampled episode
(`TurnRenderer`: the opening prompt, each guess with its eos, each reply as the chat template
renders it after a finished turn), so the model is trained on the token layout it will be sampled
in. The loss covers the teacher's tokens only.

Shape suffixes: ``_B`` batch, ``_T`` tokens.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch
from transformers import Qwen2ForCausalLM

from graft.models.tiny import tiny_config
from graft.models.tokenizer import train_tokenizer
from graft.quickstart.warmup import IGNORE_INDEX, save_base_model, train_on_sequences
from graft.rollout.episodes import TurnRenderer
from graft.tasks.envs.guessing import GuessingEnv, guessing_task
from graft.tasks.examples import Example

LOW, HIGH = 1, 16  # guessing_task's default range
Game = tuple[list[int], list[bool]]  # (token ids, trained: True at the teacher's tokens)


def teacher_game(renderer: TurnRenderer, example: Example, rng: random.Random, max_turns: int) -> Game:
    """One game of the teacher on `example`, as the ids an episode of it would have."""
    env = GuessingEnv()
    ids = renderer.prompt_ids(env.reset(example))
    trained = [False] * len(ids)
    low, high = LOW, HIGH
    for turn_index in range(max_turns):
        guess = rng.randint(low, high)
        turn = renderer.tokenizer.encode(str(guess), add_special_tokens=False) + [renderer.tokenizer.eos_token_id]
        ids, trained = ids + turn, trained + [True] * len(turn)
        result = env.step(str(guess))
        if result.done or turn_index == max_turns - 1:
            break
        low, high = (guess + 1, high) if guess < env.secret else (low, guess - 1)
        reply = renderer.turn_ids(result.messages, model_closed_turn=True)
        ids, trained = ids + reply, trained + [False] * len(reply)
    return ids, trained


def collate_games(games: list[Game], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``(input_ids_BT, labels_BT, attention_mask_BT)``; ``labels_BT`` is the id at the
    teacher's tokens and ``IGNORE_INDEX`` elsewhere (HF's causal-LM loss shifts labels itself)."""
    width = max(len(ids) for ids, _ in games)
    input_ids_BT = torch.full((len(games), width), pad_id, dtype=torch.long)
    labels_BT = torch.full((len(games), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask_BT = torch.zeros((len(games), width), dtype=torch.long)
    for row, (ids, trained) in enumerate(games):
        ids_T = torch.tensor(ids)
        input_ids_BT[row, : len(ids)] = ids_T
        labels_BT[row, : len(ids)] = torch.where(torch.tensor(trained), ids_T, IGNORE_INDEX)
        attention_mask_BT[row, : len(ids)] = 1
    return input_ids_BT, labels_BT, attention_mask_BT


def sft_guessing_base(out_dir: str | Path, *, hidden: int = 128, layers: int = 2, steps: int = 300, batch: int = 64,
                      lr: float = 3e-3, seed: int = 0, games: int = 4000, max_turns: int = 4,
                      progress: bool = True) -> Path:
    """Builds a random tiny Qwen2 and trains all of it on `games` teacher games (secrets from the
    task's train split, seeded by `seed`), then saves it as `graft.quickstart.warmup.save_base_model`
    does. The same arguments give the same weights."""
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"{out_dir} already exists and is not empty; refusing to overwrite it")
    tokenizer = train_tokenizer()
    renderer, rng = TurnRenderer(tokenizer), random.Random(seed)
    train, _ = guessing_task(seed=seed)
    rows = [teacher_game(renderer, train[i % len(train)], rng, max_turns) for i in range(games)]
    start = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(tiny_config(tokenizer, arch="qwen2", hidden=hidden, layers=layers))
        losses = train_on_sequences(model, rows, lambda chunk: collate_games(chunk, tokenizer.pad_token_id),
                                    steps=steps, batch=batch, lr=lr, seed=seed, progress=progress)
    record = {"task": "guessing", "hidden": hidden, "layers": layers, "steps": steps, "batch": batch, "lr": lr,
              "seed": seed, "games": games, "max_turns": max_turns, "steps_run": len(losses),
              "train_seconds": round(time.perf_counter() - start, 2), "losses": [round(x, 5) for x in losses]}
    return save_base_model(out_dir, model, tokenizer, record)
