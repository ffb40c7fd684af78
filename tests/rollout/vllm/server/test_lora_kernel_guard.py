"""graft's LoRA kernel cannot take a server down: a call whose rows, slots or shapes it cannot prove is
refused before anything is written (torch's path takes it, said once); a fault inside the kernel
returns the row it stopped at, that row as it was, and graft finishes the call in torch and switches
the kernel off; a fault elsewhere is described and handed on (the process dies of it as before); its
probe runs in a child, so an instruction the CPU refuses kills the child; and its tests pass in a build
under AddressSanitizer and UBSan, which catches a row past a tensor."""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graft.rollout.vllm.server import lora_cpu_linear, lora_kernel

SLOTS, RANK, IN, SLICES = 3, 8, 48, (32, 16)
SANITIZED = os.environ.get(lora_kernel.SANITIZE_ENV) == "1"


def _case(dtype: torch.dtype, tokens: int = 5):
    """A layer of SLOTS adapters, x and y of `tokens` rows, every row through slot row % SLOTS."""
    gen = torch.Generator().manual_seed(0)
    a = tuple((torch.randn(SLOTS, 1, RANK, IN, generator=gen) * 0.1).to(dtype) for _ in SLICES)
    b = tuple((torch.randn(SLOTS, 1, out, RANK, generator=gen) * 0.1).to(dtype) for out in SLICES)
    a_SRI, b_SOR = lora_cpu_linear.stacked_weights(a, b, dtype)
    x_NI = torch.randn(tokens, IN, generator=gen).to(dtype)
    y_NO = torch.randn(tokens, sum(SLICES), generator=gen).to(dtype)
    rows_N = torch.arange(tokens)
    return y_NO, x_NI, a_SRI, b_SOR, rows_N, rows_N % SLOTS


def _want(y_NO, x_NI, a_SRI, b_SOR, rows_N, slots_N) -> torch.Tensor:
    want_NO = y_NO.clone()
    lora_kernel.add_rows(want_NO, x_NI, a_SRI, b_SOR, rows_N, slots_N, 0.5)
    return want_NO


@pytest.fixture
def kernel():
    """The kernel as this host builds it, fresh for each test (a test may switch it off)."""
    lora_kernel.load.cache_clear()
    if lora_kernel.function(torch.float32) is None:
        pytest.skip("the kernel does not build on this host")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield lora_kernel
    torch.set_num_threads(threads)
    lora_kernel.load.cache_clear()


