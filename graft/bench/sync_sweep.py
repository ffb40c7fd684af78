"""Sync cost growth: seconds and bytes of a policy sync vs model size and LoRA rank, on a real vLLM server.

The claim checked: adapter sync grows linearly with adapter bytes and stays within 2x of the raw-write
floor. Every point measures these modes, interleaved within each round (medians over rounds, after one
warm-up round), each starting on a flushed disk and an idle engine (untimed, see `_settle`):
- adapter: AdapterSync, publish + load into vLLM (+ unload of the version leaving the window);
- adapter_publish: its publish part alone (files, fsync, hashes, manifest);
- raw_write: adapter's floor: gather the adapter tensors, `safetensors.save_file`, fsync;
- merged: MergedSync, publish base + LoRA merged (fp32 math) + reload the server's weights;
- merged_publish: its publish part alone;
- merged_raw_write: merged's floor: the same weight bytes (the base's, same names, shapes and dtype as the
  merged ones) written with `safetensors.save_file` + fsync; the merge itself is not timed.

Sweeps:
- size: Qwen2-shaped random bf16 models, ~9x parameters per step up to Qwen2.5-0.5B's shape, LoRA rank 16
  on all linear modules; one vLLM server per model.
- rank: Qwen2.5-0.5B's shape, ranks 8..128; ONE server (max_lora_rank 128), ranks interleaved per round.
"""

from __future__ import annotations

import asyncio
import copy
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import peft
import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from torch import nn

from graft.bench.common import (
    SHAPES,
    ModelShape,
    bench_server,
    bench_syncs,
    medians,
    new_policy_weights,
    pyplot,
    raw_write_seconds,
    save_figure,
    save_fsync,
)
from graft.config import VLLM_LORA_RANKS
from graft.lora.attach import attach_lora
from graft.lora.merge import iter_merged_weights
from graft.models.loading import load_model
from graft.rollout.process_group import group_cpu_seconds
from graft.rollout.vllm.client import VllmClient

QWEN05 = SHAPES["qwen2.5-0.5b-shape"]
# head_dim = hidden / heads >= 32 (vLLM-CPU attention); 2 KV heads; intermediate ~5.4x hidden and tied
# embeddings, as Qwen2.5-0.5B. Parameters 0.77M, 6.0M, 58M, 494M (x7.8, x9.6, x8.5); a small vocabulary
# keeps the small ones small (graft's tokenizer has ~1180 tokens, so any vocab >= 1024 fits).
SIZE_SHAPES = (
    ModelShape("h128-l2", hidden=128, layers=2, heads=4, kv_heads=2, intermediate=704, vocab=1024, tied=True,
               rank=16),
    ModelShape("h256-l4", hidden=256, layers=4, heads=8, kv_heads=2, intermediate=1408, vocab=4096, tied=True,
               rank=16),
    ModelShape("h512-l10", hidden=512, layers=10, heads=8, kv_heads=2, intermediate=2816, vocab=16384,
               tied=True, rank=16),
    QWEN05,
)
RANKS = (8, 16, 32, 64, 128)
# sweep -> groups of points; the points of a group share one base model and one vLLM server.
SWEEPS: dict[str, list[list[ModelShape]]] = {
    "size": [[shape] for shape in SIZE_SHAPES],
    "rank": [[replace(QWEN05, rank=rank) for rank in RANKS]],
}
MODES = ("adapter", "adapter_publish", "raw_write", "merged", "merged_publish", "merged_raw_write")
FLOORS = {mode: "raw_write" if mode.startswith(("adapter", "raw")) else "merged_raw_write" for mode in MODES}


def merged_raw_write_seconds(model: nn.Module, path: Path) -> tuple[float, int]:
    """Merged's floor: write `model`'s weights (a plain model: no merge) as merged publishing names them,
    fsynced. (seconds, bytes)"""
    start = time.perf_counter()
    size = save_fsync(dict(iter_merged_weights(model, torch.bfloat16)), path)
    return time.perf_counter() - start, size


def _lora_view(model: nn.Module, rank: int) -> peft.PeftModel:
    """A LoRA policy of `rank` on `model`'s weights without copying them: the rank sweep holds one policy per
    rank, and five copies of the 0.5B base would cost 5 GB. The memo makes deepcopy reuse every parameter."""
    shared = copy.deepcopy(model, memo={id(p): p for p in model.parameters()})
    return attach_lora(shared, rank=rank, alpha=2 * rank, seed=0)


def _wait_engine_idle(pgid: int, window_s: float = 0.1, busy_fraction: float = 0.2, timeout_s: float = 10.0) -> None:
    """Block until the engine's processes use under `busy_fraction` of a core over `window_s` (or `timeout_s`
    passes: a busy engine slows the measurement but must not hang it)."""
    deadline = time.perf_counter() + timeout_s
    before = group_cpu_seconds(pgid)
    while time.perf_counter() < deadline:
        time.sleep(window_s)
        now = group_cpu_seconds(pgid)
        if now - before < busy_fraction * window_s:
            return
        before = now


