"""graft's LoRA kernel for vLLM-CPU (lora_kernel.c; its fault guard lora_guard.c, its probe lora_probe.c):
a layer's LoRA add for every token through its own adapter in one call, in bf16 (AVX-512 BF16) and fp32
(AVX-512F); used by graft's `add_lora_linear` (lora_cpu_linear) where the worker runs one thread.

Why a kernel: with several adapters in a step, the torch path gathers each adapter's tokens, pads
them to the largest group, runs two batched products and gathers back; on one thread at a hidden-256
q/k/v (64 tokens, 8 adapters, r=8, bf16) that is ~100 us a layer against ~40 us for one adapter
through oneDNN. The kernel takes each token's two products from its own slot's weights and adds
into the layer's output in one pass: 26 us there, whether 1 or 8 adapters (bf16's dot-product
instruction takes 32 multiply-adds at once), and in fp32 1.5-2x faster than the torch path with 8
adapters, about as fast with one (measured on this project's 2-core EPYC, one thread; the table in
docs/rollout-profile.md). It is one thread: with more, torch's paths split the work over them and
are kept.

Built once per host with the system C compiler (`$CC`, else cc), for the instructions it uses: each
function names its own (fp32: AVX-512F and FMA; bf16: AVX-512F/BW/VL and AVX-512 BF16), never
`-march=native`, which compiled for everything the build host advertised. Cached under
`$GRAFT_CACHE/kernels` by a hash of the source and the compiler command; loaded with ctypes (no torch
extension: nothing to rebuild when torch changes). Before a process uses it, the kernel's own probe runs
in a child process: what this CPU has and its OS enables (cpuid, XCR0), and each function it has on a
small exact case. So a cache moved between hosts, or a VM that lists an instruction it does not run,
costs a child, not a server. Where it cannot be built or a function fails its probe graft's torch path
runs, and the server's log says why, once.

A call cannot take a server down (lora_kernel.c): its shapes, dtypes and strides are proven here, its rows
and slots in C before anything is written; a call not proven is refused (the torch path takes it, said
once). A fault inside the kernel (an instruction the CPU refuses included) is caught there: the rows it
had not finished are added by torch, the fault is logged with its place and instruction bytes, and the
kernel is off for the rest of the process.

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
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from graft.models.cache import default_cache_dir

SOURCES = [Path(__file__).with_name(name) for name in ("lora_kernel.c", "lora_guard.c", "lora_probe.c")]
HEADER = Path(__file__).with_name("lora_kernel.h")
FLAGS = ["-O3", "-shared", "-fPIC"]  # the instructions are named per function in the source
SANITIZE_ENV = "GRAFT_LORA_KERNEL_SANITIZE"  # "1": built with ASan and UBSan (the suite's sanitizer run)
SANITIZE_FLAGS = ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
HAS_FP32, HAS_BF16 = 1, 2  # lora_kernel.c's feature bits
_BITS = {torch.float32: HAS_FP32, torch.bfloat16: HAS_BF16}
_NAMES = {HAS_FP32: "fp32", HAS_BF16: "bf16"}
_FUNCTIONS = {torch.bfloat16: "graft_lora_add_bf16", torch.float32: "graft_lora_add_f32"}
_POINTER, _INT = ctypes.c_void_p, ctypes.c_int64
_ARGUMENTS = [_POINTER, _INT, _POINTER, _INT, _POINTER, _POINTER, _POINTER, _POINTER, _INT, _INT, _INT, _INT, _INT,
              _INT, _POINTER, ctypes.c_float]
# The child's exit status: whether the function (argv[2], a HAS_* bit) passed, and (shifted by 2) what the
# host has.
_PROBE = ("import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); "
          "sys.exit(lib.graft_lora_self_test(ctypes.c_int64(int(sys.argv[2]))) | lib.graft_lora_host_features() << 2)")
_NEEDS = {HAS_FP32: "AVX-512F and FMA", HAS_BF16: "AVX-512F/BW/VL and AVX-512 BF16"}
log = logging.getLogger(__name__)
_said: set[str] = set()


@dataclass
class Kernel:
    """The loaded library and its functions that passed the probe, by dtype (emptied after a fault)."""

    library: ctypes.CDLL
    functions: dict[torch.dtype, Callable]


@functools.cache
def load() -> Kernel | None:
    """The kernel, built on first use in this host's cache and probed in a child; None where it cannot be
    built or no function passed (logged once with the reason)."""
    compiler = os.environ.get("CC", "cc")
    flags = FLAGS + (SANITIZE_FLAGS if os.environ.get(SANITIZE_ENV) == "1" else [])
    try:
        digest = hashlib.sha256(b"".join(path.read_bytes() for path in [HEADER, *SOURCES]) +
                                " ".join([compiler, *flags]).encode())
        library = default_cache_dir() / "kernels" / f"lora_kernel-{digest.hexdigest()[:16]}.so"
        error = None if library.exists() else _build(compiler, flags, library)
        passed, error = (0, error) if error else _probe(library)
        if error is None:
            return _open(library, passed)
    except OSError as exc:  # the source missing from an install, a library that does not load
        error = str(exc)
    log.warning("graft: LoRA kernel not built (%s); LoRA layers take torch's path", error)
    return None


def function(dtype: torch.dtype) -> Callable | None:
    """The kernel's C function for `dtype`; None where this host has none that passed its probe (or the
    kernel faulted in this process)."""
    kernel = load()
    return None if kernel is None else kernel.functions.get(dtype)


def _build(compiler: str, flags: list[str], library: Path) -> str | None:
    """Compile the source into `library` (written whole, then renamed: a concurrent start never loads
    half a file); the reason on failure (a cache it cannot write included)."""
    try:
        library.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
            built = Path(scratch) / library.name
            done = subprocess.run([compiler, *flags, "-o", str(built), *map(str, SOURCES)], capture_output=True,
                                  text=True, timeout=120)
            if done.returncode != 0:
                lines = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines()
                return lines[0].strip() if lines else f"{compiler} exited {done.returncode}"
            os.replace(built, library)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{compiler}: {exc}"
    return None


def _probe(library: Path) -> tuple[int, str | None]:
    """The functions (HAS_* bits) this host has that gave the exact sums of the kernel's self-test, each
    run in a child process of its own; and, where none did, why. A function the host has that died or
    erred in its probe is said (the other may still pass)."""
    passed, reasons = 0, []
    for bit in _NAMES:
        reason = _probe_one(library, bit)
        if reason is None:
            passed |= bit
            continue
        reasons.append(f"{_NAMES[bit]}: {reason}")
        if not reason.startswith("this CPU"):
            log.warning("graft: LoRA kernel's %s function %s; torch's path runs for it", _NAMES[bit], reason)
    return passed, None if passed else "; ".join(reasons)


def _probe_one(library: Path, bit: int) -> str | None:
    """Why the function `bit` did not pass its probe in a child process; None where it did."""
    try:
        done = subprocess.run([sys.executable, "-I", "-c", _PROBE, str(library), str(bit)], capture_output=True,
                              text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"its probe did not run: {exc}"
    if done.returncode < 0:
        return f"died of {signal.Signals(-done.returncode).name} in its probe"
    if done.returncode > 15 or done.stderr.strip():  # an exception's exit 1 is no feature bits
        return f"its probe failed: {done.stderr.strip()[-300:] or f'exit {done.returncode}'}"
    if not done.returncode >> 2 & bit:
        return f"this CPU (or its OS) lacks {_NEEDS[bit]}"
    return None if done.returncode & bit else "gave wrong sums in its probe"


def _open(library: Path, passed: int) -> Kernel:
    """Load the probed library into this process, its fault guard installed, its passing functions typed."""
    loaded = ctypes.CDLL(str(library))
    if loaded.graft_lora_install_guard() != 0:
        raise OSError("its fault handler could not be installed")
    functions = {}
    for dtype, name in _FUNCTIONS.items():
        if passed & _BITS[dtype]:
            functions[dtype] = getattr(loaded, name)
            functions[dtype].argtypes, functions[dtype].restype = _ARGUMENTS, ctypes.c_int64
    loaded.graft_lora_fault.argtypes, loaded.graft_lora_fault.restype = [ctypes.c_char_p, _INT], _INT
    return Kernel(loaded, functions)


def unproven(y_NO: torch.Tensor, x_NI: torch.Tensor, a_SRI: torch.Tensor, expand: torch.Tensor, rows_N: torch.Tensor,
             slots_N: torch.Tensor, output_slices: tuple[int, ...]) -> str | None:
    """Why the kernel cannot take this call as the C code reads it (None: it can): one dtype throughout,
    rows of unit stride, A and B contiguous in the layouts `stacked_weights` and `expand_weights` build
    with A's inputs x's and B's outputs the slices', int64 rows and slots side by side. Rows and slots in
    range are checked in C."""
    dtype, slices = x_NI.dtype, len(output_slices)
    if not y_NO.dtype == a_SRI.dtype == expand.dtype == dtype:
        return f"dtypes {x_NI.dtype}, {y_NO.dtype}, {a_SRI.dtype}, {expand.dtype}"
    if x_NI.dim() != 2 or y_NO.dim() != 2 or x_NI.stride(1) != 1 or y_NO.stride(1) != 1:
        return "x or y not rows of unit stride"
    if not (a_SRI.dim() == 3 and a_SRI.is_contiguous() and a_SRI.shape[2] == x_NI.shape[1] and slices > 0
            and a_SRI.shape[1] % slices == 0):
        return f"A {tuple(a_SRI.shape)} for x {tuple(x_NI.shape)} and {slices} slices"
    stacked_rank, out_features = a_SRI.shape[1], sum(output_slices)
    if dtype == torch.bfloat16 and stacked_rank // slices % 2:
        return "an odd rank in bf16 (the kernel takes ranks in pairs)"
    layout = (a_SRI.shape[0], stacked_rank // 2, out_features, 2) if dtype == torch.bfloat16 else \
        (a_SRI.shape[0], stacked_rank, out_features)
    if not expand.is_contiguous() or tuple(expand.shape) != layout or y_NO.shape[1] < out_features:
        return f"B {tuple(expand.shape)} for A {tuple(a_SRI.shape)}, y {tuple(y_NO.shape)} and slices {output_slices}"
    if not (rows_N.dtype == slots_N.dtype == torch.int64 and rows_N.dim() == slots_N.dim() == 1
            and rows_N.is_contiguous() and slots_N.is_contiguous() and rows_N.numel() == slots_N.numel()):
        return "rows and slots not int64 side by side"
    return None


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
        slots_N: torch.Tensor, output_slices: tuple[int, ...], scale: float) -> bool:
    """y_NO[rows_N[k]] += B[s] @ (scale * A[s] @ x_NI[rows_N[k]]), s = slots_N[k], in place (in bf16 the
    rank-sized product rounded to bf16); A and B as `stacked_weights` in lora_cpu_linear builds them.
    False where the kernel did not take the call (none for this dtype, more than one thread, or a call it
    cannot prove: said once): nothing was written, the caller's torch path adds it."""
    kernel = function(x_NI.dtype) if torch.get_num_threads() == 1 else None
    if kernel is None:
        return False
    expand = expand_weights(b_SOR)
    reason = unproven(y_NO, x_NI, a_SRI, expand, rows_N, slots_N, output_slices)
    offsets = out_offsets(tuple(output_slices))
    done = -1 if reason else kernel(
        x_NI.data_ptr(), x_NI.stride(0), y_NO.data_ptr(), y_NO.stride(0), a_SRI.data_ptr(), expand.data_ptr(),
        rows_N.data_ptr(), slots_N.data_ptr(), rows_N.numel(), min(x_NI.shape[0], y_NO.shape[0]), a_SRI.shape[0],
        x_NI.shape[1], a_SRI.shape[1] // len(output_slices), len(output_slices), offsets.data_ptr(), scale)
    if done == rows_N.numel():
        return True
    if done < 0:
        _say_once(f"graft: a LoRA call the kernel cannot prove ({reason or 'a row, slot or size out of range'}) "
                  "takes torch's path")
        return False
    _switch_off()
    add_rows(y_NO, x_NI, a_SRI, b_SOR, rows_N[done:], slots_N[done:], scale)
    return True


def add_rows(y_NO: torch.Tensor, x_NI: torch.Tensor, a_SRI: torch.Tensor, b_SOR: torch.Tensor, rows_N: torch.Tensor,
             slots_N: torch.Tensor, scale: float) -> None:
    """The kernel's sums in torch, rounded where it rounds, for the rows a faulted call did not finish."""
    shrunk_NR = (scale * torch.einsum("ni,nri->nr", x_NI[rows_N].float(), a_SRI[slots_N].float())).to(x_NI.dtype)
    delta_NO = torch.einsum("nr,nor->no", shrunk_NR.float(), b_SOR[slots_N].float())
    y_NO[rows_N, :delta_NO.shape[1]] = (y_NO[rows_N, :delta_NO.shape[1]].float() + delta_NO).to(y_NO.dtype)


def _switch_off() -> None:
    """After a fault inside the kernel: log it once, with what the C guard recorded, and use torch's path
    for the rest of this process."""
    loaded = load()
    text = ctypes.create_string_buffer(512)
    loaded.library.graft_lora_fault(text, len(text))
    loaded.functions.clear()
    log.error("graft: LoRA kernel faulted (%s); its unfinished rows were added by torch, and LoRA layers take "
              "torch's path from now on in this process", text.value.decode())


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        log.warning(message)


@functools.cache
def out_offsets(output_slices: tuple[int, ...]) -> torch.Tensor:
    """Where each slice's outputs start in the layer's output, and the end: int64, slices + 1."""
    return torch.tensor([0, *itertools.accumulate(output_slices)], dtype=torch.int64)
