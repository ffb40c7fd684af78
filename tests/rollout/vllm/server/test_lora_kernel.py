"""graft's LoRA kernel: at the bench's and SmolLM2's layer shapes, with 8 adapters mixed and tokens
without one, it gives what the same sums in fp32 give, rounded where vLLM's ops round (the rank-sized
product, then the output), to one bf16 step; it is built where the CPU has AVX-512 BF16, and where it
cannot be built the server goes on without it, saying why."""

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


def _cpu_has_avx512_bf16() -> bool:
    with open("/proc/cpuinfo") as info:
        return any(line.startswith("flags") and "avx512_bf16" in line.split() for line in info)


@pytest.fixture
def kernel():
    if lora_kernel.load() is None:
        pytest.skip("the kernel does not build on this host")
    return lora_kernel


@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
def test_kernel_equals_fp32_sums_rounded_as_vllm_rounds(kernel, shape):
    in_features, slices = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    a = tuple(torch.randn(SLOTS, 1, RANK, in_features, generator=gen).bfloat16() * 0.05 for _ in slices)
    b = tuple(torch.randn(SLOTS, 1, out, RANK, generator=gen).bfloat16() * 0.05 for out in slices)
    x_NI = torch.randn(TOKENS, in_features, generator=gen).bfloat16()
    y_NO = torch.randn(TOKENS, sum(slices) + 7, generator=gen).bfloat16()  # the layer's output is wider
    slots_N = torch.arange(TOKENS) % SLOTS - 1  # 8 adapters and -1
    a_SRI, b_SOR = lora_cpu_linear.stacked_weights(a, b, torch.bfloat16)
    rows_N = torch.argsort(slots_N, stable=True)[(slots_N < 0).sum():]
    got_NO = y_NO.clone()
    kernel.add(got_NO[:, :sum(slices)], x_NI, a_SRI, b_SOR, rows_N, slots_N, slices, 0.5)

    used_N = slots_N >= 0
    shrunk_NR = (0.5 * torch.einsum("ni,nri->nr", x_NI[used_N].float(), a_SRI[slots_N[used_N]].float())).bfloat16()
    delta_NO = torch.einsum("nr,nor->no", shrunk_NR.float(), b_SOR[slots_N[used_N]].float())
    want_NO = y_NO.clone()
    want_NO[used_N, :sum(slices)] = (y_NO[used_N, :sum(slices)].float() + delta_NO).bfloat16()
    assert torch.equal(got_NO[~used_N], y_NO[~used_N]), "a token without an adapter was changed"
    assert torch.equal(got_NO[:, sum(slices):], y_NO[:, sum(slices):]), "wrote past the layer's slices"
    # One bf16 step (8 bits of mantissa) of the result: the sums' order differs from torch's.
    torch.testing.assert_close(got_NO.float(), want_NO.float(), rtol=2 ** -7, atol=1e-3)
    changed = got_NO[used_N, :sum(slices)] != y_NO[used_N, :sum(slices)]
    assert changed.float().mean() > 0.9, "the LoRA add left most outputs as they were"


def test_kernel_builds_where_the_cpu_has_it():
    assert (lora_kernel.load() is not None) == _cpu_has_avx512_bf16()


def test_kernel_not_built_is_said_once_and_the_torch_path_runs(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    monkeypatch.setenv("GRAFT_CACHE", str(tmp_path))
    lora_kernel.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=lora_kernel.__name__):
            assert lora_kernel.load() is None and lora_kernel.load() is None
        assert len(caplog.records) == 1 and "LoRA kernel not built" in caplog.text
        x_NI, y_NO = torch.ones(4, 32, dtype=torch.bfloat16), torch.ones(4, 16, dtype=torch.bfloat16)
        assert not lora_kernel.usable(x_NI, y_NO, RANK)
        assert not list(tmp_path.rglob("*.so"))
    finally:
        lora_kernel.load.cache_clear()
