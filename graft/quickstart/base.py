"""The quickstart's ingredients, as a library (the benches use them too), per task (`QUICKSTART_TASKS`): its
warm-up base model, built once per seed and cached, and its training settings, read from the task's
shipped config (`configs/quickstart.yaml`, `configs/tools-quickstart.yaml`, ...).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from graft.config import GraftConfig, load_config
from graft.models.packaged import packaged_model_dir
from graft.quickstart.multiturn import sft_multiturn_base
from graft.quickstart.warmup import RECIPE, sft_base_model

# The supervised warm-up of the base model (see graft.quickstart.warmup for why it stops at a probed
# greedy accuracy, and why half right: GRPO needs prompts with mixed right and wrong samples and room
# above; measured here, bases at 40% gained 11.5 points in 300 steps, bases at 48-56% 22-28 points).
SFT_ARGS = {"hidden": 128, "layers": 2, "steps": 2000, "batch": 64, "lr": 3e-3, "target_accuracy": 0.5}

# The multi-turn quickstarts (`graft quickstart --task tools|guessing`): bases that watched a teacher
# play the environment (graft.quickstart.multiturn).
MULTITURN_SFT_ARGS = {"hidden": 128, "layers": 2, "steps": 800, "batch": 64, "lr": 3e-3, "games": 4000}

# graft is installed editable (`make install`): the shipped configs are read from the checkout.
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class QuickstartTask:
    """What `graft quickstart --task NAME` runs: how its base model is warmed up, the shipped
    `config` (relative to the checkout) whose settings it trains with, and what its held-out number is."""

    sft_args: dict
    build: Callable[..., Path]  # build(out_dir, seed=..., **sft_args)
    config: str
    warmup: str  # shown while the base is built
    held_out: str


QUICKSTART_TASKS = {
    "arithmetic": QuickstartTask(SFT_ARGS, sft_base_model, "configs/quickstart.yaml",
                                 "supervised warm-up on arithmetic until half its answers are right, 1-5 min",
                                 "accuracy (greedy)"),
    "tools": QuickstartTask({**MULTITURN_SFT_ARGS, "env": "calculator", "max_turns": 2}, sft_multiturn_base,
                            "configs/tools-quickstart.yaml",
                            "supervised warm-up on a teacher's calculator episodes, 3-4 min",
                            "reward (greedy episodes)"),
    "guessing": QuickstartTask({**MULTITURN_SFT_ARGS, "env": "guessing", "max_turns": 4, "steps": 300},
                               sft_multiturn_base, "configs/guessing-quickstart.yaml",
                               "supervised warm-up on a random guesser's games, ~1 min", "reward (greedy episodes)"),
}


def cached_base_model(seed: int, cache_dir: Path, console: Console, task: str = "arithmetic") -> tuple[Path, bool]:
    """The warm-up base model of `task` for `seed`, built on first use; (its directory, whether it was
    built now)."""
    spec = QUICKSTART_TASKS[task]
    args = {**spec.sft_args, "seed": seed}
    # The arithmetic key has no task in it: bases cached before there were several tasks stay valid.
    keyed = {**args, "recipe": RECIPE} if task == "arithmetic" else {**args, "task": task}
    key = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:12]
    path = cache_dir / (f"quickstart-base-{key}" if task == "arithmetic" else f"quickstart-{task}-base-{key}")
    if (path / "sft.json").is_file():
        return path, False
    console.print(f"building the base model ({spec.warmup}; cached at {path})")
    cache_dir.mkdir(parents=True, exist_ok=True)
    spec.build(path, **args)
    return path, True


# `graft quickstart --model NAME`: a real pretrained model from `graft.models.packaged`, trained on
# arithmetic as it is (no warm-up) with its own shipped config (a base model's with text prompts).
REAL_MODEL_CONFIGS = {"smollm2": "configs/smollm2-quickstart.yaml",
                      "gemma3-270m": "configs/gemma3-quickstart.yaml"}
MODELS = ("tiny", *REAL_MODEL_CONFIGS)


def quickstart_base(model: str, task: str, seed: int, cache_dir: Path, console: Console) -> tuple[Path, bool]:
    """The base model `graft quickstart --model MODEL --task TASK` trains: the task's warm-up base for
    "tiny", else the packaged real model (converted once and cached); (its directory, whether it was
    built now).

    Raises:
        ValueError: a real model with a task other than arithmetic.
    """
    if model == "tiny":
        return cached_base_model(seed, cache_dir, console, task)
    if task != "arithmetic":
        raise ValueError(f"--model {model} runs the arithmetic task only (got --task {task})")
    converted = packaged_model_dir(model, cache_dir, log=console.print)
    return converted, False


def shipped_config(task: str, overrides: list[str], model: str = "tiny") -> GraftConfig:
    """The shipped config of `task` (`QUICKSTART_TASKS[task].config`) or real `model` with `overrides` on top."""
    config = QUICKSTART_TASKS[task].config if model == "tiny" else REAL_MODEL_CONFIGS[model]
    return load_config(REPO / config, overrides)


def quickstart_config(base_dir: Path, seed: int, steps: int | None = None, task: str = "arithmetic",
                      model: str = "tiny") -> GraftConfig:
    """What `graft quickstart --task TASK --model MODEL` trains with: the shipped config on `base_dir`,
    seeded by `seed`; `steps` (the --steps flag) replaces the config's train.steps when given."""
    overrides = [f"model.path={base_dir}", f"train.seed={seed}"]
    if steps is not None:
        overrides.append(f"train.steps={steps}")
    return shipped_config(task, overrides, model)
