"""The grouped LoRA ops graft installs in its vLLM servers give vLLM's own per-token ops' results:
one adapter for the batch, several, tokens without one (index -1), 3-D and 4-D weight stacks,
adding into the output or not; and they are installed over the vLLM this project pins."""

import pytest
import torch

from graft.rollout.vllm.server import lora_cpu, lora_cpu_linear

lora_ops = pytest.importorskip("vllm.lora.ops.torch_ops.lora_ops")
punica_cpu = pytest.importorskip("vllm.lora.punica_wrapper.punica_cpu")
VLLM_OPS = {name: getattr(lora_ops, name) for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")}

SLOTS, TOKENS, IN, OUT = 4, 37, 48, 24
INDICES = {
    "one adapter": torch.full((TOKENS,), 2),
    "two adapters and none": torch.tensor([0, 1, -1] * 12 + [1]),
    "one token": torch.tensor([1]),
}


def _case(indices_T: torch.Tensor, stack_4d: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weights = torch.randn(SLOTS, OUT, IN, generator=gen)
    inputs_TI = torch.randn(indices_T.numel(), IN, generator=gen)
    return inputs_TI, weights.unsqueeze(1) if stack_4d else weights, torch.randn(indices_T.numel(), OUT + 8,
                                                                                 generator=gen)


def _vllm_weights(weights, indices_T):
    """vLLM's ops read `weights[-1]` (the last slot) for a token without an adapter; graft's add
    nothing: the same as vLLM's with that slot empty."""
    if (indices_T == -1).any():
        weights = weights.clone()
        weights[-1] = 0
    return weights


@pytest.mark.parametrize("stack_4d", [False, True])
@pytest.mark.parametrize("indices", INDICES, ids=list(INDICES))
def test_shrink_and_expand_equal_vllms_ops(indices, stack_4d):
    """Equal to vLLM's ops where the last slot is empty (tokens without an adapter add nothing)."""
    indices_T = INDICES[indices]
    inputs_TI, weights, out = _case(indices_T, stack_4d)
    weights = _vllm_weights(weights, indices_T)
    for add_inputs in (False, True):
        got, want = out.clone(), out.clone()
        lora_cpu.bgmv_expand(inputs_TI, weights, got, indices_T, add_inputs)
        VLLM_OPS["bgmv_expand"](inputs_TI, weights, want, indices_T, add_inputs)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
        got, want = out.clone(), out.clone()
        lora_cpu.bgmv_expand_slice(inputs_TI, weights, got, indices_T, 5, OUT, add_inputs)
        VLLM_OPS["bgmv_expand_slice"](inputs_TI, weights, want, indices_T, 5, OUT, add_inputs)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
        assert not torch.equal(got, out)
    got, want = out.clone(), out.clone()
    lora_cpu.bgmv_shrink(inputs_TI, weights, got, indices_T, 0.5)
    VLLM_OPS["bgmv_shrink"](inputs_TI, weights, want, indices_T, 0.5)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)


def test_tokens_without_an_adapter_get_none_even_when_the_last_slot_holds_one():
    """vLLM-CPU's own ops apply slot max_loras-1 to "-1" tokens; graft's apply nothing."""
    indices_T = torch.tensor([-1, 2, -1, -1])
    inputs_TI, weights, out = _case(indices_T, stack_4d=False)
    got = out.clone()
    lora_cpu.bgmv_expand(inputs_TI, weights, got, indices_T, True)
    torch.testing.assert_close(got[indices_T == -1], out[indices_T == -1], rtol=0, atol=0)
    torch.testing.assert_close(got[1, :OUT], out[1, :OUT] + weights[2] @ inputs_TI[1], rtol=1e-6, atol=1e-5)
    only_base = out.clone()
    lora_cpu.bgmv_expand(inputs_TI, weights, only_base, torch.full((4,), -1), False)
    assert not only_base[:, :OUT].any()


def test_one_output_row_broadcasts_as_in_vllm():
    """vLLM's expand adds a single computed row to every output row (its `limit` rule)."""
    inputs_TI, weights, out = _case(torch.tensor([3]), stack_4d=False)
    got, want = out.clone(), out.clone()
    lora_cpu.bgmv_expand(inputs_TI, weights, got, torch.tensor([3]), True)
    VLLM_OPS["bgmv_expand"](inputs_TI, weights, want, torch.tensor([3]), True)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)


def test_installed_over_the_pinned_vllm_unless_turned_off(monkeypatch):
    for name, op in VLLM_OPS.items():  # restored after the test
        monkeypatch.setattr(lora_ops, name, op)
        monkeypatch.setattr(punica_cpu, name, getattr(punica_cpu, name))
    wrapper = punica_cpu.PunicaWrapperCPU
    monkeypatch.setattr(wrapper, "add_lora_linear", wrapper.add_lora_linear)
    monkeypatch.setenv("GRAFT_VLLM_LORA_OPS", "vllm")
    assert not lora_cpu.install()
    assert lora_ops.bgmv_expand is VLLM_OPS["bgmv_expand"]
    monkeypatch.setenv("GRAFT_VLLM_LORA_OPS", "grouped")
    assert lora_cpu.install(), "the pinned vLLM's op signatures changed: check the grouped ops against them"
    assert lora_ops.bgmv_expand is lora_cpu.bgmv_expand
    assert punica_cpu.bgmv_shrink is lora_cpu.bgmv_shrink  # the decode path's own import
    assert wrapper.add_lora_linear is lora_cpu_linear.add_lora_linear
