"""`graft config`: a config validated (rewards and environment resolved too) and printed resolved."""

from __future__ import annotations

import argparse

from graft.config.arguments import add_config_arguments


def add_command(sub) -> None:
    p = sub.add_parser("config", help="validate a config and print it resolved",
                       description="Load a YAML config with -o overrides, validate it (rewards resolved: user "
                                   "reward modules are imported), print the resolved config.")
    add_config_arguments(p, "lora.rank=16")
    p.add_argument("--save", metavar="FILE", help="also write the resolved config to FILE")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from graft.config import config_to_yaml, load_config, save_config
    from graft.tasks.envs import resolve_env
    from graft.tasks.registry import check_local_model_prompts, load_task_data
    from graft.tasks.reward_loading import load_eval_scorer, load_scorer

    config = load_config(args.config, args.override)
    if config.data.env is not None:  # an environment or a reward that does not resolve is a config error too
        resolve_env(config.data.env)
    else:
        load_scorer(config.data)
        load_eval_scorer(config.data)
    if config.data.task is not None:  # a built-in task's settings (data.task_options) are checked by building it
        load_task_data(config.data)
    check_local_model_prompts(config)
    if args.save:
        save_config(config, args.save)
    print(config_to_yaml(config), end="")
