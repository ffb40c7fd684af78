import json
import shutil

import peft
import pytest
import safetensors.torch
import torch

from graft.lora.adapter_io import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    AdapterError,
    load_adapter,
    load_adapter_weights,
    save_adapter,
)
from graft.lora.attach import attach_lora, lora_modules, lora_parameters
from graft.models.loading import load_model
from tests.helpers import is_peft_adapter, trained_like_peft_model


def _logits(model, input_ids):
    with torch.no_grad():
        return model(input_ids).logits


@pytest.fixture
def saved_adapter(tiny_model_dirs, tmp_path):
    """(model dir, adapter dir, the model that saved it) for a qwen2 tiny model."""
    model = trained_like_peft_model(tiny_model_dirs["qwen2"])
    return tiny_model_dirs["qwen2"], save_adapter(model, tmp_path / "adapter"), model


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_graft_saved_adapter_loads_in_peft_with_identical_logits(tiny_model_dirs, tmp_path, input_ids, arch):
    model = trained_like_peft_model(tiny_model_dirs[arch])
    save_adapter(model, tmp_path / "adapter")
    peft_model = peft.PeftModel.from_pretrained(load_model(tiny_model_dirs[arch]), tmp_path / "adapter")
    assert torch.equal(_logits(peft_model, input_ids), _logits(model, input_ids))


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_peft_saved_adapter_loads_in_graft_with_identical_logits(tiny_model_dirs, tmp_path, input_ids, arch):
    model = trained_like_peft_model(tiny_model_dirs[arch], target_modules=["q_proj", "up_proj"])
    model.save_pretrained(tmp_path / "peft_adapter")  # PEFT's own writer
    loaded = load_adapter(load_model(tiny_model_dirs[arch]), tmp_path / "peft_adapter")
    assert torch.equal(_logits(loaded, input_ids), _logits(model, input_ids))
    # And strictly into an existing graft model with the same LoRA settings.
    fresh = attach_lora(load_model(tiny_model_dirs[arch]), rank=8, alpha=16, target_modules=["q_proj", "up_proj"])
    load_adapter_weights(fresh, tmp_path / "peft_adapter")
    assert torch.equal(_logits(fresh, input_ids), _logits(model, input_ids))


def test_saved_files_use_peft_names_and_config_fields(saved_adapter):
    model_dir, adapter_dir, model = saved_adapter
    tensors = safetensors.torch.load_file(adapter_dir / ADAPTER_WEIGHTS)
    assert set(tensors) == {n.replace(".default.", ".") for n in lora_parameters(model)}
    assert all(k.startswith("base_model.model.model.layers.") and ".default." not in k for k in tensors)
    assert any(k.endswith("q_proj.lora_A.weight") for k in tensors)
    config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert config["r"] == 8 and config["lora_alpha"] == 16
    assert sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    assert config["base_model_name_or_path"] == str(model_dir)
    assert is_peft_adapter(adapter_dir)


def test_saved_dtype_defaults_to_the_base_dtype_and_is_configurable(tiny_model_dirs, tmp_path):
    model = attach_lora(load_model(tiny_model_dirs["llama"], dtype="bfloat16"), rank=4, alpha=8)
    assert next(iter(lora_parameters(model).values())).dtype == torch.float32  # PEFT keeps LoRA in fp32
    save_adapter(model, tmp_path / "default")
    save_adapter(model, tmp_path / "fp32", dtype=torch.float32)
    def dtypes(adapter_dir):
        return {t.dtype for t in safetensors.torch.load_file(adapter_dir / ADAPTER_WEIGHTS).values()}

    assert dtypes(tmp_path / "default") == {torch.bfloat16}
    assert dtypes(tmp_path / "fp32") == {torch.float32}


