"""The fused LoRA forward (`graft.lora.fused`) gives PEFT's outputs and gradients, and steps aside
wherever PEFT's sum is not the plain one."""

import peft
import pytest
import torch
from peft.tuners.lora import LoraLayer
from torch import nn

import graft.lora.fused as fused_module
from graft.lora.attach import ADAPTER_NAME, adapter_disabled
from graft.lora.fused import fused_lora
from graft.lora.routing import routed


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 48)
        self.down = nn.Linear(48, 16, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class _TinyLinear(_Tiny):
    """No ReLU: a bf16 rounding cannot flip a unit on or off and move a gradient by a whole term."""

    def forward(self, x):
        return self.down(self.up(x))


def _policy(dtype=torch.float32, base=_Tiny):
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["up", "down"])
    model = peft.get_peft_model(base().to(dtype), config, adapter_name=ADAPTER_NAME)
    for name, parameter in model.named_parameters():
        if "lora_" in name:
            nn.init.normal_(parameter, std=0.3)
            parameter.data = parameter.data.float()
    return model


def _outputs_and_grads(model, x, fused: bool):
    model.zero_grad()
    with fused_lora(model) if fused else torch.enable_grad():
        y = model(x)
        y.float().square().mean().backward()
    return y.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.fixture
def addmm_calls(monkeypatch):
    calls = []
    real = torch.addmm
    monkeypatch.setattr(fused_module.torch, "addmm", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_outputs_and_gradients_equal_peft(dtype, addmm_calls):
    model, x = _policy(dtype), torch.randn(3, 5, 16, dtype=dtype)
    y_peft, grads_peft = _outputs_and_grads(model, x, fused=False)
    y_fused, grads_fused = _outputs_and_grads(model, x, fused=True)
    assert len(addmm_calls) == 2  # both LoRA layers took the fused path
    assert y_fused.dtype == y_peft.dtype == dtype
    torch.testing.assert_close(y_fused, y_peft, rtol=1e-5, atol=1e-6)
    for name, grad in grads_peft.items():
        torch.testing.assert_close(grads_fused[name], grad, rtol=1e-4, atol=1e-6)
    assert all("forward" not in vars(m) for m in model.modules())  # nothing left installed


def test_adapter_off_and_other_per_layer_forwards_are_left_to_peft(addmm_calls):
    model, x = _policy(), torch.randn(2, 3, 16)
    with fused_lora(model), adapter_disabled(model):
        with torch.no_grad():
            base = model(x)
    assert not addmm_calls
    with torch.no_grad():
        with adapter_disabled(model):
            expected = model(x)
    torch.testing.assert_close(base, expected)
    # A routed forward installed first keeps its own forward inside fused_lora, and both clean up.
    route_N = torch.zeros(6, dtype=torch.long)
    with routed(model, route_N, ["default"]), fused_lora(model), torch.no_grad():
        model(x)
    assert not addmm_calls
    assert all("forward" not in vars(m) for m in model.modules() if isinstance(m, LoraLayer))


def _saved_float32_elements(model, x, in_base_dtype: bool) -> int:
    """Elements of float32 tensors the forward keeps for the backward (the LoRA factors aside)."""
    factors = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = []

    def pack(tensor):
        if tensor.dtype == torch.float32 and tensor.untyped_storage().data_ptr() not in factors:
            saved.append(tensor.numel())
        return tensor

    with fused_lora(model, in_base_dtype), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(saved)


def test_in_the_base_dtype_the_lora_path_computes_in_bf16_and_its_gradients_stay_fp32(addmm_calls):
    """`in_base_dtype` on a bf16 base: PEFT's result to bf16 rounding, fp32 gradients of the fp32
    factors, and no fp32 copy of a layer's input or output kept for the backward. (Against float64,
    PEFT's fp32 LoRA path has gradients within 0.3% of each one's largest element here, the bf16 path
    within 1.2%: FSDP2's mixed precision and TRL's bf16 autocast compute it so too.)"""
    model, x = _policy(torch.bfloat16, _TinyLinear), torch.randn(3, 5, 16, dtype=torch.bfloat16)
    y_peft, grads_peft = _outputs_and_grads(model, x, fused=False)
    model.zero_grad()
    with fused_lora(model, in_base_dtype=True):
        y = model(x)
        y.float().square().mean().backward()
    assert len(addmm_calls) == 2 and y.dtype == torch.bfloat16
    scale = y_peft.abs().max().item()  # bf16 products of the LoRA path: rounding of the largest outputs
    torch.testing.assert_close(y, y_peft, rtol=2e-2, atol=1e-2 * scale)
    for name, grad in grads_peft.items():
        parameter = model.get_parameter(name)
        assert parameter.grad.dtype == parameter.dtype == torch.float32
        torch.testing.assert_close(parameter.grad, grad, rtol=3e-2, atol=3e-2 * grad.abs().max().item())
    assert _saved_float32_elements(model, x, in_base_dtype=True) == 0
    assert _saved_float32_elements(model, x, in_base_dtype=False) >= x.numel()  # the fp32 input of `up`


def test_in_the_base_dtype_changes_nothing_on_an_fp32_base():
    model, x = _policy(), torch.randn(3, 5, 16)
    y, grads = _outputs_and_grads(model, x, fused=True)
    model.zero_grad()
    with fused_lora(model, in_base_dtype=True):
        y_base = model(x)
        y_base.square().mean().backward()
    assert torch.equal(y_base, y)
    for name, grad in grads.items():
        assert torch.equal(model.get_parameter(name).grad, grad), name
