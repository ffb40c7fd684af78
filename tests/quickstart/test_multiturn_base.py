"""The multi-turn quickstarts' bases: teacher episodes laid out token for token as sampled episodes,
the teachers playing as described (guesses the replies allow; the calculator called in a share of
the episodes and its value copied), the loss on the teacher's tokens only, deterministic SFT."""

import asyncio
import json
import random

import pytest
import torch
from safetensors.torch import load_file

from graft.models.tokenizer import train_tokenizer
from graft.quickstart.multiturn import HIGH, LOW, TOOL_SHARE, sft_multiturn_base, teacher_game
from graft.quickstart.warmup import IGNORE_INDEX, collate_labelled
from graft.rollout.engine import Completion, SamplingParams
from graft.rollout.episodes import EpisodeLimits, TurnRenderer, run_episode
from graft.tasks.envs import ENVS
from graft.tasks.envs.calculator import calculator_task
from graft.tasks.envs.guessing import guessing_task

TOKENIZER = train_tokenizer()
RENDERER = TurnRenderer(TOKENIZER)


class Replay:
    """An engine answering each turn with the next of the given token-id turns."""

    def __init__(self, turns):
        self.turns = iter(turns)

    async def generate(self, requests, adapter=None):
        ids = next(self.turns)
        return [[Completion(tuple(ids), [-1.0] * len(ids), "stop")]]


def _turns(ids, trained):
    """The runs of trained ids: the teacher's turns."""
    turns, current = [], []
    for token, mark in zip(ids, trained):
        if mark:
            current.append(token)
        elif current:
            turns, current = turns + [current], []
    return turns + [current] if current else turns


@pytest.mark.parametrize("env", ["guessing", "calculator"])
def test_a_teacher_game_is_the_episode_the_engine_would_build_from_the_same_turns(env):
    train, _ = (guessing_task if env == "guessing" else calculator_task)(seed=0)
    rng = random.Random(3)
    for example in train[:20]:
        ids, trained = teacher_game(RENDERER, env, example, rng, max_turns=4)
        turns = _turns(ids, trained)
        episode = asyncio.run(run_episode(Replay(turns), None, ENVS[env](), example, RENDERER,
                                          SamplingParams(temperature=1.0, max_new_tokens=32), EpisodeLimits(4, 512)))
        assert episode.prompt_ids + episode.completion_ids == ids
        assert [False] * len(episode.prompt_ids) + episode.loss_mask == trained
        assert all(turn[-1] == TOKENIZER.eos_token_id for turn in turns)


def test_the_teacher_guesses_only_numbers_the_replies_allow_and_stops_on_a_hit():
    train, _ = guessing_task(seed=1)
    rng, hits = random.Random(0), 0
    for example in train[:200]:
        ids, trained = teacher_game(RENDERER, "guessing", example, rng, max_turns=4)
        guesses = [int(TOKENIZER.decode(turn, skip_special_tokens=True)) for turn in _turns(ids, trained)]
        secret, low, high = int(example.answer), LOW, HIGH
        for guess in guesses[:-1]:
            assert low <= guess <= high and guess != secret
            low, high = (guess + 1, high) if guess < secret else (low, guess - 1)
        assert low <= guesses[-1] <= high
        assert guesses[-1] == secret or len(guesses) == 4
        hits += guesses[-1] == secret
    assert 0.5 < hits / 200 < 1.0  # a consistent random searcher finds most secrets in 4 guesses, not all


def test_the_tools_teacher_calls_the_calculator_in_its_share_of_episodes_and_copies_the_value():
    train, _ = calculator_task(seed=0)
    rng, calls = random.Random(0), 0
    for example in train[:300]:
        ids, trained = teacher_game(RENDERER, "calculator", example, rng, max_turns=4)
        turns = [TOKENIZER.decode(turn, skip_special_tokens=True) for turn in _turns(ids, trained)]
        product = str(example.metadata["a"] * example.metadata["b"])
        if len(turns) == 2:
            calls += 1
            assert turns == [f"calc: {example.metadata['a']} * {example.metadata['b']}", product]
        else:  # at once, by heart: the leading digits right, the answer wrong
            assert len(turns) == 1 and turns[0][:2] == product[:2] and turns[0] != product
            assert len(turns[0]) == len(product)
    assert abs(calls / 300 - TOOL_SHARE) < 0.1


def test_collate_puts_labels_on_the_teacher_tokens_only():
    train, _ = guessing_task(seed=0)
    games = [teacher_game(RENDERER, "guessing", ex, random.Random(i), max_turns=4) for i, ex in enumerate(train[:5])]
    input_ids_BT, labels_BT, attention_mask_BT = collate_labelled(games, TOKENIZER.pad_token_id)
    for row, (ids, trained) in enumerate(games):
        n = len(ids)
        assert input_ids_BT[row, :n].tolist() == ids and attention_mask_BT[row].sum() == n
        expected = [token if mark else IGNORE_INDEX for token, mark in zip(ids, trained)]
        assert labels_BT[row, :n].tolist() == expected
        assert (labels_BT[row, n:] == IGNORE_INDEX).all() and (input_ids_BT[row, n:] == TOKENIZER.pad_token_id).all()


def test_the_base_is_deterministic_and_records_its_training(tmp_path):
    args = {"hidden": 64, "layers": 1, "steps": 6, "batch": 8, "games": 40, "progress": False}
    first, second = (sft_multiturn_base(tmp_path / name, env="guessing", seed=2, **args) for name in ("a", "b"))
    a, b = (load_file(d / "model.safetensors") for d in (first, second))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    record = json.loads((first / "sft.json").read_text())
    assert record["env"] == "guessing" and record["steps_run"] == 6 and record["losses"][-1] < record["losses"][0]
