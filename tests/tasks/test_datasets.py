"""graft.tasks.datasets (and load_examples on top of it): JSONL, Parquet and saved Hugging Face dataset
directories read into the same examples; each bad input one error naming the file (CPU, seconds)."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from graft.config import DataConfig
from graft.tasks import Example, load_examples, load_task_data
from graft.tasks.datasets import read_records

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
ROWS = [
    {"question": CHAT, "solution": "2 + 2 = 4\n#### 4", "level": 1},
    {"question": [{"role": "user", "content": "What is 3 + 4?"}], "solution": "#### 7", "level": 2},
]
EXPECTED = [
    Example(CHAT, "2 + 2 = 4\n#### 4", {"level": 1}),
    Example([{"role": "user", "content": "What is 3 + 4?"}], "#### 7", {"level": 2}),
]
KEYS = {"prompt_key": "question", "answer_key": "solution"}


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_the_three_formats_give_the_same_examples(tmp_path):
    import datasets

    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "hf"))
    for path in (_jsonl(tmp_path / "d.jsonl", ROWS), _parquet(tmp_path / "d.parquet", ROWS), tmp_path / "hf"):
        assert load_examples(path, **KEYS) == EXPECTED, path


def test_records_name_where_they_came_from(tmp_path):
    records, columns = read_records(_parquet(tmp_path / "d.parquet", ROWS))
    assert [where for where, _ in records] == [f"{tmp_path / 'd.parquet'} row 0", f"{tmp_path / 'd.parquet'} row 1"]
    assert columns == ["question", "solution", "level"]
    records, columns = read_records(_jsonl(tmp_path / "d.jsonl", ROWS))
    assert [where for where, _ in records] == [f"{tmp_path / 'd.jsonl'}:1", f"{tmp_path / 'd.jsonl'}:2"]
    assert columns is None


def test_a_table_missing_the_prompt_column_is_one_error_naming_file_and_setting(tmp_path):
    path = _parquet(tmp_path / "d.parquet", ROWS)
    with pytest.raises(ValueError) as info:
        load_examples(path)  # the default prompt_key "prompt"
    assert str(info.value) == (f"{path} has no column 'prompt' (data.prompt_key); its columns: "
                               "['question', 'solution', 'level']")
    with pytest.raises(ValueError, match=r"no column 'answer' \(data.answer_key\)"):
        load_examples(path, prompt_key="question")


def test_a_malformed_parquet_file_is_one_error_naming_it(tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(_parquet(tmp_path / "good.parquet", ROWS).read_bytes()[:-20])  # footer cut off
    with pytest.raises(ValueError, match=rf"^{path}: not a readable Parquet file \("):
        load_examples(path, **KEYS)
    (tmp_path / "text.parquet").write_text('{"prompt": "p", "answer": 1}\n')  # JSONL under a .parquet name
    with pytest.raises(ValueError, match="not a readable Parquet file"):
        load_examples(tmp_path / "text.parquet")


def test_a_parquet_row_with_a_bad_prompt_names_the_row(tmp_path):
    path = _parquet(tmp_path / "d.parquet", [{"prompt": "fine", "answer": 1}, {"prompt": None, "answer": 2}])
    with pytest.raises(ValueError, match=rf"^{path} row 1: 'prompt' must be a string or a non-empty list"):
        load_examples(path)


def test_an_empty_table_has_no_examples(tmp_path):
    path = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), path)
    with pytest.raises(ValueError, match="no examples"):
        load_examples(path)


def test_a_dataset_dict_directory_points_at_its_splits(tmp_path):
    import datasets

    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                                   "test": datasets.Dataset.from_list(ROWS[:1])})
    splits.save_to_disk(str(tmp_path / "gsm"))
    with pytest.raises(ValueError, match=r"DatasetDict with splits \['test', 'train'\]: point data.path .* at one "
                                         r"split's directory"):
        load_examples(tmp_path / "gsm", **KEYS)
    config = DataConfig(path=str(tmp_path / "gsm" / "train"), eval_path=str(tmp_path / "gsm" / "test"), **KEYS)
    assert load_task_data(config) == (EXPECTED, EXPECTED[:1])


def test_a_directory_that_is_no_dataset_is_one_error(tmp_path):
    (tmp_path / "notes").mkdir()
    with pytest.raises(ValueError, match="is a directory but not a saved Hugging Face dataset"):
        load_examples(tmp_path / "notes")


def test_a_missing_file_is_file_not_found(tmp_path):
    for name in ("missing.jsonl", "missing.parquet"):
        with pytest.raises(FileNotFoundError):
            load_examples(tmp_path / name)
