"""`graft bench placement`: where a Tinker service sampling from several vLLM servers keeps its
tenants' adapter versions. Every tenant's versions on every server (graft's `EnginePool`, what
`graft tenants serve --engines N` and repeated `--engine-url` do), or each tenant placed on one
server (its versions loaded there alone, its samples sent there).

Two servers of one random bf16 Qwen2 on this host, each generating on its own cores (`split_cores`),
and `--tenants` random adapters. Per layout, interleaved in each round, medians over rounds:
- publish: seconds to load one tenant's new version where the layout keeps it (both servers at once,
  or its own), as every training step's publish does;
- all tenants sampling at once: generated tokens/s over all tenants;
- one tenant sampling while the others wait (a client between steps, the common case at a few
  clients): its tokens/s. Everywhere, the pool spreads its requests over both servers; placed, one
  server serves it and the other idles.
A third layout, every tenant on the first server, shows what the second server adds on this host.

Placement would hold `servers x max_loras` versions instead of `max_loras`; it is the layout that
matters when tenants outnumber one server's adapter slots.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from graft.bench.rollout import generated_tokens, mixed_adapters
from graft.config.arguments import COUNT
from graft.models.tiny import build_tiny_model
from graft.rollout.engine import GenerateRequest, RolloutEngine, SamplingParams
from graft.rollout.pool import EnginePool
from graft.rollout.vllm.client import VllmClient
from graft.rollout.vllm.launcher import VllmServer, VllmServerConfig, split_cores

LAYOUTS = {"everywhere": "every tenant's versions on every server (graft)", "placed": "each tenant on one server",
           "one": "every tenant on the first server, the second idle (reference)"}
SERVERS = 2


class _Layout:
    """One layout's engines: where tenant t's versions load and its samples go."""

    def __init__(self, name: str, servers: list[VllmClient], pool: EnginePool) -> None:
        self.name, self.servers, self.pool = name, servers, pool
        self.served: dict[int, str] = {}  # tenant -> the version name it serves now

    def engine(self, tenant: int) -> RolloutEngine:
        if self.name == "everywhere":
            return self.pool
        return self.servers[tenant % len(self.servers) if self.name == "placed" else 0]

    async def publish(self, tenant: int, name: str, path: Path) -> float:
        """Seconds to load `name` where this layout keeps the tenant's versions; its previous one
        unloaded after (not timed: graft retires a version once the new one serves)."""
        start = time.perf_counter()
        await self.engine(tenant).load_adapter(name, str(path))
        seconds = time.perf_counter() - start
        if tenant in self.served:
            await self.engine(tenant).unload_adapter(self.served[tenant])
        self.served[tenant] = name
        return seconds

    async def tokens_per_s(self, tenants: list[int], requests: list[GenerateRequest]) -> float:
        """Generated tokens/s of `requests` from each of `tenants` at once, each on its version."""
        start = time.perf_counter()
        answers = await asyncio.gather(*(self.engine(t).generate(requests, adapter=self.served[t]) for t in tenants))
        return generated_tokens(answers) / (time.perf_counter() - start)

    async def unload_all(self) -> None:
        for tenant, name in self.served.items():
            await self.engine(tenant).unload_adapter(name)
        self.served.clear()


async def measure_placement(urls: list[str], adapters: list[Path], requests: list[GenerateRequest],
                            repeats: int) -> dict[str, dict[str, list[float]]]:
    """Per layout: publish seconds (one per tenant and round), tokens/s of all tenants at once and of
    tenant 0 alone (one per round); round 0 warms up, not counted. The servers end as found."""
    measured = {layout: {"publish_s": [], "all": [], "alone": []} for layout in LAYOUTS}
    async with contextlib.AsyncExitStack() as stack:
        servers = [await stack.enter_async_context(VllmClient(url)) for url in urls]
        layouts = [_Layout(name, servers, EnginePool(servers)) for name in LAYOUTS]
        tenants = list(range(len(adapters)))
        with Progress(transient=True) as progress:
            task = progress.add_task("placement rounds", total=repeats + 1)
            for round_index in range(repeats + 1):
                for layout in layouts:
                    seconds = [await layout.publish(t, f"{layout.name}-t{t}-v{round_index}", adapters[t])
                               for t in tenants]
                    rates = {"all": await layout.tokens_per_s(tenants, requests),
                             "alone": await layout.tokens_per_s([0], requests)}
                    if round_index:
                        measured[layout.name]["publish_s"] += seconds
                        for key, rate in rates.items():
                            measured[layout.name][key].append(rate)
                progress.advance(task)
        for layout in layouts:
            await layout.unload_all()
    return measured


def run_placement_bench(tenants: int = 4, hidden: int = 256, layers: int = 4, rank: int = 8, prompts: int = 8,
                        samples: int = 4, max_new_tokens: int = 64, repeats: int = 10) -> dict:
    """The layouts on two servers of a random Qwen2 (module docstring); medians."""
    shares = split_cores(SERVERS, os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="graft-bench-placement-") as tmp:
        base = build_tiny_model(Path(tmp) / "base", arch="qwen2", hidden=hidden, layers=layers, seed=0)
        adapters = mixed_adapters(base, Path(tmp), rank, tenants, torch.bfloat16)
        params = SamplingParams(n=samples, temperature=1.0, max_new_tokens=max_new_tokens, seed=0, ignore_eos=True)
        requests = [GenerateRequest(tuple(range(3 + i, 3 + i + 16)), params) for i in range(prompts)]
        # The layouts' versions side by side (each tenant's in 3 layouts, the first server holding them
        # all), plus one loading.
        config = VllmServerConfig(model=str(base), dtype="bfloat16", max_lora_rank=max(8, rank),
                                  max_loras=3 * tenants + 1, log_dir=tmp)
        with contextlib.ExitStack() as stack:
            with Console(stderr=True).status(f"starting {SERVERS} vLLM servers on cores {shares}"):
                urls = [stack.enter_context(VllmServer(replace(config, cpu_cores=cores))).url for cores in shares]
            measured = asyncio.run(measure_placement(urls, adapters, requests, repeats))
    result = {"model": f"qwen2 hidden={hidden} layers={layers} bf16", "layouts": LAYOUTS, "lora_rank": rank,
              "tenants": tenants, "servers": SERVERS, "server_cores": [list(cores) for cores in shares],
              "prompts": prompts, "samples": samples, "max_new_tokens": max_new_tokens, "repeats": repeats}
    for layout, values in measured.items():
        result[f"{layout}_publish_s"] = statistics.median(values["publish_s"])
        result[f"{layout}_all_tokens_per_s"] = statistics.median(values["all"])
        result[f"{layout}_alone_tokens_per_s"] = statistics.median(values["alone"])
    for key in ("publish_s", "all_tokens_per_s", "alone_tokens_per_s"):
        result[f"everywhere_over_placed_{key}"] = result[f"everywhere_{key}"] / result[f"placed_{key}"]
    result["two_servers_over_one_all_tokens_per_s"] = result["placed_all_tokens_per_s"] / result["one_all_tokens_per_s"]
    return result


def print_placement_report(result: dict) -> None:
    table = Table(title=f"placement: {result['tenants']} tenants on {result['servers']} vLLM servers (cores "
                        f"{result['server_cores']}), {result['model']}, {result['prompts']} prompts x "
                        f"{result['samples']} samples x {result['max_new_tokens']} tokens a tenant")
    for column in ("layout", "publish s (median)", "all tenants sampling: tokens/s", "one tenant alone: tokens/s"):
        table.add_column(column)
    for layout, label in LAYOUTS.items():
        table.add_row(label, f"{result[f'{layout}_publish_s']:.3f}", f"{result[f'{layout}_all_tokens_per_s']:.0f}",
                      f"{result[f'{layout}_alone_tokens_per_s']:.0f}")
    Console().print(table)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`graft bench placement`'s flags: tenants, model shape, rounds."""
    parser.add_argument("--tenants", type=COUNT, default=4, help="tenants, each its own adapter (default %(default)s)")
    parser.add_argument("--hidden", type=COUNT, default=256, help="model hidden size (default %(default)s)")
    parser.add_argument("--layers", type=COUNT, default=4, help="decoder layers (default %(default)s)")
    parser.add_argument("--repeats", type=COUNT, default=10,  # 5 rounds: ratios moved by 0.2 between runs here
                        help="rounds, medians reported (default %(default)s)")


def run(args: argparse.Namespace) -> dict:
    """`graft bench placement`: measure, print the table, return what --json writes."""
    result = run_placement_bench(tenants=args.tenants, hidden=args.hidden, layers=args.layers, repeats=args.repeats)
    print_placement_report(result)
    return result
