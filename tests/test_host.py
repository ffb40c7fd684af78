"""How the trainer uses a CPU host (`graft.host`): "returned" hands freed activations
back to the OS, "cached" keeps an update's blocks for reuse without page faults (each such case runs
in a fresh process: glibc's settings are process-wide); an overlapped run leaves a core to a local
vLLM."""

import os
import subprocess
import sys

import pytest
import torch

from graft import host
from graft.config import load_config

_FRAGMENT = """
import resource, sys, torch
from graft.host import return_freed_memory_to_the_os
if sys.argv[1] == "fixed":
    assert return_freed_memory_to_the_os()
big = torch.ones(5 * 2**20)  # 20 MiB, freed: glibc raises its mmap threshold to 20 MiB
del big
blocks = [torch.ones(2 * 2**20) for _ in range(64)]  # 64 x 8 MiB, as one backward's activations
keep = blocks[-1]  # the newest stays alive, so a heap arena could not shrink below it
del blocks
rss_kib = int(open("/proc/self/statm").read().split()[1]) * 4
print(rss_kib // 1024)
"""


def _resident_mib_after_frees(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", _FRAGMENT, mode], capture_output=True, text=True, check=True)
    return int(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_activations_leave_the_process_with_the_fixed_threshold():
    dynamic, fixed = _resident_mib_after_frees("dynamic"), _resident_mib_after_frees("fixed")
    assert dynamic - fixed > 400  # the 63 freed 8 MiB blocks (504 MiB) stay resident only without the fix


def test_an_overlapped_run_leaves_a_core_to_local_vllm_and_gives_it_back(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    before = torch.get_num_threads()
    overlapped = load_config(None, ["rollout.max_staleness=1"])
    with host.leave_a_core_to_local_vllm(overlapped):
        assert torch.get_num_threads() == 3 or torch.cuda.is_available()
    assert torch.get_num_threads() == before
    with host.leave_a_core_to_local_vllm(load_config(None, [])):  # on-policy: the two take turns
        assert torch.get_num_threads() == before



def test_a_read_beside_vllm_takes_one_thread_fewer_and_gives_it_back():
    before = torch.get_num_threads()
    try:
        for threads, inside in ((3, 2), (1, 1)):
            torch.set_num_threads(threads)
            with pytest.raises(KeyError):  # however the body ends
                with host.one_thread_fewer():
                    assert torch.get_num_threads() == inside
                    raise KeyError
            assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)

_REUSE = """
import resource, sys, torch
from graft.config import load_config
from graft.host import set_up_host_memory, update_memory_cached
train = load_config(None, [f"train.host_memory={sys.argv[1]}"]).train
set_up_host_memory(train)


def update():  # as an update's activations: 64 MiB blocks made, used and freed, over and over
    for _ in range(8):
        blocks = [torch.ones(2**24) for _ in range(4)]
        del blocks


def faults_and_rss_mib(body):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    with update_memory_cached(sys.argv[1]):
        body()
    rss_mib = int(open("/proc/self/statm").read().split()[1]) * 4096 // 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, rss_mib


first, second, third = (faults_and_rss_mib(update) for _ in range(3))
from graft.host import release_cached_memory
release_cached_memory()
released_mib = int(open("/proc/self/statm").read().split()[1]) * 4096 // 2**20
print(first[0], second[0], third[0], second[1], third[1], released_mib)
"""


def _faults_of_three_updates(mode: str) -> list[int]:
    env = host.heap_friendly_environment(os.environ)  # as the `graft` command's process
    done = subprocess.run([sys.executable, "-c", _REUSE, mode], capture_output=True, text=True, check=True, env=env)
    return [int(v) for v in done.stdout.split()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_cached_updates_reuse_their_blocks_without_page_faults_until_the_run_gives_them_back():
    cached_first, cached_second, _, rss_second, rss_third, rss_released = _faults_of_three_updates("cached")
    returned_first, returned_second, *_ = _faults_of_three_updates("returned")
    touched_pages = 8 * 4 * 2**26 // 4096  # every block's pages, once per reuse
    assert returned_first > touched_pages // 2 and returned_second > touched_pages // 2  # faulted in at each reuse
    assert cached_first < touched_pages // 4  # the first 4 blocks are faulted in, their reuses are not
    assert cached_second < 1000  # the next update finds them resident
    assert rss_third == rss_second  # and holds no more than its first did
    assert rss_released < rss_third - 200  # until the run ends and gives the blocks (256 MiB) back


def test_host_memory_auto_caches_on_the_cpu_only():
    auto = load_config(None, []).train
    assert host.host_memory_mode(auto.host_memory, torch.device("cpu")) == "cached"
    assert host.host_memory_mode(auto.host_memory, torch.device("cuda")) == "glibc"
    returned = load_config(None, ["train.host_memory=returned"]).train
    assert host.host_memory_mode(returned.host_memory, torch.device("cpu")) == "returned"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's tunables")
def test_the_graft_command_starts_itself_once_more_with_glibcs_tcache_off():
    code = ("import os, sys\n"
            "print('started', os.environ.get('GLIBC_TUNABLES'), flush=True)\n"
            "sys.argv = ['graft', '--version']\n"
            "from graft.cli import entry\n"
            "entry()\n")
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    starts = [line for line in done.stdout.splitlines() if line.startswith("started")]
    assert starts == ["started None", f"started {host.TCACHE_OFF}"]  # once again, then it runs
    assert "graft" in done.stdout.splitlines()[-1]
    chosen = {**env, "GLIBC_TUNABLES": "glibc.malloc.tcache_count=7"}  # a user's own choice is kept
    assert host.heap_friendly_environment(chosen) is None
