"""`graft bench cookbook`: tinker-cookbook's own RL recipe, run by several tenants at once against
graft's Tinker service (`graft tenants serve`), on a real model here.

The recipe is the cookbook's `tinker_cookbook.recipes.math_rl.train` with `env=arithmetic` (its
smallest RL example: "What is x + y?" with a few-shot prefix, reward 1 for the right sum), run
unchanged, one process per tenant, all started together against one service: one vLLM server (each
tenant's versions served as `<tenant>-v<N>`, delivery-verified), one base in the trainer, the
tenants' forward_backward passes batched together. Settings the recipe takes on its command line:
`loss_fn=importance_sampling` (`--loss-fn`: any of the SDK's RL losses; the recipe's default
`stable_reinforce` needs server-side provenance graft does not record), `renderer_name=role_colon`
(plain "User:/Assistant:" text, fitting any tokenizer).

The cookbook runs in graft's virtualenv (its `tinker` SDK, torch, transformers, datasets) with its
own package and the few pure-Python packages it needs beyond those installed once into a directory
under the cache (`cookbook_site`), not into graft's environment: its `tml-renderers` requirement
is not on the package index here and serves only its Inkling and audio renderers.

Reported per tenant: the mean reward of the first and last `--window` steps (the recipe's
`env/all/reward/total`), and how many of the service's forward_backward passes held more than one
tenant. cookbook.png plots every tenant's reward per step.

`--tenants 1,2,4,8`: the scaling curve (graft.bench.cookbook_curve), each N its own service and N
processes on one vLLM server: per N trained and sampled tokens/s, the trainer's busy fraction and the
fraction of passes holding two tenants or more; `--json` carries `aggregate_over_single`,
`multi_tenant_pass_fraction` and `trainer_busy_fraction` of the largest N and every row in `curve`;
cookbook-curve.png plots them. `--steps 3 --groups 2 --group-size 4` keeps a curve short.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from graft.atomic import one_builder
from graft.bench.cookbook_curve import curve_row, curve_summary, plot_curve
from graft.config.arguments import COUNT

COOKBOOK = "tinker-cookbook==0.6.1"
# What the recipe imports beyond graft's environment (pure Python, or wheels for this platform).
COOKBOOK_EXTRAS = ["chz==0.4.0", "blobfile==3.3.0", "lxml==6.1.3", "pycryptodomex==3.24.2", "termcolor==3.3.0",
                   "pyrage==1.4.0", "pylatexenc==2.11", "math-verify==0.9.0", "latex2sympy2_extended==1.11.0",
                   "antlr4-python3-runtime==4.13.2"]
RECIPE = "tinker_cookbook.recipes.math_rl.train"
REWARD = "env/all/reward/total"


def cookbook_site(cache_dir: Path, console: Console) -> Path:
    """A directory holding the cookbook and its extra packages (installed on first use), for PYTHONPATH."""
    site = cache_dir / f"cookbook-{COOKBOOK.split('==')[1]}"
    stamp = site / ".graft-installed.json"
    wanted = [COOKBOOK, *COOKBOOK_EXTRAS]
    with one_builder(cache_dir / "cookbook.lock"):  # a second bench waits here for the first one's install
        if stamp.is_file() and json.loads(stamp.read_text()) == wanted:
            return site
        log = cache_dir / "cookbook-install.log"
        with console.status(f"installing {COOKBOOK} into {site} (once; log {log})"), open(log, "w") as out:
            code = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--upgrade", "--target",
                                   str(site), *wanted], stdout=out, stderr=subprocess.STDOUT).returncode
        if code:
            raise RuntimeError(f"installing {COOKBOOK} failed; see {log}")
        stamp.write_text(json.dumps(wanted))
    return site


def recipe_command(model_dir: Path, base_url: str, log_path: Path, args: argparse.Namespace,
                   loss_fn: str) -> list[str]:
    """The cookbook recipe's command line for one tenant (its own chz `key=value` arguments)."""
    settings = {"env": "arithmetic", "model_name": str(model_dir), "renderer_name": "role_colon",
                "base_url": base_url, "loss_fn": loss_fn, "lora_rank": args.rank,
                "group_size": args.group_size, "groups_per_batch": args.groups, "learning_rate": args.learning_rate,
                "max_tokens": args.max_tokens, "max_steps": args.steps, "eval_every": 0, "save_every": args.steps,
                "log_path": str(log_path), "behavior_if_log_dir_exists": "delete"}
    return [sys.executable, "-m", RECIPE, *(f"{key}={value}" for key, value in settings.items())]


def rewards(log_path: Path) -> list[float]:
    """The recipe's reward per step so far (its metrics.jsonl)."""
    metrics = log_path / "metrics.jsonl"
    if not metrics.is_file():
        return []
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [row[REWARD] for row in rows if REWARD in row]


