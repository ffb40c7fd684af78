"""graft's LoRA kernel: at the bench's and SmolLM2's layer shapes, with 8 adapters mixed and tokens
without one, in bf16 and fp32, it gives what the same sums in fp32 give, rounded where vLLM's ops
round (in bf16 the rank-sized product, then the output), to one bf16 step or fp32's rounding; it is
built for its own instructions where the CPU has AVX-512 (bf16: AVX-512 BF16), and where it cannot
be built the server goes on without it, saying why. How it cannot take a server down (refused calls,
its probe, faults) is in test_lora_kernel_guard.py."""

import logging

import pytest
import torch

from graft.rollout.vllm.server import lora_cpu_linear, lora_kernel

SHAPES = {  # in features, the slices' out features: q/k/v and gate/up of each
    "bench q/k/v": (256, (256, 128, 128)),
    "bench down": (704, (256,)),
    "smollm2 q/k/v": (576, (576, 192, 192)),
    "smollm2 gate/up": (576, (1536, 1536)),
    "odd sizes": (100, (40, 24)),  # neither a multiple of the kernel's 32 inputs nor its 16 outputs
}
SLOTS, RANK, TOKENS = 9, 8, 64


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as info:
        return next((set(line.split()) for line in info if line.startswith("flags")), set())


@pytest.fixture
def kernel():
    if lora_kernel.load() is None:
        pytest.skip("the kernel does not build on this host")
    return lora_kernel


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
def test_kernel_equals_fp32_sums_rounded_as_vllm_rounds(kernel, shape, dtype):
    if kernel.function(dtype) is None:
        pytest.skip(f"this host's build has no {dtype} kernel")
    in_features, slices = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    a = tuple((torch.randn(SLOTS, 1, RANK, in_features, generator=gen) * 0.05).to(dtype) for _ in slices)
    b = tuple((torch.randn(SLOTS, 1, out, RANK, generator=gen) * 0.05).to(dtype) for out in slices)
    x_NI = torch.randn(TOKENS, in_features, generator=gen).to(dtype)
    y_NO = torch.randn(TOKENS, sum(slices) + 7, generator=gen).to(dtype)  # the layer's output is wider
    slots_N = torch.arange(TOKENS) % SLOTS - 1  # 8 adapters and -1
    a_SRI, b_SOR = lora_cpu_linear.stacked_weights(a, b, dtype)
    rows_N = torch.argsort(slots_N, stable=True)[(slots_N < 0).sum():]
    got_NO = y_NO.clone()
    assert kernel.add(got_NO[:, :sum(slices)], x_NI, a_SRI, b_SOR, rows_N, slots_N[rows_N], slices, 0.5)

    used_N = slots_N >= 0
    shrunk_NR = (0.5 * torch.einsum("ni,nri->nr", x_NI[used_N].float(), a_SRI[slots_N[used_N]].float())).to(dtype)
    delta_NO = torch.einsum("nr,nor->no", shrunk_NR.float(), b_SOR[slots_N[used_N]].float())
    want_NO = y_NO.clone()
    want_NO[used_N, :sum(slices)] = (y_NO[used_N, :sum(slices)].float() + delta_NO).to(dtype)
    assert torch.equal(got_NO[~used_N], y_NO[~used_N]), "a token without an adapter was changed"
    assert torch.equal(got_NO[:, sum(slices):], y_NO[:, sum(slices):]), "wrote past the layer's slices"
    # bf16: one step of its 8-bit mantissa (the sums' order differs from torch's); fp32: rounding.
    tolerance = {"rtol": 2 ** -7, "atol": 1e-3} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(got_NO.float(), want_NO.float(), **tolerance)
    changed = got_NO[used_N, :sum(slices)] != y_NO[used_N, :sum(slices)]
    assert changed.float().mean() > 0.9, "the LoRA add left most outputs as they were"


def test_kernel_builds_where_the_cpu_has_it():
    assert not any(flag.startswith(("-march", "-mavx")) for flag in lora_kernel.FLAGS)  # its own, per function
    flags = _cpu_flags()
    assert (lora_kernel.function(torch.float32) is not None) == ({"avx512f", "fma"} <= flags)
    assert (lora_kernel.function(torch.bfloat16) is not None) == ({"avx512_bf16", "avx512bw", "avx512vl"} <= flags)


@pytest.mark.parametrize("cause", ["a failing compiler", "a cache it cannot write"])
def test_kernel_not_built_is_said_once_and_the_torch_path_runs(monkeypatch, tmp_path, caplog, cause):
    if cause == "a failing compiler":
        monkeypatch.setenv("CC", "false")
        monkeypatch.setenv("GRAFT_CACHE", str(tmp_path))
    else:
        (tmp_path / "file").write_text("")
        monkeypatch.setenv("GRAFT_CACHE", str(tmp_path / "file"))  # kernels/ cannot be made under a file
    lora_kernel.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=lora_kernel.__name__):
            assert lora_kernel.load() is None and lora_kernel.load() is None
        assert len(caplog.records) == 1 and "LoRA kernel not built" in caplog.text
        x_NI, y_NO = torch.ones(4, 32, dtype=torch.bfloat16), torch.ones(4, 16, dtype=torch.bfloat16)
        a_SRI, b_SOR = torch.ones(2, RANK, 32, dtype=torch.bfloat16), torch.ones(2, 16, RANK, dtype=torch.bfloat16)
        rows_N = torch.arange(4)
        assert not lora_kernel.add(y_NO, x_NI, a_SRI, b_SOR, rows_N, rows_N % 2, (16,), 1.0)
        assert torch.equal(y_NO, torch.ones(4, 16, dtype=torch.bfloat16))
        assert not list(tmp_path.rglob("*.so"))
    finally:
        lora_kernel.load.cache_clear()
