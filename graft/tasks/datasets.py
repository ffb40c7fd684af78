"""Reading data files into records (one dict per example), whatever their format.

`read_records(path)` picks the reader from the path: a directory is a Hugging Face `datasets`
directory (written by `save_to_disk`), a `.parquet` file is Parquet, anything else is JSONL. Each
record comes with where it was read from (``file:line`` or ``file row N``), so an error about one
record names it. Turning records into `Example`s (which fields are the prompt and the answer) is
`graft.tasks.examples`' job.
"""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PARQUET_SUFFIXES = (".parquet", ".pq")

Record = tuple[str, Any]  # (where it was read from, the decoded record)


def read_records(path: str | Path) -> tuple[list[Record], list[str] | None]:
    """The records of a data file or directory, and its column names (None for JSONL, whose lines
    may each have their own fields).

    Raises:
        ValueError: Naming the file: an unreadable Parquet file, a directory that is not a saved
            Hugging Face dataset (or is a DatasetDict, whose splits are its subdirectories), a line
            that is not JSON, or no records at all.
        FileNotFoundError: The path does not exist.
    """
    path = Path(path)
    if path.is_dir():
        records, columns = _read_hf_dir(path)
    elif path.suffix in PARQUET_SUFFIXES:
        records, columns = _read_parquet(path)
    else:
        records, columns = list(_read_jsonl(path)), None
    if not records:
        raise ValueError(f"{path}: no examples (it is empty)")
    return records, columns


def _read_jsonl(path: Path) -> Iterator[Record]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg})") from e


def _read_parquet(path: Path) -> tuple[list[Record], list[str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not path.exists():
        raise FileNotFoundError(f"data file {path} does not exist")
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:  # ArrowInvalid: not Parquet, truncated, bad footer
        raise ValueError(f"{path}: not a readable Parquet file ({e})") from None
    return [(f"{path} row {i}", row) for i, row in enumerate(table.to_pylist())], table.column_names


def _read_hf_dir(path: Path) -> tuple[list[Record], list[str]]:
    """A directory written by `Dataset.save_to_disk` (read with `datasets.load_from_disk`)."""
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
        raise ValueError(f"{path} is a Hugging Face DatasetDict with splits {splits}: point data.path (and "
                         f"data.eval_path) at one split's directory, e.g. {path / (splits[0] if splits else 'train')}")
    if not (path / "state.json").is_file():
        raise ValueError(f"{path} is a directory but not a saved Hugging Face dataset (no state.json; "
                         "write one with Dataset.save_to_disk), a JSONL file or a Parquet file")
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{path} is a Hugging Face dataset directory: reading it needs the 'datasets' package "
                         "(pip install datasets)") from None
    try:
        dataset = datasets.load_from_disk(str(path))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot load the Hugging Face dataset ({e})") from None
    return [(f"{path} row {i}", row) for i, row in enumerate(dataset.to_list())], list(dataset.column_names)
