"""`graft bench WHICH`, by name: each entry runs one bench from the parsed command line, prints its
table and returns what `--json` writes. The heavy imports happen only for the bench that runs."""

from __future__ import annotations

import argparse
from pathlib import Path


def _bench_merge(args: argparse.Namespace) -> dict:
    from graft.bench.merge import print_merge_report, run_merge_bench

    result = run_merge_bench(hidden=args.hidden or 1024, layers=args.layers or 8, rank=args.rank,
                             repeats=args.repeats, cycles=args.cycles or 50)
    print_merge_report(result)
    return result


def _bench_sync(args: argparse.Namespace) -> dict:
    if args.sweep:
        from graft.bench.sync_sweep import plot_sweep, print_sweep_report, run_sync_sweep

        result = run_sync_sweep(args.sweep, repeats=min(args.repeats, 3))
        print_sweep_report(result)
        result["plot"] = str(plot_sweep(result, Path(args.plot_dir) / f"sync-{args.sweep}.png"))
        print(f"plot: {result['plot']}")
        return result
    from graft.bench.sync import SHAPES, print_sync_report, run_sync_bench

    result = run_sync_bench(tuple(args.models or SHAPES), repeats=min(args.repeats, 5))
    print_sync_report(result)
    return result


def _bench_e2e(args: argparse.Namespace) -> dict:
    from graft.bench.e2e import MODELS, print_e2e_report, run_e2e_bench

    models = ((args.hidden, args.layers or 2),) if args.hidden else MODELS
    result = run_e2e_bench(models, repeats=min(args.repeats, 3), steps=args.steps or 6)
    print_e2e_report(result)
    return result


def _bench_cores(args: argparse.Namespace) -> dict:
    from graft.bench.cores import MODELS, print_cores_report, run_cores_bench

    models = ((args.hidden, args.layers or 2),) if args.hidden else MODELS
    result = run_cores_bench(models, steps=args.steps or 6)
    print_cores_report(result)
    return result


def _bench_learning(args: argparse.Namespace) -> dict:
    from graft.bench.learning import print_learning_report, run_learning_bench

    result = run_learning_bench(steps=args.steps or 150, seed=args.seed, out_dir=Path(args.plot_dir))
    print_learning_report(result)
    return result


def _bench_rollout(args: argparse.Namespace) -> dict:
    from graft.bench.rollout import print_rollout_report, run_rollout_bench

    result = run_rollout_bench(hidden=args.hidden or 256, layers=args.layers or 4, rank=args.rank,
                               repeats=args.repeats)
    print_rollout_report(result)
    return result


def _bench_soak(args: argparse.Namespace) -> dict:
    from graft.bench.soak import print_soak_report, run_soak_bench

    result = run_soak_bench(cycles=args.cycles or 1000, concurrency=args.concurrency)
    print_soak_report(result)
    return result


def _bench_memory(args: argparse.Namespace) -> dict:
    from graft.bench.memory import print_memory_report, run_memory_bench

    result = run_memory_bench(layers=(args.layers or 2,), with_trl=not args.no_trl)
    print_memory_report(result)
    return result


def _bench_step(args: argparse.Namespace) -> dict:
    from graft.bench.step import print_step_report, real_shape_model, run_step_bench
    from graft.quickstart.base import default_cache_dir

    layers = args.layers or 24
    model_dir = real_shape_model(default_cache_dir() / f"qwen2.5-0.5b-shape-{layers}-layers", layers)
    result = run_step_bench(model_dir)
    print_step_report(result)
    return result


# `graft bench WHICH`: each runs, prints its table and returns what --json writes.
BENCHES = {"merge": _bench_merge, "rollout": _bench_rollout, "sync": _bench_sync, "e2e": _bench_e2e,
           "cores": _bench_cores, "learning": _bench_learning, "soak": _bench_soak, "memory": _bench_memory,
           "step": _bench_step}
