"""`graft bench merge`: graft's zero-drift merge vs PEFT's `merge_adapter()`, side by side in one run.

Both sides merge the same adapter into the same bf16 base (the dtype engines serve). graft forms
new tensors (fp32 math, one rounding); PEFT adds the delta into the weights in place and has to
unmerge afterwards, which rounds again: the drift of the base over merge/unmerge cycles is the
cost the merged-sync path must not pay. Timings are medians of interleaved runs (A B A B ...).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from graft.config.arguments import COUNT
from graft.lora.attach import attach_lora, lora_parameters
from graft.lora.merge import iter_merged_weights
from graft.models.tiny import ARCHS, tiny_config
from graft.models.tokenizer import train_tokenizer


def _bench_model(hidden: int, layers: int, rank: int, dtype: torch.dtype):
    """A random Qwen2-shaped model in `dtype` with a random (non-zero) LoRA on every linear layer."""
    config = tiny_config(train_tokenizer(), arch="qwen2", hidden=hidden, layers=layers)
    torch.manual_seed(0)
    model = ARCHS["qwen2"][1](config).to(dtype)
    model = attach_lora(model, rank=rank, alpha=2 * rank, seed=0)
    with torch.no_grad():
        for param in lora_parameters(model).values():
            param.normal_(std=0.02)
    return model


def _base_weights(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if ".lora_" not in n}


def _max_drift(before: dict[str, torch.Tensor], model) -> float:
    after = _base_weights(model)
    return max((after[n].float() - t.float()).abs().max().item() for n, t in before.items())


def _graft_merge(model) -> None:
    for _ in iter_merged_weights(model):
        pass


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_merge_bench(hidden: int = 1024, layers: int = 8, rank: int = 8, repeats: int = 7,
                    cycles: int = 50) -> dict:
    """Median seconds for one full merge on each side, their ratio, and base drift on each side."""
    graft_model = _bench_model(hidden, layers, rank, torch.bfloat16)
    peft_model = copy.deepcopy(graft_model)
    graft_before = {n: t.clone() for n, t in _base_weights(graft_model).items()}
    peft_before = {n: t.clone() for n, t in _base_weights(peft_model).items()}
    graft_seconds, peft_seconds = [], []
    with Progress(transient=True) as progress:
        task = progress.add_task("merge timings (graft, PEFT interleaved)", total=repeats + 1)
        for i in range(repeats + 1):  # the first round warms up allocators and kernels, not counted
            g = _timed(lambda: _graft_merge(graft_model))
            p = _timed(peft_model.merge_adapter)
            peft_model.unmerge_adapter()
            if i:
                graft_seconds.append(g)
                peft_seconds.append(p)
            progress.advance(task)
        task = progress.add_task(f"drift over {cycles} merge cycles", total=cycles)
        for _ in range(cycles):
            _graft_merge(graft_model)
            peft_model.merge_adapter()
            peft_model.unmerge_adapter()
            progress.advance(task)
    graft_median, peft_median = statistics.median(graft_seconds), statistics.median(peft_seconds)
    return {
        "model": f"qwen2 hidden={hidden} layers={layers} bf16",
        "parameters": sum(t.numel() for t in graft_before.values()),
        "lora_rank": rank,
        "lora_modules": len(lora_parameters(graft_model)) // 2,
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "graft_seconds": graft_median,
        "peft_seconds": peft_median,
        "ratio": peft_median / graft_median,
        "cycles": cycles,
        "graft_base_drift": _max_drift(graft_before, graft_model),
        "peft_bf16_drift_after_cycles": _max_drift(peft_before, peft_model),
    }


def print_merge_report(result: dict) -> None:
    table = Table(title=f"merge: {result['model']}, {result['parameters'] / 1e6:.0f}M params, "
                        f"r={result['lora_rank']} on {result['lora_modules']} modules")
    for column in ("", "median seconds", f"base drift after {result['cycles']} cycles"):
        table.add_column(column)
    table.add_row("graft (new tensors, fp32 math)", f"{result['graft_seconds']:.4f}",
                  f"{result['graft_base_drift']:.3g}")
    table.add_row("PEFT merge_adapter (in place)", f"{result['peft_seconds']:.4f}",
                  f"{result['peft_bf16_drift_after_cycles']:.3g}")
    console = Console()
    console.print(table)
    console.print(f"ratio PEFT/graft: {result['ratio']:.2f}x (medians of {result['repeats']} interleaved runs; "
                  "> 1 means graft is faster)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`graft bench merge`'s flags: the random model's shape, the LoRA rank, how often to time."""
    parser.add_argument("--hidden", type=COUNT, default=1024, help="model hidden size (default %(default)s)")
    parser.add_argument("--layers", type=COUNT, default=8, help="decoder layers (default %(default)s)")
    parser.add_argument("--rank", type=COUNT, default=8, help="LoRA rank (default %(default)s)")
    parser.add_argument("--repeats", type=COUNT, default=7,
                        help="timed runs per side, median reported (default %(default)s)")
    parser.add_argument("--cycles", type=COUNT, default=50,
                        help="PEFT merge/unmerge cycles for the drift measurement (default %(default)s)")


def run(args: argparse.Namespace) -> dict:
    """`graft bench merge`: measure, print the table, return what --json writes."""
    result = run_merge_bench(hidden=args.hidden, layers=args.layers, rank=args.rank, repeats=args.repeats,
                             cycles=args.cycles)
    print_merge_report(result)
    return result
