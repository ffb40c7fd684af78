"""`graft bench soak`: many adapter-sync cycles against one real vLLM server under concurrent
generation — the failure the field knows from servers that hung after tens of steps because
versions were never unloaded.

Each cycle publishes a new LoRA version, loads it as `soak-v<N>`, retires versions outside the
window (never one a running request uses); meanwhile `concurrency` workers keep sending requests,
each for the newest version. Reported: cycles, failed requests (must be 0), the most graft
adapters the server ever listed (must stay <= max_loras = keep_versions + 1: a retired version
stays loaded until its last request ends), and the server's resident memory
(all processes of its group) at the start, the middle and the end — flat over the second half
means no leak per cycle.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from graft.config.arguments import COUNT
from graft.lora.attach import attach_lora, lora_parameters
from graft.models.loading import load_model
from graft.models.tiny import build_tiny_model
from graft.rollout.engine import EngineError, GenerateRequest, SamplingParams
from graft.rollout.process_group import group_rss_bytes
from graft.rollout.vllm.client import VllmClient
from graft.rollout.vllm.launcher import VllmServer, VllmServerConfig
from graft.sync.adapter import AdapterSync, adapter_version
from graft.sync.inflight import InFlightVersions
from graft.sync.publish import WeightPublisher

LORA_NAME = "soak"


async def _generate_until(stop: asyncio.Event, client: VllmClient, sync: AdapterSync, inflight: InFlightVersions,
                          counts: dict[str, int]) -> None:
    """One worker: requests for the newest version until `stop`; counts answers and failures."""
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8)
    while not stop.is_set():
        version = sync.current_version  # read and enter without an await between (see sync.inflight)
        if version is None:
            await asyncio.sleep(0.01)
            continue
        async with inflight.use(version):
            try:
                request = GenerateRequest((5, 17, 200, 33), params)
                await client.generate([request], adapter=sync.request_adapter(version))
                counts["ok"] += 1
            except EngineError as error:
                counts["failed"] += 1
                counts.setdefault("first_error", str(error))


async def _soak(client: VllmClient, pgid: int, base: Path, work: Path, cycles: int, keep: int,
                concurrency: int, progress: Progress) -> dict:
    model = attach_lora(load_model(base), rank=8, alpha=16, seed=0)
    inflight = InFlightVersions()
    sync = AdapterSync(client, WeightPublisher(work / "weights", keep_versions=keep + 1), lora_name=LORA_NAME,
                       keep_versions=keep, max_loras=keep + 1, inflight=inflight)
    counts, stop, rss, most_loaded = {"ok": 0, "failed": 0}, asyncio.Event(), {}, 0
    workers = [asyncio.create_task(_generate_until(stop, client, sync, inflight, counts)) for _ in range(concurrency)]
    task = progress.add_task("soak", total=cycles)
    start = time.perf_counter()
    try:
        for version in range(1, cycles + 1):
            with torch.no_grad():
                for param in lora_parameters(model).values():
                    param.add_(torch.randn_like(param) * 1e-3)
            await sync.sync(model, version, step=version)
            loaded = [n for n in await client.list_adapters() if adapter_version(LORA_NAME, n) is not None]
            most_loaded = max(most_loaded, len(loaded))
            if version in (1, cycles // 2, cycles):
                rss[version] = group_rss_bytes(pgid)
            progress.update(task, advance=1)
    finally:
        stop.set()
        await asyncio.gather(*workers)
        await sync.close()
    first, middle, last = (rss[v] for v in sorted(rss))
    return {"cycles": cycles, "seconds": time.perf_counter() - start, "keep_versions": keep, "max_loras": keep + 1,
            "concurrency": concurrency, "requests_ok": counts["ok"], "requests_failed": counts["failed"],
            "first_error": counts.get("first_error"), "max_adapters_loaded": most_loaded,
            "unload_failures": sync.unload_failures, "left_loaded": await client.list_adapters(),
            "server_rss_mib": {"first": first / 2**20, "middle": middle / 2**20, "last": last / 2**20},
            "rss_growth_second_half_mib": (last - middle) / 2**20}


def run_soak_bench(cycles: int = 1000, keep: int = 2, concurrency: int = 8) -> dict:
    """Start a vLLM server on a tiny model and soak it with `cycles` adapter syncs."""
    with tempfile.TemporaryDirectory(prefix="graft-soak-") as tmp:
        work = Path(tmp)
        base = build_tiny_model(work / "base", hidden=64, layers=2, seed=0)
        config = VllmServerConfig(model=str(base), dtype="float32", max_lora_rank=8, max_loras=keep + 1,
                                  log_dir=work / "logs")
        with VllmServer(config) as server, Progress() as progress:
            async def main() -> dict:
                async with VllmClient(server.url) as client:
                    return await _soak(client, server.pid, base, work, cycles, keep, concurrency, progress)
            return asyncio.run(main())


def print_soak_report(result: dict) -> None:
    table = Table(title=f"graft bench soak: {result['cycles']} adapter syncs under {result['concurrency']} "
                        "concurrent request streams")
    table.add_column("measured")
    table.add_column("value", justify="right")
    rss = result["server_rss_mib"]
    for label, value in [
        ("requests answered / failed", f"{result['requests_ok']} / {result['requests_failed']}"),
        ("graft adapters on the server at most (keep_versions, max_loras)",
         f"{result['max_adapters_loaded']} ({result['keep_versions']}, {result['max_loras']})"),
        ("unload failures", str(result["unload_failures"])),
        ("server RSS first / middle / last (MiB)", f"{rss['first']:.0f} / {rss['middle']:.0f} / {rss['last']:.0f}"),
        ("RSS growth over the second half (MiB)", f"{result['rss_growth_second_half_mib']:+.1f}"),
        ("seconds", f"{result['seconds']:.0f}"),
    ]:
        table.add_row(label, value)
    Console().print(table)
    if result["first_error"]:
        Console().print(f"first failed request: {result['first_error']}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`graft bench soak`'s flags: how many syncs, under how many request streams."""
    parser.add_argument("--cycles", type=COUNT, default=1000, help="adapter syncs (default %(default)s)")
    parser.add_argument("--concurrency", type=COUNT, default=8, help="concurrent request streams (default %(default)s)")


def run(args: argparse.Namespace) -> dict:
    """`graft bench soak`: measure, print the table, return what --json writes."""
    result = run_soak_bench(cycles=args.cycles, concurrency=args.concurrency)
    print_soak_report(result)
    return result
