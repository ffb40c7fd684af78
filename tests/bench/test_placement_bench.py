"""`graft bench placement` on a small model: two servers on their own cores, every layout publishes
and samples, and each layout's versions go where it keeps them."""

import asyncio
import os

import pytest

from graft.bench.placement import LAYOUTS, _Layout, run_placement_bench
from graft.rollout.pool import EnginePool
from graft.rollout.vllm.launcher import split_cores


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
def test_the_bench_measures_every_layout_on_two_servers_of_their_own_cores():
    result = run_placement_bench(tenants=2, hidden=64, layers=1, prompts=2, samples=2, max_new_tokens=4, repeats=1)
    assert result["server_cores"] == [list(cores) for cores in split_cores(2, os.sched_getaffinity(0))]
    for layout in LAYOUTS:
        assert result[f"{layout}_publish_s"] > 0
        assert result[f"{layout}_all_tokens_per_s"] > 0 and result[f"{layout}_alone_tokens_per_s"] > 0
    assert result["everywhere_over_placed_all_tokens_per_s"] == pytest.approx(
        result["everywhere_all_tokens_per_s"] / result["placed_all_tokens_per_s"])
