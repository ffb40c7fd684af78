"""Examples (a prompt and its reference answer), where they come from, and how a prompt becomes ids.

A run gets its data either from a built-in task looked up by name (`graft.tasks.registry`) or from
data files (JSONL, Parquet or a saved Hugging Face dataset; `graft.tasks.datasets` reads them, and
`load_examples` here makes `Example`s of them). Rewards compare completions with `Example.answer`.
"""

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from graft.tasks.datasets import read_records


@dataclass(frozen=True)
class Example:
    """One prompt with the answer a reward checks against.

    Attributes:
        prompt: The user's message (a string), or chat messages (a list of ``{"role", "content"}``
            dicts, e.g. with a system message), without any chat template applied.
        answer: The reference answer as text (numbers from data files are converted with `str`);
            "" when the data has none (data.answer_key: null).
        metadata: Every other field of the record (e.g. the operands, a test case, an id): rewards
            may read it.
    """

    prompt: str | list[dict]
    answer: str
    metadata: dict = field(default_factory=dict)


def load_examples(path: str | Path, prompt_key: str = "prompt", answer_key: str | None = "answer") -> list[Example]:
    """Reads examples from a JSONL file, a Parquet file or a saved Hugging Face dataset directory
    (see `graft.tasks.datasets.read_records`).

    Each record's `prompt_key` field is the prompt (a string, or chat messages: a list of
    ``{role, content}``), its `answer_key` field the answer (a string or a number, kept as text);
    every other field goes into `metadata`, and a field named ``metadata`` holding an object is
    merged into it (so ``{"prompt": ..., "answer": ..., "metadata": {"id": 2}}`` has metadata
    ``{"id": 2}``).

    Args:
        path: The file or directory. Blank JSONL lines are skipped.
        prompt_key: The prompt's field (data.prompt_key).
        answer_key: The answer's field (data.answer_key); None = no answer (Example.answer is "").

    Returns:
        The examples in file order.

    Raises:
        ValueError: Naming the file (and line or row) and the problem: a record that is not an
            object, lacks the prompt or answer field, or has a value of the wrong type; an
            unreadable file; a file with no examples.
    """
    records, columns = read_records(path)
    if columns is not None:  # a table: a missing field is missing from every row, say it once
        for key, setting in ((prompt_key, "data.prompt_key"), (answer_key, "data.answer_key")):
            if key is not None and key not in columns:
                raise ValueError(f"{path} has no column {key!r} ({setting}); its columns: {columns}")
    return [example_from_record(record, where, prompt_key, answer_key) for where, record in records]


def example_from_record(record: Any, where: str, prompt_key: str = "prompt",
                        answer_key: str | None = "answer") -> Example:
    """One record (a dict) as an `Example`; `where` names it in errors (see `load_examples`)."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected an object with the fields of one example, got {type(record).__name__}")
    for key, setting in ((prompt_key, "data.prompt_key"), (answer_key, "data.answer_key")):
        if key is not None and key not in record:
            raise ValueError(f"{where}: no field {key!r} ({setting}); its fields: {sorted(record)}")
    prompt = _prompt(record[prompt_key], where, prompt_key)
    answer = "" if answer_key is None else record[answer_key]
    # bool is an int subclass, but `true` is not a numeric answer.
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ValueError(f"{where}: {answer_key!r} must be a string or a number, got {type(answer).__name__}")
    rest = {k: v for k, v in record.items() if k not in (prompt_key, answer_key)}
    nested = rest.pop("metadata", None)
    if nested is None:
        nested = {}
    if not isinstance(nested, dict):
        raise ValueError(f"{where}: 'metadata' must be an object, got {type(nested).__name__}")
    clash = sorted(nested.keys() & rest.keys())
    if clash:
        raise ValueError(f"{where}: field(s) {clash} appear both at the top level and under 'metadata'")
    return Example(prompt=prompt, answer=str(answer), metadata={**nested, **rest})


def _prompt(value: Any, where: str, key: str) -> str | list[dict]:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise ValueError(f"{where}: {key!r} must be a string or a non-empty list of chat messages "
                     f"{{'role': str, 'content': str}}, got {shorten(repr(value))}")


def shorten(text: str, limit: int = 80) -> str:
    """`text`, cut to `limit` characters with an ellipsis: a value quoted in an error message."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def prompt_messages(example: Example) -> list[dict]:
    """The prompt as chat messages: a string prompt is one user message."""
    if isinstance(example.prompt, str):
        return [{"role": "user", "content": example.prompt}]
    return example.prompt


def with_system_prompt(example: Example, system_prompt: str) -> Example:
    """`example` with `system_prompt` in front, unless its prompt starts with a system message."""
    messages = prompt_messages(example)
    if messages[0]["role"] == "system":
        return example
    return replace(example, prompt=[{"role": "system", "content": system_prompt}, *messages])


def render_prompt_ids(tokenizer: PreTrainedTokenizerBase, example: Example) -> list[int]:
    """Token ids of a chat prompt (`graft.tasks.prompts` has the text ones): its messages (a string prompt is one user
    turn) in the chat template, then the opened assistant turn the model completes.

    The template is rendered to text and then encoded with ``add_special_tokens=False``: the
    template already writes every special token it wants, and a tokenizer that adds a bos on encode
    would otherwise put a second one in front.
    """
    text = tokenizer.apply_chat_template(prompt_messages(example), add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)
