"""Examples (a prompt and its reference answer), where they come from, and how a prompt becomes ids.

A run gets its data either from a built-in task looked up by name in `TASKS` (the synthetic
arithmetic task registers itself there) or from a JSONL file. Both give the same thing: a training
list and a held-out eval list of `Example`s. Rewards compare completions with `Example.answer`.
"""

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from graft.config import DataConfig


@dataclass(frozen=True)
class Example:
    """One prompt with the answer a reward checks against.

    Attributes:
        prompt: The user's message, without any chat template applied.
        answer: The reference answer as text (numbers from JSONL are converted with `str`).
        metadata: Free-form details kept for logging and analysis (e.g. the operands).
    """

    prompt: str
    answer: str
    metadata: dict = field(default_factory=dict)


# name -> factory returning (train, eval); built-in tasks add themselves on import of graft.tasks.
TASKS: dict[str, Callable[..., tuple[list[Example], list[Example]]]] = {}

_KEYS = {"prompt", "answer", "metadata"}
_EVAL_FRACTION = 0.1
_SPLIT_SEED = 0


def _parse_line(obj: Any, where: str) -> Example:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = sorted({"prompt", "answer"} - obj.keys())
    if missing:
        raise ValueError(f"{where}: missing key(s) {missing}")
    unknown = sorted(obj.keys() - _KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; put extra fields under 'metadata'")
    prompt, answer, metadata = obj["prompt"], obj["answer"], obj.get("metadata", {})
    if not isinstance(prompt, str):
        raise ValueError(f"{where}: 'prompt' must be a string, got {type(prompt).__name__}")
    # bool is an int subclass, but `true` is not a numeric answer.
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ValueError(f"{where}: 'answer' must be a string or a number, got {type(answer).__name__}")
    if not isinstance(metadata, dict):
        raise ValueError(f"{where}: 'metadata' must be an object, got {type(metadata).__name__}")
    return Example(prompt=prompt, answer=str(answer), metadata=metadata)


def load_jsonl(path: str | Path) -> list[Example]:
    """Reads examples from a JSONL file: one object per line with `prompt`, `answer`, optional `metadata`.

    Args:
        path: The file. Blank lines are skipped.

    Returns:
        The examples in file order.

    Raises:
        ValueError: Naming ``file:line`` and the problem, for a line that is not JSON, not an object,
            lacks `prompt` or `answer`, has an unknown key, or has a value of the wrong type; or for
            a file with no examples.
    """
    path = Path(path)
    examples = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg})") from e
            examples.append(_parse_line(obj, where))
    if not examples:
        raise ValueError(f"{path}: no examples (the file is empty)")
    return examples


def render_prompt_ids(tokenizer: PreTrainedTokenizerBase, example: Example) -> list[int]:
    """Token ids of the prompt as the policy sees it: one user turn in the chat template, then the
    opened assistant turn the model completes.

    The template is rendered to text and then encoded with ``add_special_tokens=False``: the
    template already writes every special token it wants, and a tokenizer that adds a bos on encode
    would otherwise put a second one in front.
    """
    messages = [{"role": "user", "content": example.prompt}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def _held_out_split(examples: list[Example]) -> tuple[list[Example], list[Example]]:
    """Holds out 10% (rounded down) of the examples, chosen by a fixed seed so every run of the same
    file gets the same split; a sorted file still gives a mixed eval set. Both keep file order."""
    n_eval = int(len(examples) * _EVAL_FRACTION)
    eval_idx = set(random.Random(_SPLIT_SEED).sample(range(len(examples)), n_eval))
    train = [ex for i, ex in enumerate(examples) if i not in eval_idx]
    held_out = [ex for i, ex in enumerate(examples) if i in eval_idx]
    return train, held_out


def load_task_data(data_config: DataConfig) -> tuple[list[Example], list[Example]]:
    """The (train, held-out eval) examples a run uses.

    `data.task` names a built-in task in `TASKS`, built with its defaults. Otherwise `data.path` is
    read; the eval set is `data.eval_path` when given, else a deterministic 10% of `data.path`.

    Raises:
        ValueError: For an unknown task name (listing the known ones) or a malformed JSONL file.
    """
    if data_config.task is not None:
        if data_config.task not in TASKS:
            raise ValueError(f"unknown data.task {data_config.task!r}; known tasks: {sorted(TASKS)}")
        return TASKS[data_config.task]()
    assert data_config.path is not None  # DataConfig guarantees exactly one source
    examples = load_jsonl(data_config.path)
    if data_config.eval_path is not None:
        return examples, load_jsonl(data_config.eval_path)
    return _held_out_split(examples)