def _settle(pgid: int) -> None:
    """Untimed, before each mode: flush the disk and wait for the engine to go idle, so a mode does not pay
    for the previous one's writeback or engine work. (vLLM's own entry point spins a core for 1 s after every
    call; on 2 cores that made a 4 MiB raw write right after a merged sync take 0.6-0.9 s instead of 0.04 s.
    graft's launcher cuts that spin to 50 ms, see graft.rollout.vllm.server.entry.)"""
    os.sync()
    _wait_engine_idle(pgid)


async def _measure_group(url: str, pgid: int, base: Path, work: Path, shapes: Sequence[ModelShape], repeats: int,
                         progress: Progress, task) -> tuple[int, list[dict[str, tuple[float, int]]]]:
    """(base parameters, per point {mode: (median seconds, bytes)}); rounds outer, points then modes inner."""
    plain = load_model(base, dtype="bfloat16")
    policies = [_lora_view(plain, shape.rank) for shape in shapes]
    samples: list[dict[str, list[tuple[float, int]]]] = [{mode: [] for mode in MODES} for _ in shapes]
    raw_path, merged_raw_path = work / "raw.safetensors", work / "merged-raw.safetensors"
    version = 0
    async with VllmClient(url) as client:
        adapter_sync, merged_sync = bench_syncs(client, work)
        try:
            for round_index in range(repeats + 1):  # round 0 warms up, not counted
                for policy, point in zip(policies, samples):
                    version += 1
                    new_policy_weights(policy)
                    _settle(pgid)
                    adapter = await adapter_sync.sync(policy, version, version)
                    _settle(pgid)
                    merged = await merged_sync.sync(policy, version, version)
                    raw_path.unlink(missing_ok=True)
                    merged_raw_path.unlink(missing_ok=True)
                    _settle(pgid)
                    raw_write = raw_write_seconds(policy, raw_path)
                    _settle(pgid)
                    merged_raw_write = merged_raw_write_seconds(plain, merged_raw_path)
                    measured = {"adapter": (adapter.seconds, adapter.bytes),
                                "adapter_publish": (adapter.publish_seconds, adapter.bytes),
                                "raw_write": raw_write,
                                "merged": (merged.seconds, merged.bytes),
                                "merged_publish": (merged.publish_seconds, merged.bytes),
                                "merged_raw_write": merged_raw_write}
                    if round_index > 0:
                        for mode, sample in measured.items():
                            point[mode].append(sample)
                    progress.advance(task)
        finally:
            await adapter_sync.close()
    params = sum(p.numel() for p in plain.parameters())  # tied embeddings counted once
    return params, [medians(point) for point in samples]


def run_sync_sweep(sweep: str, repeats: int = 3, *, groups: Sequence[Sequence[ModelShape]] | None = None) -> dict:
    """Measure every point of `sweep` ("size" or "rank") against real vLLM-CPU servers (bf16).

    Args:
        sweep: a key of `SWEEPS`; names the result and its plot's x axis.
        repeats: counted rounds per point (after one warm-up round); seconds are their medians.
        groups: points to measure instead of `SWEEPS[sweep]` (tests run reduced sweeps); the shapes of a group
            differ only in rank and share one server, started with the smallest vLLM max_lora_rank that fits.

    Returns:
        `{"sweep", "repeats", "rows": [{"model", "params", "rank", "mode", "seconds", "bytes"}, ...]}`.

    Raises:
        ValueError: an unknown sweep, a group mixing models, or a rank above vLLM's largest.
    """
    if sweep not in SWEEPS:
        raise ValueError(f"unknown sweep {sweep!r}: one of {sorted(SWEEPS)}")
    rows = []
    console = Console(stderr=True)
    for shapes in groups or SWEEPS[sweep]:
        model = shapes[0]
        if any(replace(shape, rank=model.rank) != model for shape in shapes):
            raise ValueError(f"a group's shapes may differ only in rank: {shapes}")
        max_rank = max(shape.rank for shape in shapes)
        if max_rank > VLLM_LORA_RANKS[-1]:
            raise ValueError(f"rank {max_rank} is above vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")
        lora_rank = min(r for r in VLLM_LORA_RANKS if r >= max_rank)
        with (tempfile.TemporaryDirectory(prefix=f"graft-bench-sync-sweep-{model.name}-") as tmp,
              bench_server(model, Path(tmp), lora_rank, console) as (base, server),
              Progress(transient=True, console=console) as progress):
            task = progress.add_task(f"{model.name}: rounds of {len(shapes)} point(s) x {len(MODES)} modes",
                                     total=(repeats + 1) * len(shapes))
            params, points = asyncio.run(_measure_group(server.url, server.pid, base, Path(tmp), shapes, repeats,
                                                        progress, task))
        rows += [{"model": shape.name, "params": params, "rank": shape.rank, "mode": mode, "seconds": seconds,
                  "bytes": size}
                 for shape, point in zip(shapes, points) for mode, (seconds, size) in point.items()]
    return {"sweep": sweep, "repeats": repeats, "rows": rows}


