"""The latest result of each bench, kept in the repository as `docs/results/NAME.json`.

A number typed into the docs by hand goes stale the day the code or the machine changes, and says
neither which machine nor which commit it came from. So every table in docs/benchmarks.md and the
README's quickstart tables are rendered (`graft.bench.report.render`) from these files, and each file
carries, beside the bench's own JSON (`result`), where it came from:

    {"name": "e2e", "command": "graft bench e2e --record", "date": "2026-11-26",
     "machine": {"cpu": "AMD EPYC", "cores": 2, "vector": "AVX-512", "memory_gib": 24, "gpu": null},
     "git": "9049b3b", "note": "...", "result": {...}}

`graft bench NAME ... --record [FILE_NAME]` writes one after the run; `graft bench report --add
FILE_NAME PATH` keeps a result made elsewhere (a quickstart's run directory, `make gpu-check`'s
gpu-check.json). `note` says what the numbers alone do not (the machine was busy, a point came from
another run); `typed_by_hand: true` marks the files seeded from the docs' hand-typed tables, whose
numbers are only as precise as the docs printed them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
RESULTS_DIR = ROOT / "docs" / "results"


def _cpu_info() -> tuple[str | None, str | None]:
    """(the CPU's model name, its widest vector extension) from /proc/cpuinfo; (None, None) elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None, None
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), None)
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else None
    return name, vector


def _memory_gib() -> int | None:
    try:
        kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal:"))
    except (OSError, StopIteration):
        return None
    return round(kib / 2**20)


def _gpu() -> str | None:
    """The CUDA device's name where the bench has imported torch and sees one (a bench that never
    imported torch ran on no GPU)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name()


def machine() -> dict:
    """What the timings depend on: CPU model, cores, vector extension, memory, GPU."""
    cpu, vector = _cpu_info()
    return {"cpu": cpu, "cores": os.cpu_count(), "vector": vector, "memory_gib": _memory_gib(), "gpu": _gpu()}


def git_revision() -> str | None:
    """The source tree's short commit, `+changes` where tracked files differ from it; None outside a checkout."""
    try:
        revision = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                  text=True, check=True).stdout.strip()
        changed = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return revision + ("+changes" if changed else "")


def _check_name(name: str, directory: Path) -> None:
    if not name or Path(name).name != name or name.startswith("."):
        raise ValueError(f"result name {name!r}: a plain file name without a folder, e.g. e2e-smollm2")
    if not directory.parent.is_dir():
        raise ValueError(f"{directory.parent} does not exist: results are kept in a source checkout's docs/")


def result_name(name: str) -> str:
    """`--record NAME`'s check, at parse time: a bench of twenty minutes should not end on a bad name."""
    try:
        _check_name(name, RESULTS_DIR)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return name


def record(name: str, result: dict, command: str, *, date: datetime.date | None = None,
           directory: Path | None = None) -> Path:
    """Write `result` with this machine, the date, `command` and the git revision as
    DIRECTORY/NAME.json (default docs/results/). Returns the path.

    Raises:
        ValueError: a name that is not a plain file name, or no docs/ beside the package (graft
            installed from a wheel has no docs to keep results in).
    """
    directory = directory or RESULTS_DIR
    _check_name(name, directory)
    directory.mkdir(exist_ok=True)
    kept = {"name": name, "command": command, "date": (date or datetime.date.today()).isoformat(),
            "machine": machine(), "git": git_revision(), "result": result}
    path = directory / f"{name}.json"
    path.write_text(json.dumps(kept, indent=1) + "\n")
    return path


def load_results(directory: Path | None = None) -> dict[str, dict]:
    """Every kept result by name."""
    return {path.stem: json.loads(path.read_text()) for path in sorted((directory or RESULTS_DIR).glob("*.json"))}


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def quickstart_result(run_dir: Path) -> tuple[dict, str, datetime.date]:
    """(result, command, date) of a finished `graft quickstart` run: its quickstart.json, the
    held-out evaluations of eval.jsonl and the median step and its parts from metrics.jsonl (what the
    quickstart tables show), the command that makes such a run, and the day it ended.

    Raises:
        ValueError: RUN_DIR has no quickstart.json.
    """
    summary_path = run_dir / "quickstart.json"
    if not summary_path.is_file():
        raise ValueError(f"{run_dir}: no quickstart.json (a finished `graft quickstart` run directory?)")
    result = json.loads(summary_path.read_text())
    metrics = _jsonl(run_dir / "metrics.jsonl")
    result["evaluations"] = [{"step": row["step"], "accuracy": row["accuracy"]}
                             for row in _jsonl(run_dir / "eval.jsonl")]
    for key in ("step_seconds", "rollout_seconds", "train_seconds"):
        result[f"{key}_median"] = statistics.median_high(row[key] for row in metrics)
    command = ["graft", "quickstart"] + (["--task", result["task"]] if result["task"] != "arithmetic" else []) + \
              (["--model", result["model"]] if result["model"] != "tiny" else []) + \
              ["--seed", str(result["seed"]), "--run-dir", str(run_dir)]
    ended = datetime.date.fromtimestamp(summary_path.stat().st_mtime)
    return result, " ".join(command), ended


def add(name: str, path: Path, command: str | None = None, directory: Path | None = None) -> Path:
    """Keep a result made outside `graft bench`: a quickstart's run directory, or a JSON file (a bench's
    --json, `make gpu-check`'s gpu-check.json) made by `command`, as DIRECTORY/NAME.json.

    Raises:
        ValueError: PATH is neither, or a JSON file without the command that made it.
    """
    if path.is_dir():
        result, made_by, date = quickstart_result(path)
        return record(name, result, command or made_by, date=date, directory=directory)
    if not path.is_file():
        raise ValueError(f"{path}: neither a quickstart run directory nor a JSON file")
    if not command:
        raise ValueError(f"{path}: say which command made it (--command)")
    date = datetime.date.fromtimestamp(path.stat().st_mtime)
    return record(name, json.loads(path.read_text()), command, date=date, directory=directory)
