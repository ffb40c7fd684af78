"""`graft quickstart`: the README's main job — LoRA GRPO on a real vLLM server, end to end.

1. A small base model that knows a little of the task: a tiny Qwen2 fine-tuned briefly on
   arithmetic (`graft.quickstart.warmup`), or on a teacher's episodes of a multi-turn environment
   (`--task tools|guessing`, `graft.quickstart.multiturn`), built once and cached by its arguments.
2. A vLLM server launched by graft, serving that base with runtime LoRA loading.
3. `graft train` with the task's shipped config's settings (`graft.quickstart.base.QUICKSTART_TASKS`): every
   step publishes the adapter as `graft-v<N>`, loads it, verifies it, and unloads versions outside
   the retention window.
4. Held-out greedy accuracy (multi-turn: greedy-episode reward) before and after, the reward plot,
   and RUN_DIR/quickstart.json.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from statistics import median_high

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from graft.atomic import atomic_write_text
from graft.config import GraftConfig
from graft.models.cache import default_cache_dir
from graft.quickstart.base import QUICKSTART_TASKS, quickstart_base, quickstart_config
from graft.rollout.engine import EngineUnavailableError
from graft.train.checkpoint import latest_checkpoint
from graft.train.metrics import read_jsonl
from graft.train.trainer import train

# New vLLM servers started (and runs resumed) when the one under the run dies.
ENGINE_RESTARTS = 2


def run_quickstart(run_dir: Path, *, seed: int = 0, steps: int | None = None, cache_dir: Path | None = None,
                   task: str = "arithmetic", model: str = "tiny") -> dict:
    """Base model (cached) → vLLM → LoRA GRPO with adapter sync → held-out accuracy (or, for a
    multi-turn task, greedy-episode reward) before/after. Returns the summary written to
    RUN_DIR/quickstart.json."""
    console = Console()
    start = time.perf_counter()
    base_dir, built = quickstart_base(model, task, seed, cache_dir or default_cache_dir(), console)
    sft = base_dir / "sft.json"  # a warm-up base's record; a real model has had no warm-up
    sft_seconds = json.loads(sft.read_text())["train_seconds"] if sft.is_file() else None
    config = quickstart_config(base_dir, seed, steps, task, model)
    if run_dir.exists() and any(run_dir.iterdir()):
        console.print(f"[yellow]{run_dir} is not empty: its earlier run is replaced")
        _clear_run_dir(run_dir)
    name = base_dir.name if model == "tiny" else model
    console.print(f"LoRA GRPO on {name}: {config.train.steps} steps x {config.train.batch_prompts} prompts "
                  f"x {config.rollout.n_samples} samples, vLLM-CPU launched by graft (starting takes ~15-40 s)")
    result = _train_resuming_after_engine_loss(config, run_dir, console)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    summary = {
        "task": task,
        "model": model,
        "held_out": QUICKSTART_TASKS[task].held_out,
        "accuracy_before": result["accuracy_before"],
        "accuracy_after": result["accuracy_after"],
        "seconds": time.perf_counter() - start,
        "steps": result["steps"],
        "seed": seed,
        "base_model": str(base_dir),
        "base_model_built_now": built,
        "base_model_train_seconds": sft_seconds,
        "eval_examples": config.train.eval_examples,
        # the first and last 10 steps' train reward (halves of a run of 20 steps or fewer)
        "reward_window_steps": (window := max(1, min(10, len(rows) // 2))),
        "reward_first_steps": _mean([r["reward_mean"] for r in rows[:window]]),
        "reward_last_steps": _mean([r["reward_mean"] for r in rows[-window:]]),
        "max_adapters_loaded": max(r["engine_adapters_loaded"] for r in rows),
        "keep_versions": config.sync.resolved_keep_versions(config.rollout.max_staleness),
        "sync_seconds_median": median_high([r["sync_seconds"] for r in rows]),
        # the two parts a user weighs differently: the load rollouts wait for; the check, which runs
        # beside the next step's work (its seconds are mostly waiting for the update on the model thread)
        "sync_load_seconds_median": median_high([r["sync_publish_seconds"] + r["sync_apply_seconds"] for r in rows]),
        "verify_seconds_median": median_high([r["sync_verify_seconds"] for r in rows]),
        "max_sync_logprob_gap": max(r["sync_logprob_abs_diff_max"] or 0.0 for r in rows),
    }
    atomic_write_text(run_dir / "quickstart.json", json.dumps(summary, indent=2) + "\n")
    _report(console, summary, run_dir)
    return summary


def _train_resuming_after_engine_loss(config: GraftConfig, run_dir: Path, console: Console) -> dict:
    """`train`, and if the vLLM server dies under it (killed from outside, crashed), a new server and
    `--resume` from the newest checkpoint, at most `ENGINE_RESTARTS` times: nothing but the steps
    since that checkpoint is lost."""
    for attempt in range(ENGINE_RESTARTS + 1):
        resume = attempt > 0
        try:
            return asyncio.run(train(config, run_dir, resume=resume))
        except EngineUnavailableError as error:
            if attempt == ENGINE_RESTARTS or latest_checkpoint(run_dir / "checkpoints") is None:
                raise
            # escape: the error carries the server's log tail, whose "[/...]" rich would take for markup.
            console.print(f"[yellow]the vLLM server stopped answering ({escape(str(error))}); starting a new one "
                          f"and resuming from {latest_checkpoint(run_dir / 'checkpoints')}")
    raise AssertionError("unreachable")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _clear_run_dir(run_dir: Path) -> None:
    import shutil

    for entry in run_dir.iterdir():
        shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()


def _report(console: Console, s: dict, run_dir: Path) -> None:
    table = Table(title=f"graft quickstart ({s['task']}): LoRA GRPO on vLLM")
    table.add_column("measured")
    table.add_column("value", justify="right")
    if s["task"] == "arithmetic":  # a fraction answered right
        shown = [f"{s['accuracy_before']:.1%}", f"{s['accuracy_after']:.1%}",
                 f"{(s['accuracy_after'] - s['accuracy_before']) * 100:+.1f} points"]
    else:  # a mean episode reward
        shown = [f"{s['accuracy_before']:.3f}", f"{s['accuracy_after']:.3f}",
                 f"{s['accuracy_after'] - s['accuracy_before']:+.3f}"]
    for name, value in zip((f"held-out {s['held_out']} before", f"held-out {s['held_out']} after", "change"), shown):
        table.add_row(name, value)
    table.add_row(f"train reward, first -> last {s['reward_window_steps']} steps",
                  f"{s['reward_first_steps']:.2f} -> {s['reward_last_steps']:.2f}")
    table.add_row("GRPO steps", str(s["steps"]))
    table.add_row("adapters loaded at most (keep_versions)", f"{s['max_adapters_loaded']} ({s['keep_versions']})")
    table.add_row("sync: publish + load seconds (median)", f"{s['sync_load_seconds_median']:.3f}")
    table.add_row("delivery check seconds (median, beside the next step)", f"{s['verify_seconds_median']:.3f}")
    table.add_row("largest engine-vs-trainer log-prob gap", f"{s['max_sync_logprob_gap']:.1e}")
    table.add_row("wall seconds (all of it)", f"{s['seconds']:.0f}")
    console.print(table)
    console.print(f"reward plot: {run_dir / 'reward.png'}\nmetrics: {run_dir / 'metrics.jsonl'}  "
                  f"TensorBoard: {run_dir / 'tensorboard'}\nresults: {run_dir / 'quickstart.json'}")