def run_recipes(model_dir: Path, base_url: str, key: str, site: Path, out: Path, args: argparse.Namespace,
                console: Console) -> dict[str, list[float]]:
    """Start one recipe process per tenant together and wait for all; each tenant's rewards per step."""
    env = {**os.environ, "TINKER_API_KEY": key, "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    logs = {f"tenant{i + 1}": out / f"tenant{i + 1}" for i in range(args.tenants)}
    losses = args.loss_fn.split(",")
    processes = {}
    for index, (name, log_path) in enumerate(logs.items()):
        log_path.parent.mkdir(parents=True, exist_ok=True)
        command = recipe_command(model_dir, base_url, log_path, args, losses[index % len(losses)])
        with open(out / f"{name}.log", "w") as stdout:
            processes[name] = subprocess.Popen(command, env=env, stdout=stdout, stderr=subprocess.STDOUT, cwd=out)
    with console.status("") as status:
        while any(process.poll() is None for process in processes.values()):
            status.update("cookbook RL recipe, " + ", ".join(
                f"{name}: step {len(rewards(log_path))}/{args.steps}" for name, log_path in logs.items()))
            time.sleep(2)
    failed = [name for name, process in processes.items() if process.returncode]
    if failed:
        tail = "\n".join((out / f"{failed[0]}.log").read_text().splitlines()[-20:])
        raise RuntimeError(f"the cookbook recipe of {', '.join(failed)} failed; last lines of "
                           f"{out / f'{failed[0]}.log'}:\n{tail}")
    return {name: rewards(log_path) for name, log_path in logs.items()}


def measure(args: argparse.Namespace, console: Console) -> dict:
    """Launch vLLM (once, with slots for the largest N), then per N a Tinker service and N recipes;
    the largest N's rewards and pass sizes, and the curve's rows (graft.bench.cookbook_curve)."""
    from graft.models.cache import default_cache_dir
    from graft.models.loading import require_model_dir
    from graft.rollout.vllm.launcher import VllmServer, VllmServerConfig

    site = cookbook_site(default_cache_dir(), console)
    model_dir = require_model_dir(args.model, log=lambda message: console.print(message))
    out = Path(args.out).resolve()  # the recipes run in it: their relative log paths would nest
    out.mkdir(parents=True, exist_ok=True)
    slots = 2 * max(args.tenants)  # each tenant keeps its 2 newest versions served
    config = VllmServerConfig(model=str(model_dir), dtype="float32", max_lora_rank=args.rank, max_loras=slots,
                              log_dir=out)
    with console.status(f"starting vLLM for {model_dir}"):
        server = VllmServer(config).__enter__()
    try:
        runs = [measure_one(server.url, model_dir, site, slots, argparse.Namespace(**{**vars(args), "tenants": n}),
                            out / f"n{n}" if len(args.tenants) > 1 else out, console) for n in args.tenants]
    finally:
        server.__exit__(None, None, None)
    largest = max(runs, key=lambda run: run["tenants"])
    return {"model": args.model, "tenants": largest["tenants"], "steps": args.steps, "seconds": largest["seconds"],
            "settings": {"group_size": args.group_size, "groups_per_batch": args.groups, "rank": args.rank,
                         "learning_rate": args.learning_rate, "max_tokens": args.max_tokens, "loss_fn": args.loss_fn,
                         "batch_window_s": args.batch_window},
            "rewards": largest.pop("rewards"), "passes": largest["passes"], "shared_passes": largest["shared_passes"],
            **curve_summary([{key: value for key, value in run.items() if key != "rewards"} for run in runs])}


def measure_one(url: str, model_dir: Path, site: Path, slots: int, args: argparse.Namespace, out: Path,
                console: Console) -> dict:
    """One N (`args.tenants`): a fresh Tinker service on the vLLM server at `url`, N recipes against
    it; its curve row with the tenants' rewards."""
    import functools

    from graft.host import release_cached_memory
    from graft.tenants.background import ServiceThread
    from graft.tenants.command import served_tenants

    key = "tml-" + secrets.token_hex(16)
    window = {} if args.batch_window is None else {"batch_window_s": args.batch_window}
    service = functools.partial(served_tenants, url, model_dir, run_dir=out / "service", max_loras=slots,
                                max_rank=args.rank, **window)
    with ServiceThread(service, key) as running:
        start = time.perf_counter()
        per_tenant = run_recipes(model_dir, running.url, key, site, out, args, console)
        seconds = time.perf_counter() - start
        row = curve_row(args.tenants, running.service.scheduler, [out / name for name in per_tenant], seconds)
    # Each service's model thread is a new glibc arena holding its passes' cached memory (the service
    # runs "cached": graft.host); untrimmed, the bench held 18 GB at N=4 and ran out at 8.
    release_cached_memory()
    console.print(f"{args.tenants} tenant(s): {json.dumps(row)}")
    return {**row, "rewards": per_tenant}


def summarise(result: dict, window: int) -> dict:
    """First and last `window` steps' mean reward per tenant, and whether it rose."""
    summary = {}
    for name, series in result["rewards"].items():
        first, last = series[:window], series[-window:]
        summary[name] = {"first": sum(first) / len(first), "last": sum(last) / len(last)}
        summary[name]["rose"] = summary[name]["last"] > summary[name]["first"]
    return summary


def plot_rewards(result: dict, path: Path) -> Path:
    from graft.bench.common import pyplot, save_figure  # torch and vLLM's client: only once there is a plot

    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    for name, series in result["rewards"].items():
        ax.plot(range(1, len(series) + 1), series, "o-", label=name)
    settings = result["settings"]
    ax.set_xlabel("training step (one batch of the recipe)")
    ax.set_ylabel("mean reward of the step's samples\n(1 right sum, -0.1 no stop sequence)")
    ax.set_title(f"tinker-cookbook math_rl (env=arithmetic), {result['tenants']} tenants at once on one graft service\n"
                 f"{result['model']}, LoRA r{settings['rank']}, {settings['groups_per_batch']} x "
                 f"{settings['group_size']} samples per step", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return save_figure(fig, path)


def print_curve(result: dict) -> None:
    table = Table(title="scaling: one service, N recipe processes")
    columns = ("tenants", "trained tokens/s", "sampled tokens/s", "trainer busy", "passes >= 2 tenants",
               "step s (median)", "arrival gap s (median)")
    for column in columns:
        table.add_column(column)
    for row in result["curve"]:
        table.add_row(str(row["tenants"]), f"{row['trained_tokens_per_s']:.1f}", f"{row['sampled_tokens_per_s']:.1f}",
                      f"{row['trainer_busy_fraction']:.2f}", f"{row['multi_tenant_pass_fraction']:.2f}",
                      str(row["step_median_s"]), str(row["gap_median_s"]))
    Console().print(table)
    Console().print(f"aggregate trained tokens/s over one tenant's: {result['aggregate_over_single']}")


RL_LOSSES = ("importance_sampling", "ppo", "cispo", "dro")  # the SDK's losses that the RL recipe trains with


def _losses(text: str) -> str:
    if unknown := [name for name in text.split(",") if name not in RL_LOSSES]:
        raise argparse.ArgumentTypeError(f"unknown loss {unknown[0]!r} (one or more of {', '.join(RL_LOSSES)})")
    return text


def _counts(text: str) -> list[int]:
    return [COUNT(part) for part in text.split(",")]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="a packaged model's name or an HF directory")
    parser.add_argument("--tenants", type=_counts, default=[2],
                        help="recipe processes run at once, one tenant each; several (1,2,4,8): the scaling curve, "
                             "each N its own service and processes")
    parser.add_argument("--batch-window", type=float, default=None,
                        help="the service's batch_window_s (graft.tenants.schedule); default: the service's")
    parser.add_argument("--steps", type=COUNT, default=12, help="the recipe's max_steps")
    parser.add_argument("--groups", type=COUNT, default=8, help="the recipe's groups_per_batch (prompts per step)")
    parser.add_argument("--group-size", type=COUNT, default=8, help="the recipe's group_size (samples per prompt)")
    parser.add_argument("--rank", type=COUNT, default=8, help="the recipe's lora_rank (one vLLM accepts: 8, 16, ...)")
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--max-tokens", type=COUNT, default=5, help="the recipe's max_tokens (the recipe's default)")
    parser.add_argument("--loss-fn", type=_losses, default="importance_sampling",
                        help="the recipe's loss_fn; several, comma-separated, go to the tenants in turn")
    parser.add_argument("--window", type=COUNT, default=3, help="steps averaged at the start and at the end")
    parser.add_argument("--out", default="runs/bench/cookbook", help="logs, the recipes' log paths, cookbook.png")