def linear_fit(x: Sequence[float], y: Sequence[float]) -> tuple[float, float, float] | None:
    """Least-squares `y = slope * x + intercept`: (slope, intercept, R²); None with fewer than 2 distinct x."""
    x_N, y_N = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(np.unique(x_N)) < 2:
        return None
    slope, intercept = np.polyfit(x_N, y_N, 1)
    residual = float(((y_N - (slope * x_N + intercept)) ** 2).sum())
    total = float(((y_N - y_N.mean()) ** 2).sum())
    return float(slope), float(intercept), 1.0 - residual / total if total > 0 else 1.0


def _points(result: dict) -> dict[tuple[str, int], dict[str, dict]]:
    """(model, rank) -> {mode: row}, in measurement order."""
    points: dict[tuple[str, int], dict[str, dict]] = {}
    for row in result["rows"]:
        points.setdefault((row["model"], row["rank"]), {})[row["mode"]] = row
    return points


def print_sweep_report(result: dict) -> None:
    """The sweep's table (seconds, MiB, x its floor per mode) and the linear fit behind the adapter claim."""
    points = _points(result)
    table = Table(title=f"sync sweep by {result['sweep']}: publish + engine apply (vLLM-CPU, bf16), "
                        f"medians of {result['repeats']} rounds")
    for column in ("point", "mode", "seconds", "MiB", "x floor"):
        table.add_column(column, justify="left" if column in ("point", "mode") else "right", no_wrap=True)
    for (model, rank), modes in points.items():
        for mode, row in modes.items():
            floor = modes[FLOORS[mode]]["seconds"]
            table.add_row(f"{model} r{rank}", mode, f"{row['seconds']:.3f}", f"{row['bytes'] / 2**20:.2f}",
                          f"{row['seconds'] / floor:.2f}", end_section=mode == MODES[-1])
    console = Console()
    console.print(table)
    params = {model: modes["adapter"]["params"] for (model, _), modes in points.items()}
    console.print("parameters: " + ", ".join(f"{model} {count / 1e6:.2f}M" for model, count in params.items()))
    for mode in ("adapter", "raw_write", "merged"):
        rows = [modes[mode] for modes in points.values()]
        fit = linear_fit([r["bytes"] / 2**20 for r in rows], [r["seconds"] for r in rows])
        if fit is not None:
            slope, intercept, r2 = fit
            console.print(f"{mode} seconds vs MiB: slope {slope * 1e3:.2f} ms/MiB, intercept {intercept:.3f} s, "
                          f"R² {r2:.3f} ({len(rows)} points)")
    ratios = {f"{model} r{rank}": modes["adapter"]["seconds"] / modes["raw_write"]["seconds"]
              for (model, rank), modes in points.items()}
    console.print("adapter / raw_write: " + ", ".join(f"{point} {ratio:.2f}x" for point, ratio in ratios.items()),
                  overflow="fold")
    console.print(f"adapter within 2x of the raw-write floor at {sum(r <= 2 for r in ratios.values())} of "
                  f"{len(ratios)} points")


def plot_sweep(result: dict, path: str | Path) -> Path:
    """One PNG: seconds (left) and bytes (right) per point, x = parameters (size) or LoRA rank (rank);
    the raw-write floors dashed in their mode's colour. Log axes: the points grow geometrically."""
    from matplotlib.ticker import FixedLocator, NullLocator

    points = list(_points(result).items())
    by_size = result["sweep"] == "size"
    x = [modes["adapter"]["params"] if by_size else rank for (_, rank), modes in points]
    fig, (ax_seconds, ax_bytes) = pyplot().subplots(1, 2, figsize=(12, 4.8))
    styles = {"adapter": ("C0", "-", "o"), "adapter_publish": ("C0", ":", "."), "raw_write": ("C0", "--", "x"),
              "merged": ("C1", "-", "s"), "merged_raw_write": ("C1", "--", "x")}
    labels = {"raw_write": "raw write (adapter floor)", "merged_raw_write": "raw write (merged floor)",
              "adapter_publish": "adapter publish only"}
    for mode, (color, linestyle, marker) in styles.items():
        ax_seconds.plot(x, [modes[mode]["seconds"] for _, modes in points], color=color, linestyle=linestyle,
                        marker=marker, label=labels.get(mode, f"{mode} sync"))
    for mode, color in (("adapter", "C0"), ("merged", "C1")):
        ax_bytes.plot(x, [modes[mode]["bytes"] / 2**20 for _, modes in points], color=color, marker="o",
                      label=f"{mode} published")
    xlabel = "base model parameters" if by_size else "LoRA rank (all linear modules)"
    for ax, ylabel, title in ((ax_seconds, "seconds (median)", "sync time"), (ax_bytes, "MiB", "bytes per sync")):
        ax.set_xscale("log", base=10 if by_size else 2)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(FixedLocator(x))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([f"{v / 1e6:.3g}M" if by_size else str(v) for v in x])
        ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fixed = f"LoRA rank {points[0][0][1]}" if by_size else points[0][0][0]
    fig.suptitle(f"sync cost vs {'model size' if by_size else 'LoRA rank'} ({fixed}; vLLM-CPU, bf16, "
                 f"medians of {result['repeats']} rounds)")
    fig.tight_layout()
    return save_figure(fig, path)
