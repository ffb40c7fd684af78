"""The quickstart's pieces: each task's settings are its shipped config's, its base model is cached."""

from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from graft.config import load_config
from graft.quickstart import base as quickstart

REPO = Path(__file__).parents[2]


@pytest.mark.parametrize("task", list(quickstart.QUICKSTART_TASKS))
def test_quickstart_runs_what_its_shipped_config_says(tmp_path, task):
    config = quickstart.QUICKSTART_TASKS[task].config
    shipped = load_config(REPO / config, [f"model.path={tmp_path}", "train.seed=3"])
    assert quickstart.quickstart_config(tmp_path, seed=3, task=task) == shipped
    assert quickstart.quickstart_config(tmp_path, seed=3, steps=7, task=task).train.steps == 7


SMALL_ARGS = {
    "arithmetic": {"hidden": 64, "layers": 1, "steps": 3, "batch": 4, "lr": 1e-3, "target_accuracy": None,
                   "progress": False},
    "tools": {"hidden": 64, "layers": 1, "steps": 3, "batch": 4, "lr": 1e-3, "games": 8, "env": "calculator",
              "max_turns": 2, "progress": False},
    "guessing": {"hidden": 64, "layers": 1, "steps": 3, "batch": 4, "lr": 1e-3, "games": 8, "env": "guessing",
                 "progress": False},
}


@pytest.mark.parametrize("task", list(quickstart.QUICKSTART_TASKS))
def test_base_model_is_built_once_per_arguments_and_task(tmp_path, monkeypatch, task):
    small = replace(quickstart.QUICKSTART_TASKS[task], sft_args=SMALL_ARGS[task])
    monkeypatch.setitem(quickstart.QUICKSTART_TASKS, task, small)
    console = Console(file=open(tmp_path / "out.txt", "w"))
    first, built = quickstart.cached_base_model(0, tmp_path / "cache", console, task)
    assert built and (first / "sft.json").is_file()
    again, built_again = quickstart.cached_base_model(0, tmp_path / "cache", console, task)
    other, _ = quickstart.cached_base_model(1, tmp_path / "cache", console, task)
    assert again == first and not built_again and other != first
    assert (task == "arithmetic") == first.name.startswith("quickstart-base-")


def test_the_cli_offers_exactly_the_quickstart_tasks():
    from graft.cli import build_parser

    quickstart_parser = build_parser()._subparsers._group_actions[0].choices["quickstart"]
    [task] = [a for a in quickstart_parser._actions if a.dest == "task"]
    assert set(task.choices) == set(quickstart.QUICKSTART_TASKS) and task.default == "arithmetic"


def test_the_cli_offers_exactly_the_quickstart_models():
    from graft.cli import build_parser

    quickstart_parser = build_parser()._subparsers._group_actions[0].choices["quickstart"]
    [model] = [a for a in quickstart_parser._actions if a.dest == "model"]
    assert set(model.choices) == set(quickstart.MODELS) and model.default == "tiny"


@pytest.mark.parametrize("model", list(quickstart.REAL_MODEL_CONFIGS))
def test_a_real_model_quickstart_runs_its_shipped_config(tmp_path, model):
    shipped = load_config(REPO / quickstart.REAL_MODEL_CONFIGS[model], [f"model.path={tmp_path}", "train.seed=3"])
    assert quickstart.quickstart_config(tmp_path, seed=3, model=model) == shipped
    with pytest.raises(ValueError, match=f"--model {model} runs the arithmetic task only"):
        quickstart.quickstart_base(model, "tools", 0, tmp_path, Console(file=open(tmp_path / "out.txt", "w")))
