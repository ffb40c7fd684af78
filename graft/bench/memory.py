"""`graft bench memory`: peak memory and seconds of one GRPO update at real shapes, graft vs TRL.

Each measurement runs in a fresh process, so its peak resident memory (`ru_maxrss`) is that
update's alone: a random Qwen2 of the Qwen2.5-0.5B shape (hidden 896, intermediate 4864, 14 heads /
2 KV heads, vocab 151,936, tied embeddings) cut to `layers`, LoRA r16 alpha 32 on all linear layers,
fp32, and one optimizer step over the shape's batch: 128-token prompts, completions alternating 512
and 256 tokens, groups of 8 (`graft.bench.memory_shape` builds model and batch for both sides).
Peaks are reported above the model's own memory (RSS after building it and its LoRA).

- graft: `policy_update` with the `train` config (defaults unless overridden), in
  `python -m graft.bench.memory --worker SPEC`.
- TRL: `GRPOTrainer` + PEFT on the same weights and token ids (`graft.bench.trl.memory_worker`, in
  the TRL virtualenv), in two configurations: "trl-defaults" (TRL's gradient checkpointing and
  micro-batch of 8) and "graft-settings" (no checkpointing, graft's token budget per micro-batch).
  `trl_peak_bytes` / `trl_seconds` are TRL's defaults; `trl` holds both.

Seconds are the update's only (no generation on either side): wall-clock, and CPU seconds of the
whole process (all threads; `time.process_time`), which other jobs on a shared machine disturb
far less than the wall-clock.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from graft.bench.memory_shape import COMPLETION_TOKENS, PAD_ID, PROMPT_TOKENS, QWEN_SHAPE, build_model, memory_batch
from graft.bench.trl.env import TrlEnvError, run_trl, trl_python
from graft.bench.trl.memory_worker import CONFIGS
from graft.config.arguments import COUNT
from graft.host import heap_friendly_environment  # light: no torch
from graft.models.packaged import PACKAGED_MODELS

# The batch per shape: 32 sequences (16,384 tokens) at 2 layers; 8 (one group, 4,096 tokens) at the
# full 24 layers, so that each side's update finishes in minutes on a 2-core CPU.
SHAPES = ({"name": "qwen2.5-0.5b-shape-2-layers", "layers": 2, "sequences": 32},
          {"name": "qwen2.5-0.5b-shape", "layers": 24, "sequences": 8})


def _measure_in_this_process(spec: dict, overrides: list[str]) -> dict:
    import torch

    from graft.config import load_config
    from graft.host import set_up_host_memory
    from graft.lora.attach import attach_lora, lora_parameters
    from graft.parallel.dist import Dist
    from graft.parallel.parallelize import decoder_layers, parallelize
    from graft.train.rollout_batch import RolloutBatch
    from graft.train.update import policy_update

    train = load_config(None, overrides).train
    set_up_host_memory(train)  # as `graft train` does
    model = attach_lora(build_model(spec["dims"], spec["layers"]), rank=16, alpha=32, seed=0)
    # As the trainer sets the model up: train.activation_checkpointing takes effect here, not in policy_update.
    parallelize(model, Dist(), activation_checkpointing=train.activation_checkpointing,
                lora_compute_dtype=train.lora_compute_dtype, compile_layers=train.compile)
    model_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rows, rewards_PG = memory_batch(spec["sequences"], spec["dims"]["vocab"], spec["prompt_tokens"],
                                    tuple(spec["completion_tokens"]))
    batch = RolloutBatch(rows, [[-5.0] * len(c) for _, c in rows], rewards_PG, version=0, seconds=0.0)
    optimizer = torch.optim.AdamW(lora_parameters(model).values(), lr=1e-4)
    start, cpu_start = time.perf_counter(), time.process_time()
    metrics = policy_update(model, optimizer, batch, train, pad_id=PAD_ID)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"model_bytes": model_bytes, "peak_bytes": peak_bytes, "seconds": seconds, "cpu_seconds": cpu_seconds,
            "tokens": sum(len(p) + len(c) for p, c in rows), "optimizer_steps": metrics["optimizer_steps"],
            # whether the update checkpointed a decoder layer (HF's model-level flag stays set under auto)
            "activation_checkpointing": any(layer.gradient_checkpointing for layer in decoder_layers(model))}


def worker_spec(shape: dict, dims: dict = QWEN_SHAPE) -> dict:
    """What both sides' workers build: model dimensions, layers and the batch."""
    return {"dims": dims, "layers": shape["layers"], "sequences": shape["sequences"],
            "prompt_tokens": shape.get("prompt_tokens", PROMPT_TOKENS),
            "completion_tokens": list(shape.get("completion_tokens", COMPLETION_TOKENS))}


