"""How the trainer uses a CPU host (`graft.train.cpu_tuning`): glibc's dynamic mmap threshold keeps
freed activations resident and the trainer fixes it (each such case runs in a fresh process: the
setting is process-wide); an overlapped run leaves a core to a local vLLM."""

import os
import subprocess
import sys

import pytest
import torch

from graft.config import load_config
from graft.train import cpu_tuning

_FRAGMENT = """
import resource, sys, torch
from graft.train.cpu_tuning import return_freed_memory_to_the_os
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
    with cpu_tuning.leave_a_core_to_local_vllm(overlapped):
        assert torch.get_num_threads() == 3 or torch.cuda.is_available()
    assert torch.get_num_threads() == before
    with cpu_tuning.leave_a_core_to_local_vllm(load_config(None, [])):  # on-policy: the two take turns
        assert torch.get_num_threads() == before


def test_only_a_large_model_fixes_the_mmap_threshold_unless_told(tmp_path, monkeypatch):
    def fixes(parameters, *overrides):
        monkeypatch.setattr(cpu_tuning, "checkpoint_parameters", lambda path: parameters)
        return cpu_tuning.returns_freed_memory(load_config(None, [f"model.path={tmp_path}", *overrides]))

    assert fixes(cpu_tuning.AUTO_RETURN_MEMORY_PARAMETERS) and not fixes(cpu_tuning.AUTO_RETURN_MEMORY_PARAMETERS - 1)
    assert fixes(1, "train.return_freed_memory=true") and not fixes(10**9, "train.return_freed_memory=false")
