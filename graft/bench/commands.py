"""`graft bench NAME`: the benches by name. Each bench module declares its own flags
(`add_arguments(parser)`) and runs from them (`run(args)`: prints its table, returns what `--json`
writes). A bench module is imported only when that bench is asked for: most import torch and vLLM's
client at the top, which `graft --help` or `graft train` should not pay for."""

from __future__ import annotations

import argparse
import importlib
import json
import shlex
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from graft.bench.report.results import record, result_name


@dataclass(frozen=True)
class Bench:
    """Where a bench lives (its module has `add_arguments` and `run`) and what it measures."""

    module: str
    about: str


BENCHES = {
    "merge": Bench("graft.bench.merge", "graft's zero-drift merge vs PEFT merge_adapter() on a ~95M-parameter random "
                                        "bf16 model, LoRA on all linear layers; medians and base drift."),
    "rollout": Bench("graft.bench.rollout", "tokens/s of one vLLM server serving base weights, base + adapter, and "
                                            "the merged weights reloaded; same prompts, rounds interleaved."),
    "sync": Bench("graft.bench.sync", "publish + engine-apply seconds and bytes for adapter, merged and full sync and "
                                      "the raw-write floor, on a tiny and a Qwen2.5-0.5B-shaped model (--sweep: cost "
                                      "growth)."),
    "e2e": Bench("graft.bench.e2e", "one LoRA GRPO step, graft (on-policy, max_staleness 1, on-policy merged sync) vs "
                                    "TRL GRPOTrainer + PEFT, same model, task, batch, LoRA and optimizer; interleaved, "
                                    "medians, ratio TRL/graft, floors (one vLLM call + the update)."),
    "cores": Bench("graft.bench.cores", "on-policy graft steps under vLLM-CPU core settings (a core reserved for "
                                        "vLLM's front end, or every core generating); rollout.cpu_reserved_cores auto "
                                        "is chosen from it."),
    "learning": Bench("graft.bench.learning", "held-out accuracy vs training seconds, graft vs TRL from the same base "
                                              "for the same wall-clock budget, and graft minus TRL per rollout batch; "
                                              "learning.png."),
    "soak": Bench("graft.bench.soak", "1000 adapter syncs against one vLLM server under concurrent requests; failed "
                                      "requests, adapters loaded at most, server RSS growth."),
    "memory": Bench("graft.bench.memory", "peak RSS, seconds and CPU seconds of one GRPO update at the Qwen2.5-0.5B "
                                          "shape with the real vocabulary (--layers 2: 32 sequences, the default; "
                                          "--layers 24: 8 sequences), graft vs TRL GRPOTrainer + PEFT on the same "
                                          "weights and token ids (TRL's defaults, and TRL with graft's settings), "
                                          "each in a fresh process."),
    "step": Bench("graft.bench.step", "one whole `graft train` step (vLLM rollout of 64 x 256 tokens, update, adapter "
                                      "sync, verification) at the Qwen2.5-0.5B shape (--layers, default 24), default "
                                      "config; seconds per phase, peak memory."),
    "verify": Bench("graft.bench.verify_cost", "what the delivery check after every sync costs: quickstart step "
                                               "seconds with sync.verify on and off (runs alternating on one "
                                               "server), and one check's seconds at the Qwen2.5-0.5B shape."),
    "tenants": Bench("graft.bench.tenants", "tenants' LoRA adapters trained in shared batches on one base vs one "
                                            "tenant alone: trained tokens/s (aggregate_over_single), how far each "
                                            "tenant ends from its solo run (isolation_max_rel_diff), memory added."),
    "placement": Bench("graft.bench.placement", "a Tinker service's tenants on two vLLM servers: every tenant's versions "
                                                "on every server (graft) vs each tenant on one; publish seconds, "
                                                "tokens/s with all tenants sampling and with one alone."),
    "cookbook": Bench("graft.bench.cookbook", "tinker-cookbook's own RL recipe (math_rl, env=arithmetic) run by "
                                              "several tenants at once against graft's Tinker service on a real "
                                              "model: each tenant's reward per step, shared passes; cookbook.png."),
    "update": Bench("graft.bench.update", "one GRPO update (LoRA r16 fp32, one optimizer step) at the Qwen2.5-0.5B "
                                          "shape on this machine's device (CUDA or CPU), graft vs TRL GRPOTrainer + "
                                          "PEFT; best of --repeats after a warm-up: seconds, CPU seconds, tokens/s, "
                                          "peak memory, useful TFLOP/s and the fraction of a measured bf16 matmul "
                                          "peak (CUDA); --profile DIR writes torch.profiler tables."),
}


def bench_list() -> str:
    """The benches and what each measures, for `graft bench --help`."""
    width = max(map(len, BENCHES)) + 2
    return "benches:\n" + "\n".join(
        textwrap.fill(bench.about, 100, initial_indent=f"  {name:<{width}}", subsequent_indent=" " * (width + 2))
        for name, bench in BENCHES.items())


def bench_parser(name: str) -> argparse.ArgumentParser:
    """`graft bench NAME`'s parser: --json and --record, then the flags the bench module declares."""
    parser = argparse.ArgumentParser(prog=f"graft bench {name}", description=f"{BENCHES[name].about} Results and "
                                     "how to read them: docs/benchmarks.md.")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--record", nargs="?", const=name, type=result_name, metavar="NAME",
                        help=f"also keep the results as docs/results/NAME.json (default NAME: {name}) with this "
                             "machine, the date, the command and the git revision; `graft bench report` then "
                             "renders the docs' tables from it")
    importlib.import_module(BENCHES[name].module).add_arguments(parser)
    return parser


def run_bench(name: str, argv: list[str]) -> int:
    """Parse `graft bench NAME`'s flags, run the bench (it prints its table) and write --json. The exit
    code: 1 where a side the bench was asked for failed (its result's `failed`, side -> why; the
    others are still measured and written), so that a script running it (`make gpu-check`) sees it."""
    args = bench_parser(name).parse_args(argv)
    result = importlib.import_module(BENCHES[name].module).run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if result.get("failed"):
        print(f"graft bench {name}: failed: {', '.join(result['failed'])} (why: above)"
              + ("; not recorded" if args.record else ""), file=sys.stderr)
        return 1
    if args.record:
        path = record(args.record, result, shlex.join(["graft", "bench", name, *argv]))
        print(f"recorded {path}; `graft bench report` renders it into the docs")
    return 0


def add_bench_command(sub) -> None:
    """`graft bench BENCH [FLAGS]` on the `graft` parser: the bench's own parser reads FLAGS once
    BENCH is known, so only that bench's module is imported."""
    p = sub.add_parser("bench", help="benchmarks (measured side by side in one run)",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=bench_list(),
                       description="Run one bench: `graft bench BENCH [FLAGS]`; `graft bench BENCH --help` shows "
                                   "its flags; `--record` keeps the results in docs/results/, from which `graft "
                                   "bench report` renders the docs' tables. Results and how to read them: "
                                   "docs/benchmarks.md.")
    p.add_argument("bench", choices=[*BENCHES, "report"], metavar="BENCH",
                   help="the bench to run (listed below), or report: render the docs' result tables from "
                        "docs/results/*.json (`graft bench report --help`)")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, metavar="FLAGS", help="the bench's own flags")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.bench == "report":
        from graft.bench.report.render import main

        return main(args.bench_args)
    return run_bench(args.bench, args.bench_args)
