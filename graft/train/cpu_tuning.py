"""How the trainer uses a CPU host: how many cores it takes beside a local vLLM, and whether freed
activations go back to the OS.

glibc's malloc serves a block of at least the mmap threshold with its own mapping, returned to the
OS on free; smaller blocks come from heap arenas, which keep freed memory resident for reuse. The
threshold is dynamic: each freed mapped block raises it to that block's size, up to 32 MiB, so
after the first backward most of an update's activations (a few MiB to 32 MiB each) land in the
arenas, and the arenas' fragments stay resident. Measured with `graft bench memory --layers 24`
(8 sequences, 4,096 tokens, activation checkpointing): 5.75 GiB above the model with the dynamic
threshold, 0.75 GiB with a fixed 128 KiB one (`MALLOC_MMAP_THRESHOLD_=131072`, what this sets);
285 s vs 321 s for the update, both measured while other work shared the two cores (page faults of
fresh mappings cost some time; the memory is what decides whether a step fits here at all).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import sys

import torch

from graft.config import GraftConfig, is_loopback_url
from graft.models.loading import checkpoint_parameters, resolve_model_path

_M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h); setting it also turns the dynamic threshold off
MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's initial value, kept fixed


def return_freed_memory_to_the_os(threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold for this process (module docstring); whether it was set.

    A no-op (False) where the C library is not glibc (macOS, musl): nothing else here depends on it.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold_bytes))
    except (OSError, AttributeError):
        return False


# train.return_freed_memory "auto": from this model size on, memory matters more than page faults.
AUTO_RETURN_MEMORY_PARAMETERS = 100_000_000


def returns_freed_memory(config: GraftConfig) -> bool:
    """Whether this run fixes the mmap threshold (`train.return_freed_memory`; see its description)."""
    setting = config.train.return_freed_memory
    if setting != "auto":
        return setting
    return checkpoint_parameters(resolve_model_path(config.model.path)) >= AUTO_RETURN_MEMORY_PARAMETERS


@contextlib.contextmanager
def leave_a_core_to_local_vllm(config: GraftConfig):
    """vLLM-CPU generates on one core; when generation overlaps training (max_staleness > 0), a
    trainer whose BLAS threads compete for that core slows both down (measured on 2 cores: ~1.5 s per
    quickstart step with one trainer thread, more with two). On-policy, the two take turns. The
    thread count is restored when the run ends: a process that trains again (a bench running an
    on-policy run after an overlapped one) gets its cores back."""
    rollout, threads = config.rollout, torch.get_num_threads()
    local_vllm = rollout.engine == "vllm" and all(is_loopback_url(url) for url in rollout.urls)
    if local_vllm and rollout.max_staleness > 0 and not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    try:
        yield
    finally:
        torch.set_num_threads(threads)
