"""`graft bench step`: one whole GRPO step of `graft train` at the Qwen2.5-0.5B shape, default config.

A random Qwen2 of the Qwen2.5-0.5B shape (hidden 896, intermediate 4864, 14 heads / 2 KV heads, 24
layers, vocabulary 151,936, tied embeddings; ~494M parameters, fp32) with the project's tokenizer
padded to the real vocabulary (`graft.models.tokenizer.pad_vocabulary`: a random model samples every
id and the server must decode each), built once and cached. `graft train` runs in a subprocess with
the default config except the rollout's size: 8 prompts x 8 samples of up to 256 tokens on a vLLM-CPU
server graft launches; one step (rollout, update, adapter sync, delivery verification) and the
evaluations before and after it, on one example each. The bench polls the resident memory of the
trainer process and of the server's processes (everything else below the trainer) and reads each
phase's seconds from RUN_DIR/metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from graft.config.arguments import COUNT

VOCAB = 151_936
SHAPE = {"hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14, "num_key_value_heads": 2}
# Only the rollout's size and the evaluations differ from the defaults (1 example each: the
# step is measured, not the held-out accuracy of a random model).
STEP_SETTINGS = ["rollout.engine=vllm", "train.batch_prompts=8", "rollout.n_samples=8",
                 "rollout.max_new_tokens=256", "train.steps=1", "train.eval_examples=1"]
PHASES = ("rollout_seconds", "train_seconds", "sync_seconds", "step_seconds")


def real_shape_model(out_dir: Path, layers: int, seed: int = 0) -> Path:
    """The Qwen2.5-0.5B-shaped random model with `layers` layers at `out_dir` (built if missing)."""
    if (out_dir / "config.json").is_file():
        return out_dir
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from graft.atomic import atomic_dir
    from graft.models.tokenizer import pad_vocabulary, train_tokenizer

    tokenizer = pad_vocabulary(train_tokenizer(), VOCAB)
    config = Qwen2Config(vocab_size=VOCAB, num_hidden_layers=layers, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, max_position_embeddings=4096, **SHAPE)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(out_dir) as tmp_dir:
        model.save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
    return out_dir


def _rss_by_pid() -> tuple[dict[int, int], dict[int, int]]:
    """(parent pid, resident bytes) of every live process, by pid."""
    parents, rss = {}, {}
    page = os.sysconf("SC_PAGE_SIZE")
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # exited while we looked
                continue
            parents[int(entry.name)], rss[int(entry.name)] = int(fields[1]), int(fields[21]) * page
    return parents, rss


def _tree_rss(root: int) -> tuple[int, int]:
    """(resident bytes of `root`, of all its descendants together)."""
    parents, rss = _rss_by_pid()
    below, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - below
        below |= frontier
    return rss.get(root, 0), sum(rss.get(pid, 0) for pid in below)


def _watch_peaks(process: subprocess.Popen, peaks: dict, period_s: float = 0.5) -> None:
    while process.poll() is None:
        trainer, engines = _tree_rss(process.pid)
        peaks["trainer"] = max(peaks["trainer"], trainer)
        peaks["engines"] = max(peaks["engines"], engines)
        peaks["total"] = max(peaks["total"], trainer + engines)
        time.sleep(period_s)


def run_step_bench(model_dir: Path, overrides: list[str] | None = None, console: Console | None = None) -> dict:
    """`graft train` for one step on `model_dir` (default config + STEP_SETTINGS + `overrides`);
    peak resident bytes (trainer, server processes, both) and the step's metrics row."""
    console = console or Console()
    with tempfile.TemporaryDirectory(prefix="graft-bench-step-") as tmp:
        run_dir = Path(tmp) / "run"
        settings = [f"model.path={model_dir}", *STEP_SETTINGS, *(overrides or [])]
        command = [sys.executable, "-m", "graft.cli", "train", "--run-dir", str(run_dir),
                   *[a for s in settings for a in ("-o", s)]]
        console.print(f"graft train, one step: {' '.join(settings)}")
        peaks = {"trainer": 0, "engines": 0, "total": 0}
        start = time.perf_counter()
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        watcher = threading.Thread(target=_watch_peaks, args=(process, peaks), daemon=True)
        watcher.start()
        output = process.communicate()[0]
        watcher.join()
        wall = time.perf_counter() - start
        if process.returncode != 0:
            raise RuntimeError(f"graft train failed (exit {process.returncode}):\n{output[-3000:]}")
        row = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    return {"model": str(model_dir), "settings": settings, "wall_seconds": wall,
            "trainer_peak_bytes": peaks["trainer"], "engines_peak_bytes": peaks["engines"],
            "total_peak_bytes": peaks["total"], "step": row}


def print_step_report(result: dict) -> None:
    row = result["step"]
    table = Table(title=f"graft bench step: one GRPO step, {row['rollout_tokens']} completion tokens "
                        f"({result['model']})")
    for column in ("phase", "seconds"):
        table.add_column(column, justify="right")
    for phase in PHASES:
        table.add_row(phase.removesuffix("_seconds"), f"{row[phase]:.1f}")
    table.add_row("whole run (server start, evaluations, step)", f"{result['wall_seconds']:.0f}")
    Console().print(table)
    gib = {k: result[f"{k}_peak_bytes"] / 2**30 for k in ("trainer", "engines", "total")}
    Console().print(f"peak resident memory: trainer {gib['trainer']:.2f} GiB, vLLM server {gib['engines']:.2f} GiB, "
                    f"together {gib['total']:.2f} GiB; delivery gap {row['sync_logprob_abs_diff_max']}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`graft bench step`'s flag: the layers of the Qwen2.5-0.5B shape."""
    parser.add_argument("--layers", type=COUNT, default=24, help="decoder layers (default %(default)s)")


def run(args: argparse.Namespace) -> dict:
    """`graft bench step`: build (once, cached) the model, measure, print the table, return what --json writes."""
    from graft.models.cache import default_cache_dir

    model_dir = real_shape_model(default_cache_dir() / f"qwen2.5-0.5b-shape-{args.layers}-layers", args.layers)
    result = run_step_bench(model_dir)
    print_step_report(result)
    return result
