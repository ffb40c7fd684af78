"""`graft quickstart`: the README's main job, run end to end on this machine.

What it does today (the GRPO loop is not built yet and this says so): build a tiny base model,
train a LoRA adapter on it by short supervised learning on an arithmetic task, save the adapter in
PEFT format and check it with the PEFT library, export the merged model and check it with
transformers, then start a real vLLM server and sync the policy into it as an adapter
(`<lora.name>-v1`) and as merged weights, verifying each delivery against the trainer's log-probs.
Every number printed is measured in this run.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import peft  # noqa: E402
import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn  # noqa: E402
from rich.table import Table  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from graft.config import load_config, save_config  # noqa: E402
from graft.lora.adapter_io import is_peft_adapter, save_adapter  # noqa: E402
from graft.lora.attach import (  # noqa: E402
    adapter_disabled,
    attach_lora,
    count_parameters,
    lora_parameters,
)
from graft.lora.export import export_merged  # noqa: E402
from graft.models.loading import load_model, load_tokenizer  # noqa: E402
from graft.models.tiny import build_tiny_model  # noqa: E402
from graft.rollout.factory import open_engine  # noqa: E402
from graft.sync.policy_sync import PolicySync  # noqa: E402

TRAIN_STEPS = 100
BATCH = 16


def _arithmetic_batch(rng: random.Random, tokenizer, n: int) -> torch.Tensor:
    """`n` right-padded lines like "What is 12 + 34? 46" as token ids."""
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        lines.append(f"What is {a} + {b}? {a + b}<|im_end|>")
    ids = [tokenizer.encode(line) for line in lines]
    width = max(len(x) for x in ids)
    batch = torch.full((n, width), -100)
    for row, x in enumerate(ids):
        batch[row, : len(x)] = torch.tensor(x)
    return batch


def _train(model, tokenizer, steps: int, lr: float, seed: int) -> list[float]:
    """Next-token cross-entropy on arithmetic lines, LoRA parameters only."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(lora_parameters(model).values(), lr=lr)
    losses = []
    model.train()
    columns = (TextColumn("training the adapter"), BarColumn(), TextColumn("step {task.completed}/{task.total}"),
               TextColumn("loss {task.fields[loss]:.3f}"), TimeRemainingColumn())
    with Progress(*columns) as progress:
        task = progress.add_task("train", total=steps, loss=float("nan"))
        for _ in range(steps):
            labels = _arithmetic_batch(rng, tokenizer, BATCH)
            input_ids = labels.clamp(min=0)
            loss = model(input_ids=input_ids, attention_mask=(labels != -100).long(), labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            progress.update(task, advance=1, loss=losses[-1])
    model.eval()
    return losses


def _plot(losses: list[float], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.set_title("LoRA adapter, supervised warm-up on arithmetic")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


async def _serve_and_sync(config, model, run_dir: Path, step: int) -> dict:
    """Serve the base on a real vLLM server, then push the trained policy both ways and verify each."""
    shutil.rmtree(run_dir / "weights", ignore_errors=True)  # versions restart at 1 in every run
    async with open_engine(config, run_dir) as engine:
        adapter_sync = PolicySync(config, engine, run_dir)
        adapter_metrics = await adapter_sync(model, 1, step)
        adapters = await engine.list_adapters()
        await adapter_sync.close()
        merged_config = load_config(None, [f"model.path={config.model.path}", "sync.mode=merged"])
        merged_metrics = await PolicySync(merged_config, engine, run_dir)(model, 1, step)
    return {"adapter_sync": adapter_metrics, "engine_adapters": adapters, "merged_sync": merged_metrics}


def run_quickstart(run_dir: Path) -> dict:
    console = Console()
    start = time.perf_counter()
    run_dir.mkdir(parents=True, exist_ok=True)
    config = load_config(None, ["model.path=" + str(run_dir / "base")])
    save_config(config, run_dir / "config.yaml")
    base_dir = Path(config.model.path)
    if not (base_dir / "config.json").is_file():
        build_tiny_model(base_dir, arch="qwen2", hidden=128, layers=2, seed=config.train.seed)
    console.print(f"base model: {base_dir}")

    tokenizer = load_tokenizer(base_dir)
    lora = config.lora
    model = attach_lora(load_model(base_dir), rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                        target_modules=lora.target_modules, exclude_modules=lora.exclude_modules,
                        seed=config.train.seed)
    trainable, total = count_parameters(model)
    console.print(f"LoRA r={lora.rank} alpha={lora.alpha:g} on {lora.target_modules}: "
                  f"{trainable:,} trainable of {total:,} parameters")
    losses = _train(model, tokenizer, TRAIN_STEPS, lr=3e-3, seed=config.train.seed)
    _plot(losses, run_dir / "loss.png")

    adapter_dir, merged_dir = run_dir / "adapter", run_dir / "merged"
    save_adapter(model, adapter_dir, base_model_name_or_path=str(base_dir), overwrite=True)
    probe = _arithmetic_batch(random.Random(12345), tokenizer, 4).clamp(min=0)
    with torch.no_grad():
        policy = model(probe).logits
        with adapter_disabled(model):
            reference = model(probe).logits
        peft_logits = peft.PeftModel.from_pretrained(load_model(base_dir), adapter_dir)(probe).logits
        shutil.rmtree(merged_dir, ignore_errors=True)
        export_merged(base_dir, adapter_dir, merged_dir)
        merged_logits = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)(probe).logits
        base_logits = load_model(base_dir)(probe).logits

    with console.status("starting vLLM and syncing the adapter, then the merged weights (~1 min)"):
        served = asyncio.run(_serve_and_sync(config, model, run_dir, TRAIN_STEPS))

    result = {
        "train_steps": TRAIN_STEPS,
        "loss_first": losses[0],
        "loss_last": sum(losses[-5:]) / 5,
        "adapter_is_peft": is_peft_adapter(adapter_dir),
        "peft_reload_logits_equal": bool(torch.equal(peft_logits, policy)),
        "merged_vs_adapter_max_abs_diff": (merged_logits - policy).abs().max().item(),
        "reference_equals_base": bool(torch.equal(reference, base_logits)),
        **served,
        "seconds": time.perf_counter() - start,
    }
    (run_dir / "quickstart.json").write_text(json.dumps(result, indent=2) + "\n")

    table = Table(title="graft quickstart (foundation)")
    table.add_column("check")
    table.add_column("measured")
    table.add_row("adapter loss, first step -> mean of last 5", f"{result['loss_first']:.3f} -> {result['loss_last']:.3f}")
    table.add_row("adapter reloaded by PEFT: logits identical", str(result["peft_reload_logits_equal"]))
    table.add_row("merged export vs base+adapter: max |Δlogit|", f"{result['merged_vs_adapter_max_abs_diff']:.2e}")
    table.add_row("adapter disabled == base model (reference policy)", str(result["reference_equals_base"]))
    for mode in ("adapter", "merged"):
        m = served[f"{mode}_sync"]
        table.add_row(f"vLLM {mode} sync: seconds, bytes, max |Δlogprob| vs trainer",
                      f"{m['sync_seconds']:.3f} s, {m['sync_bytes'] / 2**20:.2f} MiB, {m['logprob_abs_diff_max']:.1e}")
    table.add_row("vLLM served the adapter as", ", ".join(served["engine_adapters"]))
    console.print(table)
    console.print(f"adapter: {adapter_dir}\nmerged model: {merged_dir}\nloss plot: {run_dir / 'loss.png'}\n"
                  f"results: {run_dir / 'quickstart.json'} ({result['seconds']:.0f} s)")
    console.print("[yellow]Not yet built: the GRPO loop; this run covers the foundation (model, LoRA, adapter "
                  "I/O, merge, export) and weight sync into a real vLLM server.[/yellow]")
    return result
