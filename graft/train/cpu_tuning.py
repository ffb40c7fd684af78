"""The CPU allocator's side of the trainer's memory: freed activations go back to the OS.

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

import ctypes
import ctypes.util
import sys

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
