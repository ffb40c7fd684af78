"""graft's LoRA kernel for vLLM-CPU (lora_kernel.c): a layer's LoRA add for every token through its own
adapter in one call, in bf16 (AVX-512 BF16) and fp32 (AVX-512F); used by graft's `add_lora_linear`
(lora_cpu_linear) where the worker runs one thread.

Why a kernel: with several adapters in a step, the torch path gathers each adapter's tokens, pads
them to the largest group, runs two batched products and gathers back; on one thread at a hidden-256
q/k/v (64 tokens, 8 adapters, r=8, bf16) that is ~100 us a layer against ~40 us for one adapter
through oneDNN. The kernel takes each token's two products from its own slot's weights and adds
into the layer's output in one pass: 26 us there, whether 1 or 8 adapters (bf16's dot-product
instruction takes 32 multiply-adds at once), and in fp32 1.5-2x faster than the torch path with 8
adapters, about as fast with one (measured on this project's 2-core EPYC, one thread; the table in
docs/rollout-profile.md). It is one thread: with more, torch's paths split the work over them and
are kept.

Built once per host with the system C compiler (`$CC`, else cc) and `-march=native`, cached under
`$GRAFT_CACHE/kernels` by a hash of the source, the compiler command and the CPU's flags, and loaded
with ctypes (no torch extension: nothing to rebuild when torch changes). Where it cannot be built (no
compiler, no AVX-512) graft's torch path runs and the server's log says why, once.

Shape suffixes: see graft/__init__.py (``N`` tokens, ``S`` adapter slots, ``I``/``O`` features, ``R``
the rank times the layer's slices, ``P`` rank pairs).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import logging
import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from graft.models.cache import default_cache_dir

SOURCE = Path(__file__).with_name("lora_kernel.c")
FLAGS = ["-O3", "-march=native", "-shared", "-fPIC"]
_POINTER, _INT = ctypes.c_void_p, ctypes.c_int64
_ARGUMENTS = [_POINTER, _INT, _POINTER, _INT, _POINTER, _POINTER, _POINTER, _POINTER, _INT, _INT, _INT, _INT,
              _POINTER, ctypes.c_float]
_FUNCTIONS = {torch.bfloat16: "graft_lora_add_bf16", torch.float32: "graft_lora_add_f32"}
log = logging.getLogger(__name__)


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernel's library, built on first use in this host's cache; None where it cannot be built
    (logged once with the compiler's message)."""
    compiler = os.environ.get("CC", "cc")
    try:
        digest = hashlib.sha256(SOURCE.read_bytes() + " ".join([compiler, *FLAGS]).encode() + _cpu_flags())
        library = default_cache_dir() / "kernels" / f"lora_kernel-{digest.hexdigest()[:16]}.so"
        error = None if library.exists() else _build(compiler, library)
        if error is None:
            return ctypes.CDLL(str(library))
    except OSError as exc:  # the source missing from an install, a library that does not load
        error = str(exc)
    log.warning("graft: LoRA kernel not built (%s); LoRA layers take torch's path", error)
    return None


@functools.cache
def function(dtype: torch.dtype) -> Callable | None:
    """The kernel's C function for `dtype` (bf16: needs AVX-512 BF16, fp32: AVX-512F); None where this
    host's build has none."""
    library = load()
    name = _FUNCTIONS.get(dtype)
    if library is None or name is None or not hasattr(library, name):
        return None
    kernel = getattr(library, name)
    kernel.argtypes, kernel.restype = _ARGUMENTS, None
    return kernel


def _build(compiler: str, library: Path) -> str | None:
    """Compile the source into `library` (written whole, then renamed: a concurrent start never loads
    half a file); the reason on failure (a cache it cannot write included)."""
    try:
        library.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
            built = Path(scratch) / library.name
            done = subprocess.run([compiler, *FLAGS, "-o", str(built), str(SOURCE)], capture_output=True,
                                  text=True, timeout=120)
            if done.returncode != 0:
                lines = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines()
                return lines[0].strip() if lines else f"{compiler} exited {done.returncode}"
            os.replace(built, library)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{compiler}: {exc}"
    return None


def _cpu_flags() -> bytes:
    """The host's CPU flags line (what -march=native compiles for), so another CPU gets its own build."""
    try:
        with open("/proc/cpuinfo", "rb") as info:
            return next((line for line in info if line.startswith((b"flags", b"Features"))), b"")
    except OSError:
        return b""


def usable(x_NI: torch.Tensor, y_NO: torch.Tensor, rank: int) -> bool:
    """The kernel takes this call: rows of unit stride in one dtype it has, one thread, in bf16 an even
    rank (its pair layout)."""
    return (x_NI.dtype == y_NO.dtype and x_NI.stride(1) == y_NO.stride(1) == 1
            and (rank % 2 == 0 or x_NI.dtype != torch.bfloat16) and torch.get_num_threads() == 1
            and function(x_NI.dtype) is not None)


def expand_weights(b_SOR: torch.Tensor) -> torch.Tensor:
    """B as the kernel reads it, built once per adapter load (cached on `b_SOR`, which graft rebuilds on
    a load): bf16 in pairs, [S, R/2, O, 2] (element [s, p, o, k] = B[s][o, 2p + k]); fp32 transposed,
    [S, R, O]."""
    expand = getattr(b_SOR, "_graft_expand", None)
    if expand is None:
        slots, outputs, ranks = b_SOR.shape
        if b_SOR.dtype == torch.bfloat16:
            expand = b_SOR.view(slots, outputs, ranks // 2, 2).permute(0, 2, 1, 3).contiguous()
        else:
            expand = b_SOR.transpose(1, 2).contiguous()
        b_SOR._graft_expand = expand
    return expand


def add(y_NO: torch.Tensor, x_NI: torch.Tensor, a_SRI: torch.Tensor, b_SOR: torch.Tensor, rows_N: torch.Tensor,
        slots_N: torch.Tensor, output_slices: tuple[int, ...], scale: float) -> None:
    """y_NO[n] += B[s] @ (scale * A[s] @ x_NI[n]) for every n in `rows_N` (int64), s = slots_N[n]
    (int64), in place (in bf16 the rank-sized product rounded to bf16); A and B as `stacked_weights` in
    lora_cpu_linear builds them, in x's dtype."""
    assert a_SRI.is_contiguous() and rows_N.is_contiguous() and slots_N.is_contiguous()
    assert rows_N.dtype == slots_N.dtype == torch.int64 and slots_N.numel() <= x_NI.shape[0]
    assert a_SRI.dtype == b_SOR.dtype == x_NI.dtype == y_NO.dtype
    offsets = out_offsets(tuple(output_slices))
    function(x_NI.dtype)(x_NI.data_ptr(), x_NI.stride(0), y_NO.data_ptr(), y_NO.stride(0), a_SRI.data_ptr(),
                         expand_weights(b_SOR).data_ptr(), rows_N.data_ptr(), slots_N.data_ptr(), rows_N.numel(),
                         x_NI.shape[1], a_SRI.shape[1] // len(output_slices), len(output_slices), offsets.data_ptr(),
                         scale)


@functools.cache
def out_offsets(output_slices: tuple[int, ...]) -> torch.Tensor:
    """Where each slice's outputs start in the layer's output, and the end: int64, slices + 1."""
    return torch.tensor([0, *itertools.accumulate(output_slices)], dtype=torch.int64)
