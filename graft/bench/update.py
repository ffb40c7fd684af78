"""`graft bench update`: one GRPO update of the LoRA policy, graft vs TRL, on this machine's device.

A random Qwen2 of the Qwen2.5-0.5B shape (`graft.bench.memory_shape`: hidden 896, intermediate 4864,
14 heads / 2 KV heads, vocab 151,936, tied embeddings) cut to `--layers`, its base in `--dtype`
(bf16 on a GPU, fp32 on the CPU as the other CPU benches), LoRA r16 alpha 32 on all linear layers in
fp32, and one optimizer step over a batch of `--sequences` rows of `--prompt-tokens` +
`--completion-tokens` tokens (groups of 8; generation is not part of it on either side):

- graft: `policy_update` with the `train` config (defaults, or `-o train.KEY=VALUE`), as the trainer
  sets the model up (`parallelize`: activation checkpointing per `train.activation_checkpointing`);
- TRL: `GRPOTrainer` + PEFT on the same weights and token ids (`graft.bench.trl.update_worker`), with
  "graft-settings" (graft's optimizer and loss settings, and the micro-batch size and checkpointing
  graft's side chose in this run) or `--trl-config trl-defaults`, in the TRL virtualenv
  or, where TRL is importable in this python (a GPU machine with its wheels installed), in this one.

Each side runs in a fresh process: one warm-up update, then `--repeats` timed ones; the best is
reported with its CPU seconds. Useful FLOPs are implementation-independent (`update_measure.
useful_flops`); on CUDA they are compared with the peak of a bf16 8192^3 matmul measured in this run.
`--profile DIR` adds one profiled update per side after the timed ones (DIR/graft.txt, DIR/trl.txt).
`--variant NAME:train.KEY=VALUE,...` adds graft sides with other settings ("graft NAME", each its own
process, after graft's own), so that settings are compared in one run on the same device.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from graft.bench.memory_shape import GROUP, PAD_ID, QWEN_SHAPE, memory_batch
from graft.bench.trl.env import TrlEnvError, run_trl, trl_python
from graft.bench.trl.memory_worker import CONFIGS
from graft.bench.update_measure import (
    DTYPES,
    UpdateClock,
    UpdateProfile,
    build_base,
    non_embedding_parameters,
    useful_flops,
)
from graft.config.arguments import COUNT
from graft.host import heap_friendly_environment  # light: no torch

SIDES = ("graft", "trl")
# The model's dimensions; a test passes smaller ones.
DIMS = QWEN_SHAPE
MATMUL_SIZE = 8192


def _graft_updates(spec: dict) -> dict:
    """graft's side, in its own process (`python -m graft.bench.update --worker SPEC`)."""
    import torch

    from graft.config import load_config
    from graft.host import set_up_host_memory
    from graft.lora.attach import attach_lora, lora_parameters
    from graft.parallel.dist import Dist
    from graft.parallel.parallelize import decoder_layers, parallelize
    from graft.train.memory_budget import auto_sizes
    from graft.train.rollout_batch import RolloutBatch
    from graft.train.update import policy_update

    train = load_config(None, spec["overrides"]).train
    set_up_host_memory(train)  # as `graft train` does
    model = attach_lora(build_base(spec), rank=16, alpha=32, seed=0).to(spec["device"])
    parallelize(model, Dist(), activation_checkpointing=train.activation_checkpointing,
                lora_compute_dtype=train.lora_compute_dtype, compile_layers=train.compile)
    clock = UpdateClock(spec["device"])
    model_bytes = clock.memory_bytes()
    rows, rewards_PG = memory_batch(spec["sequences"], spec["dims"]["vocab"], spec["prompt_tokens"],
                                    (spec["completion_tokens"],))
    batch = RolloutBatch(rows, [[-5.0] * len(c) for _, c in rows], rewards_PG, version=0, seconds=0.0)
    optimizer = torch.optim.AdamW(lora_parameters(model).values(), lr=1e-4)
    steps = 0
    for _ in range(1 + spec["repeats"]):
        clock.start()
        steps += policy_update(model, optimizer, batch, train, pad_id=PAD_ID)["optimizer_steps"]
        clock.stop()
    result = clock.result(model_bytes)
    if spec.get("profile"):
        with UpdateProfile(spec["device"], Path(spec["profile"]) / f"{spec.get('label', 'graft')}.txt"):
            policy_update(model, optimizer, batch, train, pad_id=PAD_ID)
    layers = decoder_layers(model)
    sizes = auto_sizes(model, batch, train, Dist())  # as the update resolved them (the memory free now)
    return {**result, "optimizer_steps": steps, "non_embedding_parameters": non_embedding_parameters(model),
            "activation_checkpointing": train.activation_checkpointing,
            "micro_batch_tokens": sizes.max_tokens_per_micro_batch, "logit_chunk_tokens": sizes.logit_chunk_tokens,
            "checkpointed_layers": sum(bool(m.gradient_checkpointing) for m in layers),
            "lora_dtype": str(next(iter(lora_parameters(model).values())).dtype).removeprefix("torch."),
            "overrides": spec["overrides"]}