def test_save_refuses_to_overwrite_and_a_failed_save_leaves_nothing(saved_adapter, tmp_path, monkeypatch):
    _, adapter_dir, model = saved_adapter
    before = (adapter_dir / ADAPTER_WEIGHTS).read_bytes()
    with pytest.raises(ValueError, match="already exists"):
        save_adapter(model, adapter_dir)
    assert (adapter_dir / ADAPTER_WEIGHTS).read_bytes() == before

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", fail)
    with pytest.raises(OSError, match="disk full"):
        save_adapter(model, tmp_path / "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


def _modes(model) -> dict[str, bool]:
    return {name: module.training for name, module in model.named_modules()}


def test_load_adapter_with_dropout_matches_peft_from_pretrained(tiny_model_dirs, tmp_path, input_ids):
    model = trained_like_peft_model(tiny_model_dirs["qwen2"], dropout=0.5)
    save_adapter(model, tmp_path / "adapter")
    loaded = load_adapter(load_model(tiny_model_dirs["qwen2"]), tmp_path / "adapter")
    peft_model = peft.PeftModel.from_pretrained(load_model(tiny_model_dirs["qwen2"]), tmp_path / "adapter")
    assert _modes(loaded) == _modes(peft_model) and not any(_modes(loaded).values())
    first = _logits(loaded, input_ids)
    assert torch.equal(first, _logits(loaded, input_ids))  # dropout off: deterministic
    assert torch.equal(first, _logits(peft_model, input_ids))
    # Trainable, modes are left as PEFT's is_trainable=True leaves them (LoRA dropout on).
    loaded = load_adapter(load_model(tiny_model_dirs["qwen2"]), tmp_path / "adapter", trainable=True)
    peft_model = peft.PeftModel.from_pretrained(load_model(tiny_model_dirs["qwen2"]), tmp_path / "adapter",
                                                is_trainable=True)
    assert _modes(loaded) == _modes(peft_model) and loaded.training
    assert all(p.requires_grad for p in lora_parameters(loaded).values())


def test_save_without_lora_is_one_clear_error(tiny_model_dirs, tmp_path):
    with pytest.raises(AdapterError, match="Qwen2ForCausalLM is not a PEFT model with a LoRA adapter 'default'"):
        save_adapter(load_model(tiny_model_dirs["qwen2"]), tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()


def test_save_refuses_lora_on_an_embedding(tiny_model_dirs, tmp_path):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"], task_type="CAUSAL_LM")
    model = peft.get_peft_model(load_model(tiny_model_dirs["qwen2"]), config)
    with pytest.raises(AdapterError, match=r"LoRA on base_model\.model\.model\.embed_tokens \(Embedding\): "
                                           "graft reads and writes LoRA on nn.Linear modules only"):
        save_adapter(model, tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()


def test_is_peft_adapter(saved_adapter, tiny_model_dirs, tmp_path):
    assert is_peft_adapter(saved_adapter[1])
    assert not is_peft_adapter(tiny_model_dirs["qwen2"])
    assert not is_peft_adapter(tmp_path / "missing")
    (tmp_path / "half").mkdir()
    shutil.copy(saved_adapter[1] / ADAPTER_CONFIG, tmp_path / "half")
    assert not is_peft_adapter(tmp_path / "half")


# --- bad inputs: one clear error each, and nothing written into the model ------------------------

def _broken_copy(adapter_dir, tmp_path, edit):
    broken = tmp_path / "broken"
    shutil.copytree(adapter_dir, broken)
    edit(broken)
    return broken


def _edit_tensors(change):
    def edit(path):
        tensors = safetensors.torch.load_file(path / ADAPTER_WEIGHTS)
        change(tensors)
        safetensors.torch.save_file(tensors, path / ADAPTER_WEIGHTS)
    return edit


def _corrupt(path):
    data = (path / ADAPTER_WEIGHTS).read_bytes()
    (path / ADAPTER_WEIGHTS).write_bytes(data[: len(data) // 2])


def _drop_first(tensors):
    del tensors[sorted(tensors)[0]]


def _add_extra(tensors):
    tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_C.weight"] = torch.zeros(8, 64)


def _reshape_first(tensors):
    key = next(k for k in sorted(tensors) if "q_proj.lora_A" in k)
    tensors[key] = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] + 4)


def _add_nan(tensors):
    key = sorted(tensors)[0]
    tensors[key][0, 0] = float("nan")


def _pickle_only(path):
    (path / ADAPTER_WEIGHTS).rename(path / "adapter_model.bin")


def _not_an_adapter(path):
    (path / ADAPTER_CONFIG).unlink()


def _other_rank(path):
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    (path / ADAPTER_CONFIG).write_text(json.dumps({**config, "lora_alpha": 32}))


BAD_INPUTS = {
    "corrupt safetensors": (_corrupt, r"corrupt safetensors file .*adapter_model\.safetensors"),
    "missing tensor": (_edit_tensors(_drop_first), r"missing 1 LoRA tensor\(s\): base_model\.model\..*lora_"),
    "extra tensor": (_edit_tensors(_add_extra), r"1 unexpected tensor\(s\).*q_proj\.lora_C\.weight"),
    "wrong shape": (_edit_tensors(_reshape_first),
                    r"shape mismatch for module base_model\.model\.model\.layers\.0\.self_attn\.q_proj \(lora_A\): "
                    r"adapter has \(8, 68\), the base model needs \(8, 64\)"),
    "NaN weights": (_edit_tensors(_add_nan), r"contains NaN or infinite values"),
    "pickled weights": (_pickle_only, r"adapter_model\.bin: pickled weights are not loaded \(safetensors only\)"),
    "non-adapter directory": (_not_an_adapter, r"not a PEFT adapter directory: adapter_config\.json is missing"),
    "other alpha": (_other_rank, r"lora_alpha is 32 but the model's adapter has 16"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_adapter_into_existing_model_is_rejected_and_model_unchanged(saved_adapter, tiny_model_dirs, tmp_path,
                                                                         case):
    edit, message = BAD_INPUTS[case]
    broken = _broken_copy(saved_adapter[1], tmp_path, edit)
    model = trained_like_peft_model(tiny_model_dirs["qwen2"], seed=7)
    before = {n: p.clone() for n, p in lora_parameters(model).items()}
    with pytest.raises(AdapterError, match=message):
        load_adapter_weights(model, broken)
    assert all(torch.equal(before[n], p) for n, p in lora_parameters(model).items())


@pytest.mark.parametrize("case", ["corrupt safetensors", "missing tensor", "wrong shape", "non-adapter directory"])
def test_bad_adapter_onto_base_leaves_base_untouched(saved_adapter, tiny_model_dirs, tmp_path, case):
    edit, message = BAD_INPUTS[case]
    broken = _broken_copy(saved_adapter[1], tmp_path, edit)
    base = load_model(tiny_model_dirs["qwen2"])
    before = {n: p.clone() for n, p in base.named_parameters()}
    with pytest.raises(AdapterError, match=message):
        load_adapter(base, broken)
    assert not list(lora_modules(base))
    assert before.keys() == dict(base.named_parameters()).keys()
    assert all(torch.equal(before[n], p) for n, p in base.named_parameters())


def test_adapter_naming_an_unknown_target_module_is_rejected(saved_adapter, tiny_model_dirs, tmp_path):
    def rename_target(path):
        config = json.loads((path / ADAPTER_CONFIG).read_text())
        (path / ADAPTER_CONFIG).write_text(json.dumps({**config, "target_modules": ["q_proj", "wqkv"]}))

    broken = _broken_copy(saved_adapter[1], tmp_path, rename_target)
    base = load_model(tiny_model_dirs["qwen2"])
    with pytest.raises(AdapterError, match=r"adapter_config\.json: unknown target module 'wqkv'"):
        load_adapter(base, broken)
    assert not list(lora_modules(base))


def test_unsupported_peft_option_is_rejected(saved_adapter, tiny_model_dirs, tmp_path):
    def use_dora(path):
        config = json.loads((path / ADAPTER_CONFIG).read_text())
        (path / ADAPTER_CONFIG).write_text(json.dumps({**config, "use_dora": True}))

    broken = _broken_copy(saved_adapter[1], tmp_path, use_dora)
    with pytest.raises(AdapterError, match="unsupported LoRA option.*use_dora"):
        load_adapter(load_model(tiny_model_dirs["qwen2"]), broken)


@pytest.mark.gpu
def test_an_adapter_saved_from_a_cuda_model_loads_into_a_cuda_model(tiny_model_dirs, tmp_path, input_ids):
    trained = trained_like_peft_model(tiny_model_dirs["qwen2"]).cuda()
    path = save_adapter(trained, tmp_path / "adapter", dtype=torch.float32)
    saved = safetensors.torch.load_file(path / ADAPTER_WEIGHTS)
    assert saved.keys() and all(tensor.device.type == "cpu" for tensor in saved.values())

    fresh = attach_lora(load_model(tiny_model_dirs["qwen2"]), rank=8, alpha=16, seed=5).cuda()
    load_adapter_weights(fresh, path)
    for name, param in lora_parameters(fresh).items():
        assert param.device.type == "cuda", name
        assert torch.equal(param, lora_parameters(trained)[name]), name
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=input_ids.cuda()).logits, trained(input_ids=input_ids.cuda()).logits)


def test_a_sync_reads_the_layout_once_and_the_tensors_every_time(tiny_model_dirs):
    from graft.lora.adapter_io import adapter_config_dict, adapter_layout, adapter_state_dict
    from graft.sync.source import ModelSource

    model = trained_like_peft_model(tiny_model_dirs["qwen2"], rank=4, seed=2)
    source = ModelSource(model)
    weights = source.adapter()
    tensors, config = weights.converted(), weights.config
    before = {k: t.clone() for k, t in tensors.items()}
    assert config == adapter_config_dict(model) and adapter_layout(model) is adapter_layout(model)
    assert before.keys() == adapter_state_dict(model).keys()
    assert all(torch.equal(before[k], t) for k, t in adapter_state_dict(model).items())
    with torch.no_grad():  # an optimizer step: new values in the same parameters
        for param in lora_parameters(model).values():
            param.mul_(3).add_(0.5)
    after = source.adapter().converted()
    assert all(torch.equal(after[k], t) for k, t in adapter_state_dict(model).items())
    assert not any(torch.equal(after[k], before[k]) for k in before)