def measure_graft(spec: dict, overrides: list[str]) -> dict:
    command = [sys.executable, "-m", "graft.bench.memory", "--worker", json.dumps(spec), *overrides]
    done = subprocess.run(command, capture_output=True, text=True, check=True,
                          env=heap_friendly_environment(os.environ))  # as the `graft` command's own process
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_trl(python: Path, spec: dict, config: str, work_dir: Path) -> dict:
    return run_trl(python, {**spec, "config": config}, work_dir / config, module="graft.bench.trl.memory_worker")


def _measured(label: str, shape: dict, tokens: int, console: Console, measure) -> dict | None:
    """Runs one measurement with a progress line before and after (each takes minutes). A process
    that fails (e.g. killed for memory on a shared machine) is reported and gives None: the other
    measurements still run."""
    console.print(f"measuring {label} at {shape['name']} ({shape['sequences']} sequences, {tokens:,} tokens) "
                  "in a fresh process...")
    try:
        result = measure()
    except (TrlEnvError, subprocess.CalledProcessError) as e:
        console.print(f"  {label} failed: {e}")
        return None
    console.print(f"  {label}: {(result['peak_bytes'] - result['model_bytes']) / 2**30:.2f} GiB above the model, "
                  f"{result['seconds']:.0f} s ({result['cpu_seconds']:.0f} CPU-s)")
    return result


def _shape_row(shape: dict, spec: dict, overrides: list[str], python: Path | None, work_dir: Path,
               console: Console) -> dict:
    tokens = shape["sequences"] * spec["prompt_tokens"] + sum(
        spec["completion_tokens"][i % len(spec["completion_tokens"])] for i in range(shape["sequences"]))
    graft = _measured("graft", shape, tokens, console, lambda: measure_graft(spec, overrides)) or {}
    row = {**shape, "vocab": spec["dims"]["vocab"], "sequences": shape["sequences"], "tokens": tokens,
           "graft_model_bytes": graft.get("model_bytes"), "graft_peak_bytes": graft.get("peak_bytes"),
           "graft_above_model_bytes": graft["peak_bytes"] - graft["model_bytes"] if graft else None,
           "graft_seconds": graft.get("seconds"), "graft_cpu_seconds": graft.get("cpu_seconds"),
           "graft_activation_checkpointing": graft.get("activation_checkpointing"),
           "trl_model_bytes": None, "trl_peak_bytes": None, "trl_above_model_bytes": None, "trl_seconds": None,
           "trl_cpu_seconds": None,
           "trl": {}}
    if python is None:
        return row
    for config in CONFIGS:
        trl = _measured(f"TRL ({config})", shape, tokens, console,
                        lambda: measure_trl(python, spec, config, work_dir / shape["name"]))
        row["trl"][config] = {**trl, "above_model_bytes": trl["peak_bytes"] - trl["model_bytes"]} if trl else None
    defaults = row["trl"]["trl-defaults"]
    if defaults:
        row.update(trl_model_bytes=defaults["model_bytes"], trl_peak_bytes=defaults["peak_bytes"],
                   trl_above_model_bytes=defaults["above_model_bytes"], trl_seconds=defaults["seconds"],
                   trl_cpu_seconds=defaults["cpu_seconds"])
    return row


