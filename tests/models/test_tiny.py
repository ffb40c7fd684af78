"""Tiny local models and the local tokenizer (loading them: tests/models/test_loading.py)."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from graft.models.loading import load_tokenizer
from graft.models.tiny import ARCHS, VLLM_CPU_HEAD_DIMS, build_tiny_model, tiny_config
from graft.models.tokenizer import IM_END, IM_START, PAD_TOKEN, pad_vocabulary, train_tokenizer

TINY = {"hidden": 64, "layers": 2}


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return train_tokenizer()


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("models") / "qwen2", **TINY)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_model_loads_with_auto_classes_and_gives_logits(tmp_path, arch):
    path = build_tiny_model(tmp_path / arch, arch=arch, **TINY)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    batch = tok(["What is 12 + 7?", "Hello"], return_tensors="pt", padding=True)
    with torch.no_grad():
        logits_BTV = model(**batch).logits
    assert logits_BTV.shape == (2, batch["input_ids"].shape[1], len(tok))
    assert model.config.model_type == arch
    assert model.config.vocab_size == len(tok) == 1024
    assert not model.config.tie_word_embeddings
    assert model.config.max_position_embeddings == 2048
    assert (model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id) == (
        tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    )
    assert model.generation_config.eos_token_id == tok.convert_tokens_to_ids(IM_END)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_weights_are_float32_safetensors(qwen2_dir):
    tensors = load_file(qwen2_dir / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.float32}
    assert "lm_head.weight" in tensors  # untied


@pytest.mark.parametrize("hidden", [32, 64, 96, 128, 160, 192, 256, 320, 384, 512, 1024])
def test_head_dim_is_supported_by_vllm_cpu(tokenizer, hidden):
    config = tiny_config(tokenizer, hidden=hidden)
    assert config.head_dim >= 32
    assert config.head_dim in VLLM_CPU_HEAD_DIMS
    # vLLM's Qwen2 derives head_dim as hidden // num_heads: both must agree.
    assert config.num_attention_heads * config.head_dim == hidden
    assert config.num_attention_heads % config.num_key_value_heads == 0


def test_head_dim_is_64_for_large_hidden(tokenizer):
    assert tiny_config(tokenizer, hidden=1024).head_dim == 64
    assert tiny_config(tokenizer, hidden=128).head_dim == 32


@pytest.mark.parametrize("hidden", [0, 16, 48, 100])
def test_bad_hidden_raises_and_writes_nothing(tmp_path, hidden):
    with pytest.raises(ValueError, match=f"hidden={hidden}.*multiple of 32"):
        build_tiny_model(tmp_path / "m", hidden=hidden, layers=1)
    assert list(tmp_path.iterdir()) == []


def test_unknown_arch_lists_supported(tmp_path):
    with pytest.raises(ValueError, match="'gpt2'.*llama.*qwen2"):
        build_tiny_model(tmp_path / "m", arch="gpt2", **TINY)


def test_benchmark_model_is_about_100m_params(tokenizer):
    config = tiny_config(tokenizer, hidden=1024, layers=8)
    with torch.device("meta"):
        model = ARCHS["qwen2"][1](config)
    num_params = sum(p.numel() for p in model.parameters())
    assert 85e6 < num_params < 115e6


def test_same_seed_gives_identical_weights(tmp_path, qwen2_dir):
    again = load_file(build_tiny_model(tmp_path / "again", **TINY) / "model.safetensors")
    first = load_file(qwen2_dir / "model.safetensors")
    assert again.keys() == first.keys()
    assert all(torch.equal(again[name], first[name]) for name in first)


def test_different_seeds_give_different_weights(tmp_path, qwen2_dir):
    other = load_file(build_tiny_model(tmp_path / "other", seed=1, **TINY) / "model.safetensors")
    first = load_file(qwen2_dir / "model.safetensors")
    for name in ["model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.q_proj.weight"]:
        assert not torch.equal(other[name], first[name]), name


def test_build_leaves_caller_rng_untouched(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "m", **TINY)
    assert torch.equal(torch.rand(4), expected)


def test_tokenizer_training_is_deterministic(tmp_path):
    train_tokenizer().save_pretrained(tmp_path / "a")
    train_tokenizer().save_pretrained(tmp_path / "b")
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()


def test_tokenizer_special_tokens(tokenizer):
    assert len(tokenizer) == 1024
    assert tokenizer.pad_token == PAD_TOKEN
    assert tokenizer.eos_token == IM_END
    ids = tokenizer.encode(f"{IM_START}user\nhi{IM_END}")
    assert ids[0] == tokenizer.convert_tokens_to_ids(IM_START)
    assert ids[-1] == tokenizer.eos_token_id
    # encode() must not add a bos/eos of its own.
    assert tokenizer.encode("hi") == tokenizer.encode("hi", add_special_tokens=False)


@pytest.mark.parametrize(
    "text",
    [
        "What is 123 + 45? 168",
        "The cat found the red box yesterday.",
        "  leading spaces, tabs\tand\n\nnewlines  ",
        "Numbers: 0 007 -42 3.14159 1,000,000",
        "Unicode: café, naïve, 東京, 😀",
    ],
)
def test_tokenizer_round_trip(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_digits_are_one_token_each(tokenizer):
    tokens = tokenizer.tokenize("What is 123 + 45? 168")
    assert [t for t in tokens if any(c.isdigit() for c in t)] == list("12345168")
    # No token in the vocabulary holds a digit next to anything else.
    for token in tokenizer.get_vocab():
        if any(c.isdigit() for c in token):
            assert len(token) == 1, token


def test_chat_template_with_generation_prompt(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert without.endswith("<|im_end|>\n")


def test_saved_tokenizer_matches_trained_one(qwen2_dir, tokenizer):
    loaded = load_tokenizer(qwen2_dir)
    text = "What is 9 * 9? 81"
    assert loaded.encode(text) == tokenizer.encode(text)
    assert loaded.chat_template == tokenizer.chat_template


def test_existing_non_empty_out_dir_is_refused(tmp_path):
    out_dir = tmp_path / "m"
    out_dir.mkdir()
    (out_dir / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        build_tiny_model(out_dir, **TINY)
    assert [p.name for p in out_dir.iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_existing_empty_out_dir_is_filled(tmp_path):
    (tmp_path / "m").mkdir()
    assert (build_tiny_model(tmp_path / "m", **TINY) / "config.json").is_file()


def test_failed_build_leaves_nothing_behind(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise OSError("disk full")

    # The model is already written into the temporary directory when the tokenizer save fails.
    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", fail)
    with pytest.raises(OSError, match="disk full"):
        build_tiny_model(tmp_path / "m", **TINY)
    assert list(tmp_path.iterdir()) == []


def test_padded_vocabulary_encodes_alike_and_decodes_every_id(tokenizer, tmp_path):
    """A real-vocabulary model samples every id: each decodes, and text encodes as before."""
    padded = pad_vocabulary(tokenizer, 151_936)
    assert len(padded) == 151_936
    text = f"{IM_START}user\nWhat is 12+7?{IM_END}\n"
    assert padded.encode(text) == tokenizer.encode(text)
    assert padded.decode([len(tokenizer), 151_935]) == f"<|filler_{len(tokenizer)}|><|filler_151935|>"
    assert (padded.eos_token_id, padded.pad_token_id) == (tokenizer.eos_token_id, tokenizer.pad_token_id)
    padded.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert len(loaded) == 151_936 and loaded.encode(text) == tokenizer.encode(text)
    assert loaded.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    with pytest.raises(ValueError, match="cannot pad"):
        pad_vocabulary(tokenizer, len(tokenizer) - 1)
