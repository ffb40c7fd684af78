"""`graft bench cores`: where vLLM-CPU generates, measured by whole on-policy graft steps.

vLLM-CPU keeps `VLLM_CPU_NUM_OF_RESERVED_CPU` cores (default 1) for its front end and scheduler and
generates on the rest. On a small CPU machine the trainer and the engine take turns on-policy, so
the question is whether generation should get every core while it runs. Each setting gets its own
server (the variables are read at start-up) and the same graft run as `graft bench e2e`'s on-policy
side; the rows are the medians of the measured steps, which `rollout.cpu_reserved_cores: auto`
is chosen from (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from graft.bench import e2e
from graft.bench.e2e import LORA, SPLIT, Workload, _load, graft_steps, model_point
from graft.rollout.vllm.launcher import VllmServer, VllmServerConfig

WORKLOAD = Workload("16x8x32", 16, 8, 32)
# Server environment per setting: vLLM's default, every core, every core with OpenMP threads that
# sleep at once when idle (so they cannot take the core from the trainer between two rollouts).
SETTINGS = {
    "reserved 1 (vLLM's default)": {},
    "reserved 0": {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
    "reserved 0, OMP_WAIT_POLICY=PASSIVE": {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "OMP_WAIT_POLICY": "PASSIVE"},
}
MODELS = ((128, 2), (512, 8))


class _ServerWithEnvironment(VllmServer):
    def __init__(self, config: VllmServerConfig, extra: dict[str, str]) -> None:
        super().__init__(config)
        self.extra = extra

    def environment(self) -> dict[str, str]:
        return {**super().environment(), **self.extra}


def run_cores_bench(models: tuple[tuple[int, int] | str, ...] = MODELS, steps: int = 6, warmup: int = 2) -> dict:
    """Per model point and server setting: medians of s/step and its rollout/train/sync."""
    from graft.bench.common import ADAPTER, prepare_adapter_and_merged

    console, rows = Console(stderr=True), []
    for point in models:
        model = point if isinstance(point, str) else f"h{point[0]} l{point[1]}"
        with tempfile.TemporaryDirectory(prefix="graft-bench-cores-") as tmp:
            work = Path(tmp)
            base = model_point(point, work, console)
            adapter_dir, _ = prepare_adapter_and_merged(base, work, LORA["rank"], torch.float32)
            for index, (setting, extra) in enumerate(SETTINGS.items()):
                console.print(f"{model}: {setting} (starting vLLM-CPU, ~30-60 s)")
                config = VllmServerConfig(model=str(base), dtype="float32", max_lora_rank=8, max_loras=4, log_dir=work)
                with _ServerWithEnvironment(config, extra) as server:
                    asyncio.run(_load(server.url, ADAPTER, adapter_dir))
                    measured = graft_steps(base, server.url, WORKLOAD, steps, 0, work / f"run-{index}")[warmup:]
                rows.append({"model": model, "setting": setting,
                             "seconds_per_step": statistics.median(s["seconds"] for s in measured),
                             **{key: statistics.median(s[key] for s in measured) for key in SPLIT}})
    return {"workload": WORKLOAD.name, "steps_per_run": steps, "warmup_steps": warmup, "rows": rows}


def print_cores_report(result: dict) -> None:
    table = Table(title=f"cores: on-policy graft steps ({result['workload']}) under vLLM-CPU core settings "
                        f"(medians of {result['steps_per_run'] - result['warmup_steps']} steps)")
    for column in ("model", "server setting", "s/step", "rollout", "train", "sync", "verify"):
        table.add_column(column)
    for row in result["rows"]:
        table.add_row(row["model"], row["setting"], f"{row['seconds_per_step']:.3f}",
                      *(f"{row[key]:.3f}" for key in SPLIT))
    Console(width=max(Console().width, 120)).print(table)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`graft bench cores`'s flags: those of `graft bench e2e`, whose graft side it runs, less --repeats."""
    e2e.add_arguments(parser, repeats=False)


def run(args: argparse.Namespace) -> dict:
    """`graft bench cores`: measure, print the table, return what --json writes."""
    result = run_cores_bench(e2e.bench_models(args), steps=args.steps)
    print_cores_report(result)
    return result
