"""graft.tasks.examples: examples from records (field mapping, chat prompts, metadata), chat rendering and
load_task_data (CPU, seconds)."""

import json

import pytest

from graft.config import DataConfig
from graft.models.tokenizer import train_tokenizer
from graft.tasks import Example, load_examples, load_task_data, render_prompt_ids
from graft.tasks.arithmetic import arithmetic_task


def _write(path, lines: list[str]):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# --- load_examples --------------------------------------------------------------------------------


def test_load_examples_reads_jsonl(tmp_path):
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
    assert load_examples(path) == [
        Example("p1", "7", {}),
        Example("p2", "42", {"id": 2}),
        Example("p3", "-1.5", {}),
    ]


@pytest.mark.parametrize(
    "bad_line, problem",
    [
        ('{"prompt": "p", "answer": ', "invalid JSON"),
        ('["p", "1"]', "expected an object"),
        ('{"answer": "1"}', r"no field 'prompt' \(data.prompt_key\); its fields: \['answer'\]"),
        ('{"prompt": "p"}', r"no field 'answer' \(data.answer_key\)"),
        ('{"prompt": 3, "answer": "1"}', "'prompt' must be a string or a non-empty list of chat messages"),
        ('{"prompt": [], "answer": "1"}', "'prompt' must be a string or a non-empty list of chat messages"),
        ('{"prompt": [{"role": "user"}], "answer": "1"}', "'prompt' must be a string or a non-empty list"),
        ('{"prompt": "p", "answer": "1", "id": 1, "metadata": {"id": 2}}', r"\['id'\] appear both"),
        ('{"prompt": "p", "answer": [1]}', "'answer' must be a string or a number"),
        ('{"prompt": "p", "answer": true}', "'answer' must be a string or a number"),
        ('{"prompt": "p", "answer": "1", "metadata": 5}', "'metadata' must be an object"),
    ],
)
def test_load_examples_errors_name_file_and_line(tmp_path, bad_line, problem):
    good = json.dumps({"prompt": "p", "answer": "1"})
    path = _write(tmp_path / "bad.jsonl", [good, "", bad_line, good])  # the bad line is line 3
    with pytest.raises(ValueError, match=problem) as info:
        load_examples(path)
    assert f"{path}:3:" in str(info.value)


def test_load_examples_empty_file(tmp_path):
    path = _write(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(ValueError, match="no examples"):
        load_examples(path)


def test_field_mapping_chat_prompts_and_the_rest_in_metadata(tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}]
    path = _write(tmp_path / "chat.jsonl", [
        json.dumps({"messages": messages, "solution": "2 + 2 = 4\n#### 4", "level": 1, "metadata": {"id": 7}}),
        json.dumps({"messages": "3 + 3?", "solution": 6, "level": 2}),
    ])
    assert load_examples(path, prompt_key="messages", answer_key="solution") == [
        Example(messages, "2 + 2 = 4\n#### 4", {"id": 7, "level": 1}),
        Example("3 + 3?", "6", {"level": 2}),
    ]
    # The default keys now name fields these records lack: the error says which setting to change.
    with pytest.raises(ValueError, match=r"chat.jsonl:1: no field 'prompt' \(data.prompt_key\); its fields: "
                                         r"\['level', 'messages', 'metadata', 'solution'\]"):
        load_examples(path)


def test_no_answer_key_gives_empty_answers_and_keeps_every_other_field(tmp_path):
    path = _write(tmp_path / "open.jsonl", [json.dumps({"prompt": "Write a haiku.", "answer": "kept", "topic": "sea"})])
    assert load_examples(path, answer_key=None) == [Example("Write a haiku.", "", {"answer": "kept", "topic": "sea"})]


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


def test_render_prompt_ids_of_chat_messages(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}]
    text = tokenizer.decode(render_prompt_ids(tokenizer, Example(messages, "4")))
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2 + 2?<|im_end|>\n"
                    "<|im_start|>assistant\n")


# --- load_task_data -------------------------------------------------------------------------------


def test_load_task_data_builtin():
    train, held_out = load_task_data(DataConfig(task="arithmetic"))
    assert (train, held_out) == arithmetic_task()


def test_load_task_data_unknown_task_lists_known():
    with pytest.raises(ValueError, match=r"unknown data.task 'nope'.*'arithmetic'"):
        load_task_data(DataConfig(task="nope"))


def test_task_options_set_the_built_in_tasks_settings_and_a_wrong_one_is_named():
    train, held_out = load_task_data(DataConfig(task="arithmetic", task_options={"max_operand": 9, "n_train": 60, "n_eval": 20}))
    assert (train, held_out) == arithmetic_task(max_operand=9, n_train=60, n_eval=20)
    assert max(max(ex.metadata["a"], ex.metadata["b"]) for ex in train + held_out) == 9
    with pytest.raises(ValueError, match=r"data.task_options \['max_operands'\] are not settings of the task "
                                         r"'arithmetic'; its settings: \['seed', 'n_train', 'n_eval', 'max_operand'"):
        load_task_data(DataConfig(task="arithmetic", task_options={"max_operands": 9}))
    with pytest.raises(ValueError, match=r"data.task_options .* exceeds the 100 distinct questions"):
        load_task_data(DataConfig(task="arithmetic", task_options={"max_operand": 9}))  # 2000 + 1000 sums of 0-9
    with pytest.raises(ValueError, match=r"data.task is null: set data.task_options to \{\}"):
        DataConfig(path="records.jsonl", task_options={"max_operand": 9})


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


def test_system_prompt_goes_in_front_of_prompts_without_one(tmp_path):
    own = [{"role": "system", "content": "Mine."}, {"role": "user", "content": "q2"}]
    train = _write(tmp_path / "t.jsonl", [json.dumps({"prompt": "q1", "answer": 1}),
                                          json.dumps({"prompt": own, "answer": 2})])
    held = _write(tmp_path / "e.jsonl", [json.dumps({"prompt": [{"role": "user", "content": "q3"}], "answer": 3})])
    config = DataConfig(path=str(train), eval_path=str(held), system_prompt="Think.")
    train_set, held_out = load_task_data(config)
    system = {"role": "system", "content": "Think."}
    assert [ex.prompt for ex in train_set] == [[system, {"role": "user", "content": "q1"}], own]
    assert [ex.prompt for ex in held_out] == [[system, {"role": "user", "content": "q3"}]]
    builtin_train, _ = load_task_data(DataConfig(system_prompt="Think."))
    assert builtin_train[0].prompt[0] == system and builtin_train[0].answer == arithmetic_task()[0][0].answer
