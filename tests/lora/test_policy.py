import pytest
import torch

from graft.config import LoraConfig, ModelConfig
from graft.lora.attach import attach_lora, lora_parameters
from graft.lora.policy import build_policy
from graft.models.loading import load_model

LORA = LoraConfig(rank=4, alpha=12, dropout=0.25, target_modules=["q_proj", "v_proj", "down_proj"],
                  exclude_modules=["model.layers.1.mlp.down_proj"])


def test_build_policy_is_attach_lora_with_every_config_field(tiny_model_dirs):
    model_cfg = ModelConfig(path=str(tiny_model_dirs["llama"]), dtype="bfloat16")
    policy = build_policy(model_cfg, LORA, seed=5)
    expected = attach_lora(load_model(model_cfg.path, dtype=model_cfg.dtype), rank=LORA.rank, alpha=LORA.alpha,
                           dropout=LORA.dropout, target_modules=LORA.target_modules,
                           exclude_modules=LORA.exclude_modules, seed=5)
    got, want = policy.state_dict(), expected.state_dict()
    assert got.keys() == want.keys()
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)
    assert policy.peft_config["default"].to_dict() == expected.peft_config["default"].to_dict()
    config = policy.peft_config["default"]
    assert (config.r, config.lora_alpha, config.lora_dropout) == (4, 12, 0.25)
    assert config.target_modules == {"q_proj", "v_proj", "down_proj"}
    assert config.exclude_modules == {"model.layers.1.mlp.down_proj"}
    assert next(iter(policy.get_base_model().parameters())).dtype == torch.bfloat16


def test_build_policy_seed_fixes_the_lora_init(tiny_model_dirs):
    model_cfg = ModelConfig(path=str(tiny_model_dirs["qwen2"]))
    a, b, c = (lora_parameters(build_policy(model_cfg, LORA, seed)) for seed in (1, 1, 2))
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not all(torch.equal(a[n], c[n]) for n in a)


def test_build_policy_needs_a_model_path():
    with pytest.raises(ValueError, match="model.path is required"):
        build_policy(ModelConfig(), LORA, seed=0)