def measure_graft(spec: dict, work_dir: Path) -> dict:
    """graft's side in a fresh process (its memory peak is this update's alone)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    out = work_dir / "graft.json"
    done = subprocess.run([sys.executable, "-m", "graft.bench.update", "--worker", json.dumps(spec), str(out)],
                          capture_output=True, text=True, env=heap_friendly_environment(os.environ))  # as `graft`'s
    if done.returncode:
        tail = "\n".join(done.stderr.splitlines()[-15:])
        raise RuntimeError(f"graft's update failed (exit {done.returncode}):\n{tail}")
    return json.loads(out.read_text())


def trl_interpreter(console: Console) -> Path:
    """This python where TRL is importable in it (a GPU machine with TRL's wheels installed: its CUDA
    torch), otherwise the TRL virtualenv's (built on first use)."""
    if importlib.util.find_spec("trl") is not None:
        return Path(sys.executable)
    from graft.models.cache import default_cache_dir

    return trl_python(default_cache_dir(), console)


def measure_trl(spec: dict, work_dir: Path, console: Console) -> dict:
    return run_trl(trl_interpreter(console), spec, work_dir / "trl", module="graft.bench.trl.update_worker")


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible")
    return device


def device_name(device: str) -> str:
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return f"cpu ({os.cpu_count()} cores)"