def run_memory_bench(layers: tuple[int, ...] = (2,), overrides: list[str] | None = None, with_trl: bool = True,
                     cache_dir: Path | None = None, shapes: tuple[dict, ...] = SHAPES,
                     dims: dict = QWEN_SHAPE) -> dict:
    """graft, then TRL's two configurations, per shape, one at a time (never two measurements side by
    side: they would share the cores and the memory). `overrides` are graft's `train.*` overrides."""
    from graft.models.cache import default_cache_dir

    console = Console(stderr=True)
    python = trl_python(cache_dir or default_cache_dir(), console) if with_trl else None
    rows = []
    with tempfile.TemporaryDirectory(prefix="graft-bench-memory-") as work:
        for shape in shapes:
            if shape["layers"] in layers:
                rows.append(_shape_row(shape, worker_spec(shape, dims), overrides or [], python, Path(work), console))
    trl_version = next((t["trl_version"] for r in rows for t in r["trl"].values() if t), None)
    return {"overrides": overrides or [], "trl_version": trl_version, "shapes": rows}


def real_model_point(name: str) -> tuple[tuple[dict, ...], dict]:
    """(shapes, dims) of `graft bench memory --model NAME`: the packaged real model with its own weights
    and layers, one group of 8 sequences of the usual prompt and completion lengths."""
    from transformers import AutoConfig

    from graft.models.packaged import packaged_model_dir

    path = packaged_model_dir(name, log=Console(stderr=True).print)
    config = AutoConfig.from_pretrained(path)
    shape = {"name": name, "layers": config.num_hidden_layers, "sequences": 8}
    return (shape,), {"path": str(path), "vocab": config.vocab_size}


def print_memory_report(result: dict) -> None:
    table = Table(title="graft bench memory: one GRPO update (one optimizer step), LoRA r16, fp32, real vocabulary")
    for column in ("shape", "side", "rows", "tokens", "micro", "model GiB", "above model GiB", "s", "CPU-s"):
        table.add_column(column, justify="right")
    for s in result["shapes"]:
        sides = [("graft", s["graft_model_bytes"], s["graft_above_model_bytes"], s["graft_seconds"],
                  s["graft_cpu_seconds"], "token budget")]
        sides += [(f"TRL {config}" + (" +ckpt" if t and t["gradient_checkpointing"] else ""),
                   t and t["model_bytes"], t and t["above_model_bytes"], t and t["seconds"], t and t["cpu_seconds"],
                   f"{t['gradient_accumulation_steps']} x {t['per_device_train_batch_size']}" if t else "")
                  for config, t in s["trl"].items()]
        for side, model_bytes, above_bytes, seconds, cpu_seconds, micro in sides:
            numbers = ([f"{model_bytes / 2**30:.2f}", f"{above_bytes / 2**30:.2f}", f"{seconds:.0f}",
                        f"{cpu_seconds:.0f}"] if model_bytes is not None else ["failed"] * 4)
            table.add_row(s["name"], side, str(s["sequences"]), f"{s['tokens']:,}", micro, *numbers)
    Console().print(table)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`graft bench memory`'s flags: the layers of the Qwen2.5-0.5B shape, and whether TRL runs too."""
    parser.add_argument("--layers", type=COUNT, default=2,
                        help="decoder layers: 2 (32 sequences, the default) or 24 (8 sequences)")
    parser.add_argument("--no-trl", action="store_true", help="measure graft only (no TRL virtualenv)")
    parser.add_argument("--model", choices=sorted(PACKAGED_MODELS), default=None,
                        help="a real packaged model (its own weights and layers, 8 sequences) instead of the shape")


def run(args: argparse.Namespace) -> dict:
    """`graft bench memory`: measure, print the table, return what --json writes."""
    if args.model:
        shapes, dims = real_model_point(args.model)
        result = run_memory_bench(layers=(shapes[0]["layers"],), with_trl=not args.no_trl, shapes=shapes, dims=dims)
    else:
        result = run_memory_bench(layers=(args.layers,), with_trl=not args.no_trl)
    print_memory_report(result)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True, help="worker_spec(...) as JSON")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    print(json.dumps(_measure_in_this_process(json.loads(args.worker), args.overrides)))
