"""`graft train`: LoRA GRPO, one process or FSDP2 ranks under torchrun (graft.train.trainer does the work)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from graft.config.arguments import add_config_arguments


def add_command(sub) -> None:
    p = sub.add_parser("train", help="LoRA GRPO training (one process, or FSDP2 under torchrun)",
                       description="Run LoRA GRPO: rollouts from the engine (vLLM by default), group-relative "
                                   "advantages, PPO-clip update of the adapter, verified sync of every new version "
                                   "into the engine. Writes RUN_DIR/config.yaml, metrics.jsonl, eval.jsonl, "
                                   "reward.png, tensorboard/ and checkpoints/. Under `torchrun --nproc-per-node N "
                                   "-m graft.cli train ...` the model is sharded with FSDP2 over N ranks.")
    add_config_arguments(p, "train.steps=10")
    p.add_argument("--run-dir", default="runs/train", help="run directory (default runs/train)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in RUN_DIR, with "
                   "RUN_DIR/config.yaml (the run's own settings) where no CONFIG is given")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    import asyncio

    from graft.config import load_config

    config = _resumed_config(args) if args.resume else load_config(args.config, args.override)
    from graft.train.trainer import train  # after the config: a bad setting answers before 4 s of imports

    result = asyncio.run(train(config, Path(args.run_dir), resume=args.resume))
    if not result:  # ranks > 0 of a torchrun launch: rank 0 reports
        return
    run_dir = Path(args.run_dir)
    before = "n/a (resumed)" if result["accuracy_before"] is None else f"{result['accuracy_before']:.1%}"
    print(f"held-out accuracy {before} -> {result['accuracy_after']:.1%} after {result['steps']} steps; "
          f"metrics {run_dir / 'metrics.jsonl'}, plot {run_dir / 'reward.png'}, TensorBoard {run_dir / 'tensorboard'}")


def _resumed_config(args: argparse.Namespace):
    """CONFIG, else the resumed run's own saved one (`graft.config.loading.resumed_config`); rank 0
    names the settings that differ from the run's (a resumed run that silently learned at another rate,
    or for more steps, is hard to explain afterwards)."""
    from graft.config import ConfigError, load_config
    from graft.config.loading import changed_settings, resumed_config

    config, saved = resumed_config(args.run_dir, args.config, args.override), Path(args.run_dir) / "config.yaml"
    if saved.is_file() and os.environ.get("RANK", "0") == "0":
        with contextlib.suppress(ConfigError):  # a config.yaml an older graft wrote: CONFIG alone decides
            if changes := changed_settings(load_config(saved), config):
                print(f"graft: resuming {args.run_dir} with settings other than its config.yaml's: "
                      f"{'; '.join(changes)}", file=sys.stderr)
    return config