def run(args: argparse.Namespace) -> dict:
    """`graft bench cookbook`: run, print the table, plot; return what --json writes."""
    console = Console(stderr=True)
    result = measure(args, console)
    result["summary"] = summarise(result, args.window)
    table = Table(title=f"tinker-cookbook RL recipe, {result['tenants']} tenants at once ({result['seconds']:.0f} s)")
    for column in ("tenant", f"reward, first {args.window} steps", f"reward, last {args.window} steps", "rose"):
        table.add_column(column)
    for name, row in result["summary"].items():
        table.add_row(name, f"{row['first']:.3f}", f"{row['last']:.3f}", "yes" if row["rose"] else "no")
    Console().print(table)
    Console().print(f"forward_backward passes: {result['passes']}, of which {result['shared_passes']} held "
                    "several tenants")
    result["plot"] = str(plot_rewards(result, Path(args.out) / "cookbook.png"))
    Console().print(f"plot: {result['plot']}")
    print_curve(result)
    if len(args.tenants) > 1:
        result["curve_plot"] = str(plot_curve(result["curve"], f"tinker-cookbook math_rl on one graft service, "
                                              f"{args.model}, {args.steps} steps per tenant",
                                              Path(args.out) / "cookbook-curve.png"))
        Console().print(f"plot: {result['curve_plot']}")
    return result