REFUSED = {  # what is wrong -> how the call's arguments are changed
    "a slot past the stacked weights": lambda args: {**args, "slots_N": args["slots_N"] + SLOTS},
    "a negative slot (vLLM's no-LoRA)": lambda args: {**args, "slots_N": args["slots_N"] - 1},
    "a row past x": lambda args: {**args, "rows_N": args["rows_N"] + 1},
    "rows and slots of two lengths": lambda args: {**args, "slots_N": args["slots_N"][:-1]},
    "A's inputs not x's": lambda args: {**args, "x_NI": args["x_NI"][:, :IN - 8]},
    "y narrower than the slices": lambda args: {**args, "y_NO": args["y_NO"][:, :SLICES[0]]},
    "int32 rows": lambda args: {**args, "rows_N": args["rows_N"].int()},
    "y of another dtype": lambda args: {**args, "y_NO": args["y_NO"].double()},
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("wrong", REFUSED, ids=list(REFUSED))
def test_a_call_it_cannot_prove_is_refused_untouched_and_said_once(kernel, dtype, wrong, caplog):
    if kernel.function(dtype) is None:
        pytest.skip(f"this host's build has no {dtype} kernel")
    y_NO, x_NI, a_SRI, b_SOR, rows_N, slots_N = _case(dtype)
    args = REFUSED[wrong](dict(y_NO=y_NO, x_NI=x_NI, a_SRI=a_SRI, b_SOR=b_SOR, rows_N=rows_N, slots_N=slots_N))
    before_NO = args["y_NO"].clone()
    kernel._said.clear()
    with caplog.at_level(logging.WARNING, logger=lora_kernel.__name__):
        for _ in range(2):
            assert not kernel.add(**args, output_slices=SLICES, scale=0.5)
    assert torch.equal(args["y_NO"], before_NO), "a refused call wrote"
    assert len(caplog.records) == 1 and "cannot prove" in caplog.text
    assert kernel.add(y_NO, x_NI, a_SRI, b_SOR, rows_N, slots_N, SLICES, 0.5), "the call proven is taken"


def _guarded_page_rows(dtype: torch.dtype, x_NI: torch.Tensor):
    """x's rows one page apart in a map whose second page cannot be read: row 1 faults. Returns the map
    (kept alive by the caller) and the address of row 0."""
    page = mmap.PAGESIZE
    area = mmap.mmap(-1, 2 * page)
    address = ctypes.addressof(ctypes.c_char.from_buffer(area))
    row_bytes = x_NI.shape[1] * x_NI.element_size()
    ctypes.memmove(address, x_NI[0].contiguous().data_ptr(), row_bytes)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(address + page, page, 0) == 0, os.strerror(ctypes.get_errno())  # PROT_NONE
    return area, address, page // x_NI.element_size()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_fault_inside_the_kernel_returns_its_row_restored(kernel, dtype):
    if kernel.function(dtype) is None:
        pytest.skip(f"this host's build has no {dtype} kernel")
    y_NO, x_NI, a_SRI, b_SOR, rows_N, slots_N = _case(dtype, tokens=2)
    area, address, page_stride = _guarded_page_rows(dtype, x_NI)
    want_NO = _want(y_NO, x_NI, a_SRI, b_SOR, rows_N, slots_N)
    got_NO = y_NO.clone()
    expand, offsets = kernel.expand_weights(b_SOR), kernel.out_offsets(SLICES)
    done = kernel.function(dtype)(address, page_stride, got_NO.data_ptr(), got_NO.stride(0), a_SRI.data_ptr(),
                                  expand.data_ptr(), rows_N.data_ptr(), slots_N.data_ptr(), 2, 2, SLOTS, IN, RANK,
                                  len(SLICES), offsets.data_ptr(), 0.5)
    assert done == 1, "the fault at row 1 was not reported as such"
    tolerance = {"rtol": 2 ** -7, "atol": 1e-3} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(got_NO[0].float(), want_NO[0].float(), **tolerance)
    assert torch.equal(got_NO[1], y_NO[1]), "the faulting row was left half written"
    text = ctypes.create_string_buffer(512)
    kernel.load().library.graft_lora_fault(text, len(text))
    assert f"signal {int(signal.SIGSEGV)}" in text.value.decode()
    del area


def test_after_a_fault_torch_finishes_the_call_and_the_kernel_is_off(kernel, monkeypatch, caplog):
    y_NO, x_NI, a_SRI, b_SOR, rows_N, slots_N = _case(torch.float32)
    real = kernel.function(torch.float32)

    def faults_at_row_3(*args):  # the real kernel over rows 0-2, then what a fault at row 3 returns
        return min(real(*args[:8], 3, *args[9:]), 3)

    kernel.load().functions[torch.float32] = faults_at_row_3
    got_NO = y_NO.clone()
    with caplog.at_level(logging.ERROR, logger=lora_kernel.__name__):
        assert kernel.add(got_NO, x_NI, a_SRI, b_SOR, rows_N, slots_N, SLICES, 0.5)
    torch.testing.assert_close(got_NO, _want(y_NO, x_NI, a_SRI, b_SOR, rows_N, slots_N), rtol=1e-5, atol=1e-5)
    assert "LoRA kernel faulted" in caplog.text and kernel.function(torch.float32) is None
    assert not kernel.add(y_NO.clone(), x_NI, a_SRI, b_SOR, rows_N, slots_N, SLICES, 0.5), "still used after a fault"


_FOREIGN_FAULT = """
import ctypes, sys
from graft.rollout.vllm.server import lora_kernel
assert lora_kernel.load() is not None
print("loaded", flush=True)
if sys.argv[1] == "-":
    ctypes.string_at(1)  # SIGSEGV in libc
else:
    ctypes.CDLL(sys.argv[1]).graft_lora_self_test(ctypes.c_int64(1))  # ud2: SIGILL in another library
"""


@pytest.mark.parametrize("where", ["SIGSEGV in libc", "SIGILL in another library"])
def test_a_fault_outside_the_kernel_is_described_and_handed_on(kernel, tmp_path, where):
    other = "-" if where.endswith("libc") else str(_fake_kernel(tmp_path, "__builtin_trap(); return which;"))
    done = subprocess.run([sys.executable, "-c", _FOREIGN_FAULT, other], capture_output=True, text=True, timeout=120)
    assert done.stdout == "loaded\n"
    sig = signal.SIGSEGV if where.endswith("libc") else signal.SIGILL
    assert done.returncode == -sig, done.stderr[-2000:]
    line = next(line for line in done.stderr.splitlines() if line.startswith("graft: fatal"))
    assert line.startswith(f"graft: fatal {sig.name} at ip 0x") and "not in graft's LoRA kernel" in line
    assert ("libc.so" in line) if other == "-" else (f"= {other}+0x" in line and "(bytes 0xf 0xb" in line)  # ud2


def _fake_kernel(tmp_path: Path, self_test: str) -> Path:
    """A library with the probe's two entry points: the host has both functions, the self-test of `which`
    is `self_test`."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        pytest.skip("no C compiler")
    source = tmp_path / "fake.c"
    source.write_text("#include <stdint.h>\nint64_t graft_lora_host_features(void) { return 3; }\n"
                      f"int64_t graft_lora_self_test(int64_t which) {{ {self_test} }}\n")
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(tmp_path / "fake.so"), str(source)], check=True)
    return tmp_path / "fake.so"


def test_an_instruction_the_cpu_refuses_kills_its_probe_not_the_process_nor_the_other_function(tmp_path, caplog):
    bf16_traps = "if (which == 2) __builtin_trap(); return which;"  # ud2: SIGILL
    with caplog.at_level(logging.WARNING, logger=lora_kernel.__name__):
        assert lora_kernel._probe(_fake_kernel(tmp_path, bf16_traps)) == (lora_kernel.HAS_FP32, None)
    assert "bf16 function died of SIGILL in its probe" in caplog.text


def test_a_function_giving_wrong_sums_in_its_probe_is_not_used(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger=lora_kernel.__name__):
        assert lora_kernel._probe(_fake_kernel(tmp_path, "return which == 2 ? 0 : which;")) == (1, None)
    assert "bf16 function gave wrong sums in its probe" in caplog.text


def test_a_kernel_whose_probes_all_die_is_not_loaded(tmp_path, monkeypatch, caplog):
    fake = _fake_kernel(tmp_path, "__builtin_trap(); return which;")
    monkeypatch.setenv("GRAFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(lora_kernel, "_build", lambda compiler, flags, library: shutil.copy(fake, library) and None)
    (tmp_path / "cache" / "kernels").mkdir(parents=True)
    lora_kernel.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=lora_kernel.__name__):
            assert lora_kernel.load() is None and lora_kernel.function(torch.float32) is None
    finally:
        lora_kernel.load.cache_clear()
    assert "LoRA kernel not built (fp32: died of SIGILL in its probe; bf16: died of SIGILL" in caplog.text


def _sanitized_environment(tmp_path: Path) -> dict[str, str]:
    runtimes = [subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
                for name in ("libasan.so", "libubsan.so")] if shutil.which("gcc") else []
    if not runtimes or not all(os.path.isabs(path) and os.path.exists(path) for path in runtimes):
        pytest.skip("no gcc with AddressSanitizer's and UBSan's runtimes")
    return {**os.environ, lora_kernel.SANITIZE_ENV: "1", "LD_PRELOAD": " ".join(runtimes),
            "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0", "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
            "GRAFT_CACHE": os.environ.get("GRAFT_CACHE", str(Path.home() / ".cache" / "graft"))}


@pytest.mark.skipif(SANITIZED, reason="already the sanitized run")
def test_the_kernel_tests_pass_built_with_address_and_undefined_sanitizers(kernel, tmp_path):
    tests = Path(__file__).parent
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           str(tests / "test_lora_kernel.py"), str(tests / "test_lora_kernel_guard.py"),
                           "-k", "not fault_outside and not sanitize"],
                          capture_output=True, text=True, timeout=600, env=_sanitized_environment(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.split("\n")[-2], done.stdout[-500:]


_WRITE_PAST_Y = """
import torch
from graft.rollout.vllm.server import lora_kernel
from tests.rollout.vllm.server.test_lora_kernel_guard import IN, RANK, SLICES, SLOTS, _case
y_NO, x_NI, a_SRI, b_SOR, rows_N, slots_N = _case(torch.float32, tokens=4)
y_short_NO = y_NO[:3].clone()  # 3 rows; the call below says 4
expand, offsets = lora_kernel.expand_weights(b_SOR), lora_kernel.out_offsets(SLICES)
lora_kernel.function(torch.float32)(x_NI.data_ptr(), IN, y_short_NO.data_ptr(), sum(SLICES), a_SRI.data_ptr(),
    expand.data_ptr(), rows_N.data_ptr(), slots_N.data_ptr(), 4, 4, SLOTS, IN, RANK, len(SLICES),
    offsets.data_ptr(), 0.5)
print("no report")
"""


@pytest.mark.skipif(SANITIZED, reason="already the sanitized run")
def test_the_sanitized_build_catches_a_row_past_y(kernel, tmp_path):
    done = subprocess.run([sys.executable, "-c", _WRITE_PAST_Y], capture_output=True, text=True, timeout=300,
                          env=_sanitized_environment(tmp_path), cwd=Path(__file__).parents[4])
    assert "no report" not in done.stdout and done.returncode != 0
    assert "AddressSanitizer: heap-buffer-overflow" in done.stderr and "lora_kernel.c" in done.stderr, \
        done.stderr[-3000:]