def peak_matmul_tflops(repeats: int = 5) -> float:
    """TFLOP/s of a bf16 8192^3 matmul on the GPU: the mean of `repeats` after 3 warm-ups."""
    import torch

    a, b = (torch.randn(MATMUL_SIZE, MATMUL_SIZE, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / repeats
    del a, b
    torch.cuda.empty_cache()
    return 2 * MATMUL_SIZE**3 / seconds / 1e12


def side_summary(raw: dict, spec: dict, peak_tflops: float | None) -> dict:
    """The reported numbers of one side: its best timed update (and that update's CPU seconds)."""
    best = min(range(len(raw["all_seconds"])), key=raw["all_seconds"].__getitem__)
    seconds, cpu_seconds = raw["all_seconds"][best], raw["all_cpu_seconds"][best]
    tokens = spec["sequences"] * (spec["prompt_tokens"] + spec["completion_tokens"])
    tflops = useful_flops(spec, raw["non_embedding_parameters"]) / seconds / 1e12
    above = raw["peak_bytes"] - raw["model_bytes"]
    return {**raw, "seconds": seconds, "cpu_seconds": cpu_seconds, "tokens": tokens,
            "tokens_per_second": tokens / seconds, "tokens_per_cpu_second": tokens / cpu_seconds,
            # CUDA: allocated bytes at the peak, weights included; CPU: resident peak above the model's.
            "peak_bytes": raw["peak_bytes"] if spec["device"] == "cuda" else above, "above_model_bytes": above,
            "useful_flops": useful_flops(spec, raw["non_embedding_parameters"]), "useful_tflops": tflops,
            "peak_fraction": tflops / peak_tflops if peak_tflops else None}


def run_update_bench(spec: dict, sides: tuple[str, ...] = SIDES, console: Console | None = None) -> dict:
    """Each side of `sides` in turn (never side by side: they would share the device), then the summary."""
    console = console or Console(stderr=True)
    peak = peak_matmul_tflops() if spec["device"] == "cuda" else None
    out: dict = {}
    measures = {"graft": lambda work: measure_graft(spec, work),
                "trl": lambda work: measure_trl({**spec, "graft_sizes": _sizes(out["sides"].get("graft"))}, work,
                                                console)}
    for name, overrides in spec.get("variants", {}).items():
        label = f"graft {name}"
        measures[label] = lambda work, o=overrides, label=label: measure_graft(
            {**spec, "overrides": [*spec["overrides"], *o], "label": label.replace(" ", "-")}, work / label)
        sides = (*sides, label)
    out.update({"device": device_name(spec["device"]), "dtype": spec["dtype"], "peak_tflops": peak,
                "spec": {k: v for k, v in spec.items() if k != "profile"}, "sides": {}})
    with tempfile.TemporaryDirectory(prefix="graft-bench-update-") as work:
        for side in sides:
            console.print(f"{side}: 1 warm-up + {spec['repeats']} timed updates, {spec['layers']} layers, "
                          f"{spec['sequences']} x ({spec['prompt_tokens']} + {spec['completion_tokens']}) tokens, "
                          f"on {out['device']}...")
            try:
                out["sides"][side] = side_summary(measures[side](Path(work)), spec, peak)
            except (TrlEnvError, RuntimeError) as e:
                console.print(f"  {side} failed: {e}")
                out.setdefault("failed", {})[side] = str(e).splitlines()[0]
    return out


def _sizes(graft_side: dict | None) -> dict | None:
    """What TRL's graft-settings copy from graft's side of this run: its micro-batch tokens and
    whether it checkpointed (None: no graft side, the fixed graft-settings)."""
    if graft_side is None:
        return None
    return {key: graft_side[key] for key in ("micro_batch_tokens", "checkpointed_layers")}


def print_update_report(result: dict) -> None:
    spec = result["spec"]
    table = Table(title=f"graft bench update: one GRPO update, {spec['layers']} layers of the Qwen2.5-0.5B shape, "
                        f"{result['dtype']} base, LoRA r16 fp32, on {result['device']}")
    table.add_column("side", no_wrap=True)
    for column in ("s", "CPU-s", "tokens", "tok/s", "tok/CPU-s", "peak GiB", "TFLOP/s", "of peak"):
        table.add_column(column, justify="right")
    for side, s in result["sides"].items():
        fraction = f"{s['peak_fraction']:.1%}" if s["peak_fraction"] is not None else "-"
        table.add_row(side, f"{s['seconds']:.2f}", f"{s['cpu_seconds']:.1f}", f"{s['tokens']:,}",
                      f"{s['tokens_per_second']:,.0f}", f"{s['tokens_per_cpu_second']:,.0f}",
                      f"{s['peak_bytes'] / 2**30:.2f}", f"{s['useful_tflops']:.3f}", fraction)
    Console().print(table)
    for side, s in result["sides"].items():
        if "micro_batch_tokens" in s:  # graft's sides: the sizes its update chose
            tokens, chunk = s["micro_batch_tokens"], s["logit_chunk_tokens"]
            Console().print(f"{side}: micro-batches of at most {'any' if tokens is None else f'{tokens:,}'} tokens, "
                            f"head chunks of {'64 MiB' if chunk is None else f'{chunk:,} positions'}, "
                            f"{s['checkpointed_layers']} of {spec['layers']} layers checkpointed")
    if result["peak_tflops"]:
        Console().print(f"peak: bf16 {MATMUL_SIZE}^3 matmul, {result['peak_tflops']:.0f} TFLOP/s")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`graft bench update`'s flags: the shape, the batch, the device and dtype, the sides, profiling."""
    parser.add_argument("--layers", type=COUNT, default=24, help="decoder layers (default %(default)s)")
    parser.add_argument("--sequences", type=COUNT, default=64,
                        help=f"rows in the batch, a multiple of the group ({GROUP}); default %(default)s")
    parser.add_argument("--prompt-tokens", type=COUNT, default=128, help="per row (default %(default)s)")
    parser.add_argument("--completion-tokens", type=COUNT, default=256, help="per row (default %(default)s)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: CUDA where visible, else the CPU")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="the base's dtype (default: bfloat16 on CUDA, float32 on the CPU)")
    parser.add_argument("--repeats", type=COUNT, default=2, help="timed updates after the warm-up; the best counts")
    parser.add_argument("--sides", default=",".join(SIDES), help="comma-separated, of: graft, trl (default both)")
    parser.add_argument("--trl-config", choices=CONFIGS, default="graft-settings",
                        help="TRL's settings, as `graft bench memory` (default %(default)s)")
    parser.add_argument("-o", "--override", action="append", default=[], metavar="train.KEY=VALUE",
                        help="graft's train config overrides (repeatable)")
    parser.add_argument("--profile", metavar="DIR", help="one more, profiled, update per side: DIR/SIDE.txt")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:train.KEY=VALUE,...",
                        help="one more graft side, 'graft NAME', with these overrides on top of -o (repeatable)")


