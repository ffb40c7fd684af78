"""Several vLLM-CPU servers on one host, each generating on its own cores (`split_cores`,
`VllmServerConfig.cpu_cores`): vLLM's automatic binding puts every server's worker on the same ones.
Two real servers' workers on their shares: tests/bench/test_placement_bench.py."""

import pytest

from graft.rollout.vllm.launcher import VllmServer, VllmServerConfig, split_cores


@pytest.mark.parametrize("servers, cores, shares", [
    (1, [0, 1], [(0, 1)]),
    (2, [1, 0], [(0,), (1,)]),
    (3, range(8), [(0, 1, 2), (3, 4, 5), (6, 7)]),
    (2, [4, 6, 9], [(4, 6), (9,)]),  # the cores this process may use, not 0..n-1
    (3, [0, 1], [(0,), (1,), (0,)]),  # fewer cores than servers: one each in turn
])
def test_each_server_gets_its_own_share_of_the_hosts_cores(servers, cores, shares):
    assert split_cores(servers, cores) == shares


def test_a_servers_cores_reach_vllm_cpu_as_its_binding(monkeypatch):
    monkeypatch.setattr("graft.rollout.vllm.launcher._has_cuda", lambda: False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert VllmServer(VllmServerConfig(model="m", port=1, cpu_cores=(2, 3))).environment()[
        "VLLM_CPU_OMP_THREADS_BIND"] == "2,3"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in VllmServer(VllmServerConfig(model="m", port=1)).environment()
