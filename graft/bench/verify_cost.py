"""`graft bench verify`: what the delivery check after every sync costs a step.

The check (graft.sync.verify) runs beside the next rollout on-policy, so its cost to a run is not its
own seconds but how much longer a step takes with it. Two parts:

- the quickstart's run (`configs/quickstart.yaml` on the cached warm-up base, or with `--model
  smollm2` `make quickstart`'s, `configs/smollm2-quickstart.yaml`; vLLM-CPU fp32), with
  `sync.verify` on and off, runs alternating on one server (which goes first alternates too);
  medians of each run's steps after the first `WARMUP_STEPS`, and the step-time difference as a
  fraction of the step without the check;
- the Qwen2.5-0.5B shape (bf16, the sync bench's random model, r16): one check's seconds after an
  shm sync (8 greedy probe tokens on vLLM-CPU plus the trainer's forward over them), medians of
  `SHAPE_CHECKS` checks. Its step is ~1000 s on these cores (`graft bench step`), so only the
  check's own seconds are measured here.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from graft.config.arguments import COUNT
from graft.models.packaged import PACKAGED_MODELS

WARMUP_STEPS = 2
SHAPE_CHECKS = 5
SHAPE = "qwen2.5-0.5b-shape"


def _quickstart_runs(steps: int, repeats: int, console: Console, model: str = "tiny") -> dict:
    """Step seconds (and the check's own seconds) with the check on and off, `repeats` runs of each
    (`model`'s quickstart: "tiny" or a packaged real model); its evaluations cut to 8 examples (not
    timed anyway)."""
    from graft.models.cache import default_cache_dir
    from graft.quickstart.base import quickstart_base, quickstart_config, shipped_config
    from graft.rollout.factory import launched_server
    from graft.train.metrics import read_jsonl
    from graft.train.trainer import train

    base, _ = quickstart_base(model, "arithmetic", 0, default_cache_dir(), console)
    steps_by: dict[str, list[float]] = {"on": [], "off": []}
    checks: list[float] = []
    with tempfile.TemporaryDirectory(prefix="graft-bench-verify-") as tmp:
        with console.status("quickstart: starting vLLM-CPU"):
            server = launched_server(quickstart_config(base, seed=0, steps=steps, model=model), tmp).start()
        try:
            for repeat in range(repeats):
                # Which setting runs first alternates: the second run of a pair on one server was
                # measured slower, whichever its setting (docs/history.md, 2026-11-27).
                for setting in ("on", "off") if repeat % 2 == 0 else ("off", "on"):
                    console.print(f"quickstart, check {setting}: run {repeat + 1} of {repeats} ({steps} steps)")
                    run_dir = Path(tmp) / f"{setting}-{repeat}"
                    config = shipped_config("arithmetic", [
                        f"model.path={base}", "train.seed=0", f"train.steps={steps}", f"rollout.urls=[{server.url}]",
                        f"lora.name=verify-{setting}-{repeat}", f"sync.verify={str(setting == 'on').lower()}",
                        "train.eval_every=0", "train.eval_examples=8"], model)
                    asyncio.run(train(config, run_dir))
                    rows = read_jsonl(run_dir / "metrics.jsonl")[WARMUP_STEPS:]
                    steps_by[setting] += [row["step_seconds"] for row in rows]
                    checks += [row["sync_verify_seconds"] for row in rows if setting == "on"]
        finally:
            server.stop()
    on, off = statistics.median(steps_by["on"]), statistics.median(steps_by["off"])
    return {"model": model, "steps_per_run": steps, "repeats": repeats, "step_seconds_check_on": on,
            "step_seconds_check_off": off, "check_seconds": statistics.median(checks),
            "step_cost_fraction": (on - off) / off}


async def shape_checks(url: str, base: Path, work: Path, rank: int) -> list[float]:
    """Seconds of `SHAPE_CHECKS` delivery checks of a LoRA of `rank` on `base`, each after an shm sync
    of a new version."""
    import time

    from graft.bench.common import adapter_bench_sync, new_policy_weights
    from graft.lora.attach import attach_lora
    from graft.models.loading import load_model
    from graft.rollout.vllm.client import VllmClient
    from graft.sync.verify import DEFAULT_TOLERANCE, verify_delivery

    policy = attach_lora(load_model(base, dtype="bfloat16"), rank=rank, alpha=2 * rank, seed=0)
    seconds = []
    async with VllmClient(url) as client:
        sync = adapter_bench_sync(client, work, "shm")
        try:
            for version in range(1, SHAPE_CHECKS + 2):  # version 1 warms up, not counted
                new_policy_weights(policy)
                result = await sync.sync(policy, version, version)
                start = time.perf_counter()
                await verify_delivery(client, policy, adapter=result.adapter, tolerance=DEFAULT_TOLERANCE["bfloat16"])
                seconds += [time.perf_counter() - start] if version > 1 else []
        finally:
            await sync.close()
    return seconds


def _shape_part(console: Console) -> dict:
    from graft.bench.common import SHAPES, bench_server

    with tempfile.TemporaryDirectory(prefix="graft-bench-verify-shape-") as tmp:
        with bench_server(SHAPES[SHAPE], Path(tmp), SHAPES[SHAPE].rank, console) as (base, server):
            console.print(f"{SHAPE}: {SHAPE_CHECKS} delivery checks after shm syncs")
            seconds = asyncio.run(shape_checks(server.url, base, Path(tmp), SHAPES[SHAPE].rank))
    return {"model": SHAPE, "checks": len(seconds), "check_seconds": statistics.median(seconds)}


def run_verify_bench(steps: int = 16, repeats: int = 2, shape: bool = True, model: str = "tiny") -> dict:
    console = Console(stderr=True)
    result = {"quickstart": _quickstart_runs(steps, repeats, console, model)}
    if shape:
        result["shape"] = _shape_part(console)
    return result


def print_verify_report(result: dict) -> None:
    quick = result["quickstart"]
    table = Table(title=f"the delivery check's cost: quickstart ({quick['model']}), medians of {quick['repeats']} x "
                        f"{quick['steps_per_run'] - WARMUP_STEPS} steps per setting")
    for column in ("step, check on", "step, check off", "check's own seconds", "step cost"):
        table.add_column(column, justify="right")
    table.add_row(f"{quick['step_seconds_check_on']:.3f} s", f"{quick['step_seconds_check_off']:.3f} s",
                  f"{quick['check_seconds']:.3f} s", f"{100 * quick['step_cost_fraction']:+.1f}%")
    Console().print(table)
    if "shape" in result:
        print(f"{result['shape']['model']}: one check takes {result['shape']['check_seconds']:.3f} s "
              f"(median of {result['shape']['checks']})")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=COUNT, default=16, help="steps per quickstart run (default %(default)s; the "
                                                              f"first {WARMUP_STEPS} are not counted)")
    parser.add_argument("--repeats", type=COUNT, default=2, help="runs per setting, alternating (default %(default)s)")
    parser.add_argument("--no-shape", action="store_true", help=f"skip the {SHAPE} part (~2 min)")
    parser.add_argument("--model", choices=("tiny", *PACKAGED_MODELS), default="tiny",
                        help="whose quickstart: the tiny model's, or a packaged real model's (smollm2: what "
                             "`make quickstart` runs, ~20 s a step) (default %(default)s)")


def run(args: argparse.Namespace) -> dict:
    """`graft bench verify`: measure, print the table, return what --json writes."""
    if args.steps <= WARMUP_STEPS:
        raise SystemExit(f"graft: error: --steps must be above {WARMUP_STEPS} (the warm-up steps are not counted)")
    result = run_verify_bench(args.steps, args.repeats, shape=not args.no_shape, model=args.model)
    print_verify_report(result)
    return result