def update_spec(args: argparse.Namespace) -> dict:
    """What both sides' workers build and run, from the flags.

    Raises:
        ValueError: a side other than graft or trl, or a batch that is not whole groups.
    """
    sides = tuple(s.strip() for s in args.sides.split(",") if s.strip())
    if not sides or set(sides) - set(SIDES):
        raise ValueError(f"--sides {args.sides!r}: choose from {', '.join(SIDES)}")
    if args.sequences % GROUP:
        raise ValueError(f"--sequences must be a multiple of {GROUP} (got {args.sequences})")
    variants = parse_variants(args.variant, args.override)
    device = resolve_device(args.device)
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    return {"dims": DIMS, "layers": args.layers, "sequences": args.sequences, "prompt_tokens": args.prompt_tokens,
            "completion_tokens": args.completion_tokens, "device": device, "dtype": dtype, "repeats": args.repeats,
            "config": args.trl_config, "overrides": args.override, "sides": list(sides), "variants": variants,
            "profile": str(Path(args.profile).resolve()) if args.profile else None}


def parse_variants(flags: list[str], overrides: list[str]) -> dict[str, list[str]]:
    """`--variant NAME:train.KEY=VALUE,...` flags as {NAME: overrides}, each checked against graft's
    config (with `-o`'s) before anything runs.

    Raises:
        ValueError: a flag without a name or overrides, a name given twice, or an override the config refuses.
    """
    from graft.config import ConfigError, load_config

    variants: dict[str, list[str]] = {}
    for flag in flags:
        name, _, listed = flag.partition(":")
        items = [item.strip() for item in listed.split(",") if item.strip()]
        if not name.strip() or not items or name.strip() in variants:
            raise ValueError(f"--variant {flag!r}: give a new NAME and its overrides, as NAME:train.KEY=VALUE,...")
        try:
            load_config(None, [*overrides, *items])
        except (ConfigError, ValueError) as e:
            raise ValueError(f"--variant {flag!r}: {e}") from None
        variants[name.strip()] = items
    return variants


def run(args: argparse.Namespace) -> dict:
    """`graft bench update`: measure, print the table, return what --json writes."""
    spec = update_spec(args)
    result = run_update_bench(spec, tuple(spec["sides"]))
    print_update_report(result)
    return result


if __name__ == "__main__":
    worker = argparse.ArgumentParser()
    worker.add_argument("--worker", required=True, help="update_spec(...) as JSON")
    worker.add_argument("out", help="where the result's JSON goes")
    worker_args = worker.parse_args()
    Path(worker_args.out).write_text(json.dumps(_graft_updates(json.loads(worker_args.worker))) + "\n")
