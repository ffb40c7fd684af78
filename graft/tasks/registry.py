"""The built-in tasks and where a run's examples come from.

`TASKS` lists every built-in task (`data.task`) by name, in this one place: a new one is a function
in its own module returning (train, held-out) examples, and a line here. `load_task_data` gives a
run its (train, held-out) examples: a built-in task looked up by name, or data files.
"""

import inspect
import random
from collections.abc import Callable
from pathlib import Path

from graft.config import DataConfig, GraftConfig
from graft.tasks.arithmetic import arithmetic_task
from graft.tasks.envs.calculator import calculator_task
from graft.tasks.envs.guessing import guessing_task
from graft.tasks.examples import Example, load_examples, with_system_prompt

# name -> factory returning (train, held-out), called with its defaults by a run. The environments'
# tasks (calculator, guessing) share their environment's name (`graft.tasks.envs.ENVS`).
TASKS: dict[str, Callable[..., tuple[list[Example], list[Example]]]] = {
    "arithmetic": arithmetic_task,
    "calculator": calculator_task,
    "guessing": guessing_task,
}

_EVAL_FRACTION = 0.1
_SPLIT_SEED = 0


def _held_out_split(examples: list[Example]) -> tuple[list[Example], list[Example]]:
    """Holds out 10% (rounded down) of the examples, chosen by a fixed seed so every run of the same
    file gets the same split; a sorted file still gives a mixed eval set. Both keep file order."""
    n_eval = int(len(examples) * _EVAL_FRACTION)
    eval_idx = set(random.Random(_SPLIT_SEED).sample(range(len(examples)), n_eval))
    train = [ex for i, ex in enumerate(examples) if i not in eval_idx]
    held_out = [ex for i, ex in enumerate(examples) if i in eval_idx]
    return train, held_out


def _built_in_task(name: str, options: dict) -> tuple[list[Example], list[Example]]:
    """TASKS[name](**options), its options checked by name first: a typo would otherwise surface as
    Python's "unexpected keyword argument" deep in a run's start."""
    if name not in TASKS:
        raise ValueError(f"unknown data.task {name!r}; known tasks: {sorted(TASKS)}")
    known = list(inspect.signature(TASKS[name]).parameters)
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"data.task_options {unknown} are not settings of the task {name!r}; its settings: {known}")
    try:
        return TASKS[name](**options)
    except (TypeError, ValueError) as e:
        raise ValueError(f"data.task_options {options} for the task {name!r}: {e}") from None


def load_task_data(data_config: DataConfig) -> tuple[list[Example], list[Example]]:
    """The (train, held-out eval) examples a run uses.

    `data.task` names a built-in task in `TASKS`, built with `data.task_options` (its defaults where
    empty). Otherwise `data.path` is read (fields mapped by `data.prompt_key` and `data.answer_key`);
    the eval set is `data.eval_path` when given, else a deterministic 10% of `data.path`. `data.system_prompt`, when
    set, goes in front of every prompt without a system message of its own.

    Raises:
        ValueError: For an unknown task name (listing the known ones) or a malformed data file.
    """
    if data_config.task is not None:
        train, held_out = _built_in_task(data_config.task, data_config.task_options)
    else:
        assert data_config.path is not None  # DataConfig guarantees exactly one source
        keys = {"prompt_key": data_config.prompt_key, "answer_key": data_config.answer_key}
        train = load_examples(data_config.path, **keys)
        if data_config.eval_path is not None:
            held_out = load_examples(data_config.eval_path, **keys)
        else:
            train, held_out = _held_out_split(train)
    if (system := data_config.system_prompt) is not None:
        train = [with_system_prompt(ex, system) for ex in train]
        held_out = [with_system_prompt(ex, system) for ex in held_out]
    return train, held_out


def check_local_model_prompts(config: GraftConfig) -> None:
    """`graft config`'s part of train's prompt checks (`graft.tasks.prompts.run_prompt_format`): where
    model.path is a model directory already here and the data loads. A packaged name or a .gguf is
    checked by train and eval, after it is fetched or converted (minutes), which a config check must
    not do, and data that does not load here (a config written for another machine) is train's to
    report."""
    from graft.models.loading import load_tokenizer
    from graft.tasks.prompts import run_prompt_format

    model_path = config.model.path
    if model_path is None or not (Path(model_path) / "tokenizer_config.json").is_file():
        return
    try:
        train_set, eval_set = load_task_data(config.data)
    except (ValueError, OSError):
        return
    run_prompt_format(config, load_tokenizer(model_path), train_set + eval_set[: config.train.eval_examples])
