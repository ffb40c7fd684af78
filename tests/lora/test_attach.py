import pytest
import torch

from graft.lora.attach import (
    adapter_disabled,
    attach_lora,
    count_parameters,
    lora_modules,
    lora_parameters,
)
from graft.models.loading import load_model
from tests.helpers import randomize_lora

LINEAR = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def _adapted_leaves(model) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, _ in lora_modules(model)}


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_all_linear_adapts_every_linear_but_the_head(tiny_model_dirs, arch):
    model = attach_lora(load_model(tiny_model_dirs[arch]), rank=4, alpha=8)
    assert _adapted_leaves(model) == LINEAR
    assert len(list(lora_modules(model))) == 2 * len(LINEAR)


def test_target_list_and_exclude(tiny_model_dirs):
    model = attach_lora(load_model(tiny_model_dirs["qwen2"]), rank=4, alpha=8,
                        target_modules=["q_proj", "v_proj"], exclude_modules=["model.layers.1.self_attn.v_proj"])
    names = {name.removeprefix("base_model.model.") for name, _ in lora_modules(model)}
    assert names == {"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj",
                     "model.layers.1.self_attn.q_proj"}


def test_single_string_target_is_one_module_name(tiny_model_dirs):
    model = attach_lora(load_model(tiny_model_dirs["qwen2"]), rank=4, alpha=8, target_modules="q_proj")
    assert _adapted_leaves(model) == {"q_proj"}


def test_module_lists_are_normalised_like_the_config(tiny_model_dirs):
    model = attach_lora(load_model(tiny_model_dirs["qwen2"]), rank=4, alpha=8, target_modules=("q_proj", "v_proj"),
                        exclude_modules="model.layers.1.self_attn.v_proj")  # a string: one name, not characters
    assert len(list(lora_modules(model))) == 3
    with pytest.raises(ValueError, match="target_modules must not be an empty list"):
        attach_lora(load_model(tiny_model_dirs["qwen2"]), rank=4, alpha=8, target_modules=[])
    with pytest.raises(ValueError, match="exclude_modules must be a module name or a list of module names"):
        attach_lora(load_model(tiny_model_dirs["qwen2"]), rank=4, alpha=8, exclude_modules=[3])


@pytest.mark.parametrize("targets", [["q_proj", "qkv_proj"], "mlp_in"])
def test_unknown_target_module_is_named(tiny_model_dirs, targets):
    model = load_model(tiny_model_dirs["qwen2"])
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"unknown target module '(qkv_proj|mlp_in)'.*q_proj"):
        attach_lora(model, rank=4, alpha=8, target_modules=targets)
    # Nothing was attached: same parameter names, same values.
    assert before.keys() == dict(model.named_parameters()).keys()
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_non_linear_target_and_unknown_exclude_are_rejected(tiny_model_dirs):
    model = load_model(tiny_model_dirs["qwen2"])
    with pytest.raises(ValueError, match="embed_tokens.*nn.Linear only"):
        attach_lora(model, rank=4, alpha=8, target_modules=["embed_tokens"])
    with pytest.raises(ValueError, match="unknown exclude module 'v_prj'"):
        attach_lora(model, rank=4, alpha=8, exclude_modules=["v_prj"])


def test_base_is_frozen_and_only_lora_trains(tiny_model_dirs):
    model = attach_lora(load_model(tiny_model_dirs["llama"]), rank=4, alpha=8)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(lora_parameters(model))
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    n_trainable, n_total = count_parameters(model)
    assert 0 < n_trainable < n_total


def test_adapter_disabled_is_the_base_model(tiny_model_dirs, input_ids):
    base_logits = load_model(tiny_model_dirs["qwen2"])(input_ids).logits
    model = attach_lora(load_model(tiny_model_dirs["qwen2"]), rank=4, alpha=8)
    randomize_lora(model)
    with torch.no_grad():
        policy = model(input_ids).logits
        with adapter_disabled(model):
            reference = model(input_ids).logits
        policy_again = model(input_ids).logits
    assert torch.equal(reference, base_logits)
    assert not torch.allclose(policy, reference)
    assert torch.equal(policy, policy_again)  # re-enabled on exit


def test_lora_init_is_seeded(tiny_model_dirs):
    a = attach_lora(load_model(tiny_model_dirs["qwen2"]), rank=4, alpha=8, seed=3)
    b = attach_lora(load_model(tiny_model_dirs["qwen2"]), rank=4, alpha=8, seed=3)
    pa, pb = lora_parameters(a), lora_parameters(b)
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
