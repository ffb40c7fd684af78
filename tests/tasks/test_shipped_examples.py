"""The shipped bring-your-own example: examples/ files match their generator, and
configs/byo-example.yaml loads its data and rewards and scores a right answer above a wrong one."""

import asyncio
import runpy
from pathlib import Path

import pytest

from graft.config import load_config
from graft.tasks import load_eval_scorer, load_examples, load_scorer, load_task_data

REPO = Path(__file__).parents[2]


def test_the_word_problem_files_are_what_the_generator_writes(tmp_path):
    runpy.run_path(str(REPO / "examples" / "make_word_problems.py"))["write"](tmp_path)
    for name in ("word-problems-train.jsonl", "word-problems-eval.parquet"):
        keys = {"prompt_key": "messages", "answer_key": "solution"}
        assert load_examples(REPO / "examples" / name, **keys) == load_examples(tmp_path / name, **keys), name


def test_byo_example_config_trains_on_its_files_with_its_rewards(monkeypatch):
    monkeypatch.chdir(REPO)  # the config's paths are relative to the repository root
    config = load_config(REPO / "configs" / "byo-example.yaml", ["model.path=unused"])
    train, held_out = load_task_data(config.data)
    assert (len(train), len(held_out)) == (48, 16)
    example = train[0]
    assert example.prompt[0]["role"] == "system" and example.prompt[1]["role"] == "user"
    assert example.answer.endswith("#### 1") and example.metadata == {"topic": "hobbies"}
    scorer = load_scorer(config.data)
    right = "7 + 10 = 17, 17 - 16 = 1.\n#### 1"
    scores = asyncio.run(scorer([right, "#### 3", right], [example] * 3))
    assert scores.rewards == pytest.approx([1.0 + 0.2, 0.2, 1.0 + 0.2 - 0.1])  # the third repeats the first
    assert scores.metrics["reward/examples/my_reward.py:distinct_answers"] == pytest.approx(-1 / 3)
    held_out_scores = asyncio.run(load_eval_scorer(config.data)([right, "#### 3", right], [example] * 3))
    assert held_out_scores.rewards == [1.0, 0.0, 1.0]  # held-out accuracy: math alone
