"""graft.tasks.examples: examples, JSONL loading, chat rendering and load_task_data (CPU, seconds)."""

import json

import pytest

from graft.config import DataConfig
from graft.models.tokenizer import train_tokenizer
from graft.tasks import Example, load_jsonl, load_task_data, render_prompt_ids
from graft.tasks.arithmetic import arithmetic_task


def _write(path, lines: list[str]):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# --- load_jsonl -----------------------------------------------------------------------------------


def test_load_jsonl_reads_examples(tmp_path):
    path = _write(
        tmp_path / "d.jsonl",
        [
            json.dumps({"prompt": "p1", "answer": "7"}),
            "",
            "   ",
            json.dumps({"prompt": "p2", "answer": 42, "metadata": {"id": 2}}),
            json.dumps({"prompt": "p3", "answer": -1.5}),
        ],
    )
    assert load_jsonl(path) == [
        Example("p1", "7", {}),
        Example("p2", "42", {"id": 2}),
        Example("p3", "-1.5", {}),
    ]


@pytest.mark.parametrize(
    "bad_line, problem",
    [
        ('{"prompt": "p", "answer": ', "invalid JSON"),
        ('["p", "1"]', "expected a JSON object"),
        ('{"answer": "1"}', r"missing key\(s\) \['prompt'\]"),
        ('{"prompt": "p"}', r"missing key\(s\) \['answer'\]"),
        ('{"prompt": "p", "answer": "1", "extra": 1}', r"unknown key\(s\) \['extra'\]"),
        ('{"prompt": 3, "answer": "1"}', "'prompt' must be a string"),
        ('{"prompt": "p", "answer": [1]}', "'answer' must be a string or a number"),
        ('{"prompt": "p", "answer": true}', "'answer' must be a string or a number"),
        ('{"prompt": "p", "answer": "1", "metadata": 5}', "'metadata' must be an object"),
    ],
)
def test_load_jsonl_errors_name_file_and_line(tmp_path, bad_line, problem):
    good = json.dumps({"prompt": "p", "answer": "1"})
    path = _write(tmp_path / "bad.jsonl", [good, "", bad_line, good])  # the bad line is line 3
    with pytest.raises(ValueError, match=problem) as info:
        load_jsonl(path)
    assert f"{path}:3:" in str(info.value)


def test_load_jsonl_empty_file(tmp_path):
    path = _write(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(ValueError, match="no examples"):
        load_jsonl(path)


# --- render_prompt_ids ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


def test_render_prompt_ids_uses_chat_template(tokenizer):
    ex = Example("What is 23 + 58? Answer with the number only.", "81")
    ids = render_prompt_ids(tokenizer, ex)
    assert all(isinstance(i, int) for i in ids)
    text = tokenizer.decode(ids)
    assert text == f"<|im_start|>user\n{ex.prompt}<|im_end|>\n<|im_start|>assistant\n"
    # No bos or other extra special token in front; the template's special tokens are single ids.
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 2
    assert ids.count(tokenizer.eos_token_id) == 1
    # Ends with the opened assistant turn, so the model's first token is its answer.
    header = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert ids[-len(header) :] == header
    # The prompt text round-trips, digit by digit.
    digits = [tokenizer.convert_tokens_to_ids(d) for d in "2358"]
    assert all(d in ids for d in digits)


# --- load_task_data -------------------------------------------------------------------------------


def test_load_task_data_builtin():
    train, held_out = load_task_data(DataConfig(task="arithmetic"))
    assert (train, held_out) == arithmetic_task()


def test_load_task_data_unknown_task_lists_known():
    with pytest.raises(ValueError, match=r"unknown data.task 'nope'.*'arithmetic'"):
        load_task_data(DataConfig(task="nope"))


def _numbered(tmp_path, name: str, n: int):
    lines = [json.dumps({"prompt": f"{name} {i}", "answer": i}) for i in range(n)]
    return _write(tmp_path / f"{name}.jsonl", lines)


def test_load_task_data_path_and_eval_path(tmp_path):
    config = DataConfig(path=str(_numbered(tmp_path, "train", 7)), eval_path=str(_numbered(tmp_path, "eval", 3)))
    train, held_out = load_task_data(config)
    assert [ex.prompt for ex in train] == [f"train {i}" for i in range(7)]
    assert [ex.prompt for ex in held_out] == [f"eval {i}" for i in range(3)]


@pytest.mark.parametrize("n, n_eval", [(100, 10), (55, 5), (9, 0)])
def test_load_task_data_held_out_split(tmp_path, n, n_eval):
    config = DataConfig(path=str(_numbered(tmp_path, "all", n)))
    train, held_out = load_task_data(config)
    assert (len(train), len(held_out)) == (n - n_eval, n_eval)
    assert sorted(ex.answer for ex in train + held_out) == sorted(str(i) for i in range(n))  # a partition
    assert load_task_data(config) == (train, held_out)  # deterministic
    if n_eval:
        assert [ex.answer for ex in held_out] != [str(i) for i in range(n - n_eval, n)]  # mixed, not the tail
