"""glibc's dynamic mmap threshold keeps freed activations resident; the trainer fixes it
(`graft.train.allocator`). Each case runs in a fresh process: the setting is process-wide."""

import subprocess
import sys

import pytest

_FRAGMENT = """
import resource, sys, torch
from graft.train.allocator import return_freed_memory_to_the_os
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
