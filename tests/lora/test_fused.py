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


def _policy(dtype=torch.float32):
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["up", "down"])
    model = peft.get_peft_model(_Tiny().to(dtype), config, adapter_name=ADAPTER_NAME)
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
