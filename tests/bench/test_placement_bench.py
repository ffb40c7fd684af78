"""`graft bench placement` on the test model: two servers, each generating on its own cores (the split
`graft tenants serve --engines 2` makes), every layout publishes and samples, and each layout's versions
go where it keeps them."""

import asyncio
import contextlib
import os

import pytest
import torch

from graft.bench.placement import LAYOUTS, _Layout, measure_placement
from graft.bench.rollout import mixed_adapters
from graft.rollout.engine import GenerateRequest, SamplingParams
from graft.rollout.pool import EnginePool
from graft.rollout.vllm.client import VllmClient
from graft.rollout.vllm.launcher import VllmServer, VllmServerConfig, split_cores
from tests.helpers import group_process_names


class _Server:
    """What a layout calls on a server, recorded."""

    def __init__(self) -> None:
        self.loaded: list[str] = []

    async def load_adapter(self, name: str, path: str) -> None:
        self.loaded.append(name)

    async def unload_adapter(self, name: str) -> None:
        self.loaded.remove(name)


def test_each_layout_loads_a_tenants_versions_where_it_keeps_them():
    servers = [_Server(), _Server()]
    layouts = {name: _Layout(name, servers, EnginePool(servers)) for name in LAYOUTS}

    async def publish_twice():
        for layout in layouts.values():
            for version in (1, 2):
                for tenant in range(3):
                    await layout.publish(tenant, f"{layout.name}-t{tenant}-v{version}", "adapter")

    asyncio.run(publish_twice())
    on = [sorted(server.loaded) for server in servers]  # the previous versions unloaded
    assert on[0] == ["everywhere-t0-v2", "everywhere-t1-v2", "everywhere-t2-v2", "one-t0-v2", "one-t1-v2",
                     "one-t2-v2", "placed-t0-v2", "placed-t2-v2"]
    assert on[1] == ["everywhere-t0-v2", "everywhere-t1-v2", "everywhere-t2-v2", "placed-t1-v2"]


@pytest.mark.vllm
def test_the_bench_measures_every_layout_on_two_servers_generating_on_their_own_cores(base_dir, tmp_path):
    shares = split_cores(2, os.sched_getaffinity(0))
    adapters = mixed_adapters(base_dir, tmp_path, 8, 2, torch.float32)
    requests = [GenerateRequest((5, 6, 7, 8), SamplingParams(n=2, max_new_tokens=4, seed=0, ignore_eos=True))] * 2
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(VllmServer(VllmServerConfig(model=str(base_dir), dtype="float32",
                                                                   max_lora_rank=8, max_loras=7, log_dir=tmp_path,
                                                                   cpu_cores=cores))) for cores in shares]
        workers = [[pid for pid, name in group_process_names(server.pid).items() if name.startswith("VLLM::Worker")]
                   for server in servers]
        assert [len(pids) for pids in workers] == [1, 1]
        # vLLM's own binding put both on core 0 here
        assert [os.sched_getaffinity(pids[0]) for pids in workers] == [set(cores) for cores in shares]
        measured = asyncio.run(measure_placement([server.url for server in servers], adapters, requests, repeats=1))
        left = [asyncio.run(_adapters_on(server.url)) for server in servers]
    for layout in LAYOUTS:  # 2 tenants x 1 round of publishes; one round of each sampling
        assert len(measured[layout]["publish_s"]) == 2 and all(s > 0 for s in measured[layout]["publish_s"])
        assert len(measured[layout]["all"]) == len(measured[layout]["alone"]) == 1
        assert measured[layout]["all"][0] > 0 and measured[layout]["alone"][0] > 0
    assert left == [[], []]  # the servers end as found


async def _adapters_on(url: str) -> list[str]:
    async with VllmClient(url) as client:
        return await client.list_adapters()
