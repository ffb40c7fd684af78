"""`graft eval`: held-out accuracy of the base model or of a LoRA adapter (graft.evaluation)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from graft.config.arguments import add_config_arguments


def add_command(sub) -> None:
    p = sub.add_parser("eval", help="held-out accuracy of the base model or of a LoRA adapter",
                       description="Greedy answers to the config's held-out examples (train.eval_examples of them) "
                                   "from the config's engine, scored by data.eval_reward (else data.reward, or the "
                                   "weighted sum of data.rewards); the mean is reported as accuracy.")
    add_config_arguments(p, "train.eval_examples=100")
    p.add_argument("--adapter", metavar="DIR", help="PEFT LoRA adapter to evaluate (default: the base model)")
    p.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    p.add_argument("--run-dir", default="runs/eval", help="where engine logs go (default runs/eval)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    import asyncio

    from graft.atomic import atomic_write_text
    from graft.config import load_config
    from graft.evaluation import run_eval

    config = load_config(args.config, args.override)
    result = asyncio.run(run_eval(config, Path(args.run_dir), args.adapter))
    what = f"adapter {args.adapter}" if args.adapter else "base model"
    print(f"held-out accuracy of {what} on {config.model.path}: {result['accuracy']:.1%} "
          f"({result['examples']} examples, greedy)")
    if args.json:
        atomic_write_text(args.json, json.dumps(result, indent=2) + "\n")
