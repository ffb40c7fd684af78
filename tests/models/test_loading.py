"""graft.models.loading: dtype names, model directories, models and tokenizers, a model's dtype."""

import shutil

import pytest
import torch
from huggingface_hub import constants
from transformers import PreTrainedTokenizerBase

from graft.lora.attach import attach_lora
from graft.models.loading import (
    load_model,
    load_tokenizer,
    model_dtype,
    require_model_dir,
    resolve_dtype,
    resolve_model_path,
)
from graft.models.packaged import PACKAGED_MODELS, packaged_model_dir
from tests.helpers import hf_cache_with


@pytest.mark.parametrize(
    "name, dtype",
    [("float32", torch.float32), ("fp32", torch.float32), ("bfloat16", torch.bfloat16),
     ("bf16", torch.bfloat16), ("float16", torch.float16), ("fp16", torch.float16)],
)
def test_resolve_dtype(name, dtype):
    assert resolve_dtype(name) is dtype


@pytest.mark.parametrize("name", ["float64", "int8", "FP32", ""])
def test_resolve_dtype_rejects_unknown(name):
    with pytest.raises(ValueError, match="allowed.*bfloat16"):
        resolve_dtype(name)


def test_require_model_dir(tiny_model_dirs, tmp_path):
    assert require_model_dir(str(tiny_model_dirs["qwen2"])) == tiny_model_dirs["qwen2"]
    with pytest.raises(ValueError, match="does not exist"):
        require_model_dir(tmp_path / "nope")
    (tmp_path / "config.json").mkdir()  # a directory named config.json is not a config file
    with pytest.raises(ValueError, match=f"model directory {tmp_path} has no config.json"):
        require_model_dir(tmp_path)


@pytest.fixture
def hub_cache(tiny_model_dirs, tmp_path, monkeypatch):
    """A local Hugging Face cache holding the tiny qwen2 model as `graft-test/tiny`; its snapshot dir."""
    snapshot = hf_cache_with(tmp_path / "hub", "graft-test/tiny", tiny_model_dirs["qwen2"])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return snapshot


def test_a_cached_hub_id_loads_from_its_snapshot(hub_cache, tiny_model_dirs):
    assert str(require_model_dir("graft-test/tiny")) == hub_cache
    tokenizer = load_tokenizer("graft-test/tiny")
    assert tokenizer.decode(tokenizer("12 + 7")["input_ids"]) == "12 + 7"
    want = load_model(tiny_model_dirs["qwen2"]).state_dict()
    got = load_model("graft-test/tiny").state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_hub_id_missing_from_the_cache_says_how_to_get_it(hub_cache, tmp_path):
    for load in (require_model_dir, load_tokenizer, load_model):
        with pytest.raises(ValueError, match=r"graft-test/other is neither a local directory, a packaged model "
                                             rf"\({', '.join(sorted(PACKAGED_MODELS))}\) nor a model in the "
                                             r"Hugging Face cache .*hub: .* download it first "
                                             r"\(`hf download graft-test/other`\)"):
            load("graft-test/other")


def test_an_unknown_name_names_the_packaged_models(hub_cache):
    """A mistyped packaged name is told which names graft ships, not only sent to a model hub."""
    with pytest.raises(ValueError, match=r"^smollm3 is neither .* a packaged model \(gemma3-270m, smollm2\) nor"):
        resolve_model_path("smollm3")


def test_a_packaged_model_s_name_resolves_to_its_converted_directory():
    """`model.path: smollm2` is the directory `graft model smollm2` converts; the packaged models' tests
    convert it into the same cache, so this finds it there."""
    path = require_model_dir("smollm2")
    assert path == packaged_model_dir("smollm2") and (path / "config.json").is_file()


def test_an_existing_relative_directory_wins_over_a_hub_id(hub_cache, tiny_model_dirs, tmp_path, monkeypatch):
    shutil.copytree(tiny_model_dirs["llama"], tmp_path / "graft-test" / "tiny")
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("graft-test/tiny").resolve() == (tmp_path / "graft-test" / "tiny").resolve()


def test_an_existing_directory_named_like_a_packaged_model_wins(tiny_model_dirs, tmp_path, monkeypatch):
    """A path that exists is a path: a user's own `smollm2/` is not swapped for the packaged model."""
    shutil.copytree(tiny_model_dirs["llama"], tmp_path / "smollm2")
    monkeypatch.chdir(tmp_path)
    assert require_model_dir("smollm2").resolve() == (tmp_path / "smollm2").resolve()


def test_load_model_in_bf16_eval_mode(tiny_model_dirs):
    model = load_model(tiny_model_dirs["qwen2"], dtype="bf16")
    assert model_dtype(model) is torch.bfloat16
    assert not model.training


@pytest.mark.parametrize("dtype, expected", [("float32", torch.float32), ("float16", torch.float16)])
def test_load_model_dtype_applies_to_every_weight(tiny_model_dirs, dtype, expected):
    model = load_model(tiny_model_dirs["llama"], dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {expected}
    assert not any(m.training for m in model.modules())


def test_load_model_rejects_missing_or_non_model_dir(tmp_path):
    with pytest.raises(ValueError, match="nope"):
        load_model(tmp_path / "nope")
    with pytest.raises(ValueError, match="config.json"):
        load_model(tmp_path)


def test_load_model_rejects_an_unknown_dtype(tiny_model_dirs):
    with pytest.raises(ValueError, match="unknown dtype 'float64'"):
        load_model(tiny_model_dirs["qwen2"], dtype="float64")


def test_load_tokenizer(tiny_model_dirs, tmp_path):
    tokenizer = load_tokenizer(tiny_model_dirs["qwen2"])
    assert isinstance(tokenizer, PreTrainedTokenizerBase)
    assert tokenizer.decode(tokenizer("12 + 7")["input_ids"]) == "12 + 7"
    with pytest.raises(ValueError, match="model directory .*nope does not exist"):
        load_tokenizer(tmp_path / "nope")
    (tmp_path / "no-config").mkdir()
    with pytest.raises(ValueError, match="model directory .*no-config has no config.json"):
        load_tokenizer(tmp_path / "no-config")


def test_model_dtype_follows_the_bulk_of_weights():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64).to(torch.bfloat16), torch.nn.Linear(64, 2))
    assert model_dtype(model) is torch.bfloat16


def test_model_dtype_of_a_bf16_base_with_fp32_lora_is_bf16(tiny_model_dirs):
    model = attach_lora(load_model(tiny_model_dirs["qwen2"], dtype="bfloat16"), rank=4, alpha=8)
    assert {p.dtype for n, p in model.named_parameters() if ".lora_" in n} == {torch.float32}
    assert model_dtype(model) is torch.bfloat16


def test_model_dtype_ignores_integer_parameters_and_needs_float_weights():
    model = torch.nn.Embedding(4, 2).to(torch.float16)
    model.register_parameter("count", torch.nn.Parameter(torch.zeros(1000, dtype=torch.int64), requires_grad=False))
    assert model_dtype(model) is torch.float16
    with pytest.raises(AssertionError, match="no floating-point parameters"):
        model_dtype(torch.nn.ReLU())
