"""graft.lora.export and `graft export`: sharded safetensors, a loadable merged model, atomic failure.

Suffixes: _BTV logits [batch, tokens, vocab].
"""

import json
import os
import re
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import safetensors.torch
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from graft.cli import main
from graft.lora.adapter_io import ADAPTER_WEIGHTS, save_adapter
from graft.lora.export import SAFE_INDEX, save_merged_model, write_safetensors_shards
from graft.lora.merge import iter_merged_weights, merged_layout
from graft.lora.stream_write import TensorStream
from graft.models.loading import load_model
from tests.helpers import trained_like_peft_model

ARCHS = ["qwen2", "llama"]
REPO_ROOT = Path(__file__).resolve().parents[2]
SHARD_NAME = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dirs, tmp_path_factory) -> dict[str, Path]:
    """arch -> a non-zero LoRA adapter (all linear layers) saved with graft's save_adapter."""
    root = tmp_path_factory.mktemp("adapters")
    return {arch: save_adapter(trained_like_peft_model(tiny_model_dirs[arch]), root / arch) for arch in ARCHS}


def _logits(model, input_ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def _export(base, adapter, out, *extra) -> int:
    return main(["export", "--base", str(base), "--adapter", str(adapter), "--out", str(out), *extra])


def _leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


# --- write_safetensors_shards / save_merged_model ------------------------------------------------

def test_small_max_shard_bytes_writes_numbered_shards_and_a_complete_index(tiny_model_dirs, tmp_path):
    model = trained_like_peft_model(tiny_model_dirs["qwen2"])
    expected = dict(iter_merged_weights(model))
    max_shard_bytes = 100_000  # the 1024x64 fp32 embedding and head (256 KiB) get a shard each

    total = write_safetensors_shards(iter_merged_weights(model), tmp_path, max_shard_bytes=max_shard_bytes)

    index = json.loads((tmp_path / SAFE_INDEX).read_text())
    shard_files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*shard_files, SAFE_INDEX])  # no .tmp left
    assert len(shard_files) > 2
    numbers = [SHARD_NAME.fullmatch(name).groups() for name in shard_files]
    assert [int(i) for i, _ in numbers] == list(range(1, len(shard_files) + 1))
    assert {int(n) for _, n in numbers} == {len(shard_files)}
    assert index["weight_map"].keys() == expected.keys()
    assert set(index["weight_map"].values()) == set(shard_files)
    assert total == index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in expected.values())
    for name in shard_files:
        shard = safetensors.torch.load_file(tmp_path / name)
        assert set(shard) == {k for k, f in index["weight_map"].items() if f == name}
        shard_bytes = sum(t.numel() * t.element_size() for t in shard.values())
        assert shard_bytes <= max_shard_bytes or len(shard) == 1, name
        for key, tensor in shard.items():
            assert torch.equal(tensor, expected[key]), key


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_shard_bytes", [2 << 30, 100_000, 1])
def test_a_stream_with_its_layout_is_written_tensor_by_tensor_into_save_files_bytes(tiny_model_dirs, tmp_path,
                                                                                   dtype, max_shard_bytes):
    """Merged weights written one tensor at a time (header first, each tensor at its offset) are the
    files `save_file` writes from whole shards, byte for byte; the writer holds one tensor, not a shard."""
    model = trained_like_peft_model(tiny_model_dirs["qwen2"])
    (tmp_path / "whole").mkdir()
    (tmp_path / "streamed").mkdir()
    refs, alive = [], []  # how many earlier tensors are still referenced when the next one comes

    def watched():
        for name, tensor in iter_merged_weights(model, dtype):
            alive.append(sum(ref() is not None for ref in refs))
            refs.append(weakref.ref(tensor))
            yield name, tensor
            del tensor

    whole = write_safetensors_shards(iter_merged_weights(model, dtype), tmp_path / "whole", max_shard_bytes)
    streamed = write_safetensors_shards(TensorStream(merged_layout(model, dtype), watched()),
                                        tmp_path / "streamed", max_shard_bytes)
    files = {p.name: p.read_bytes() for p in (tmp_path / "whole").iterdir()}
    assert streamed == whole and {p.name: p.read_bytes() for p in (tmp_path / "streamed").iterdir()} == files
    assert len(alive) == len(merged_layout(model, dtype)) and max(alive) <= 1, alive


def test_a_stream_that_breaks_its_layout_is_refused(tiny_model_dirs, tmp_path):
    model = trained_like_peft_model(tiny_model_dirs["qwen2"])
    layout = merged_layout(model)
    swapped = [layout[1], layout[0], *layout[2:]]
    with pytest.raises(ValueError, match="does not match its layout"):
        write_safetensors_shards(TensorStream(swapped, iter_merged_weights(model)), tmp_path)
    with pytest.raises(ValueError, match="does not match its layout"):
        write_safetensors_shards(TensorStream(layout, list(iter_merged_weights(model))[:-1]), tmp_path)
    with pytest.raises(ValueError, match="runs past its layout"):
        write_safetensors_shards(TensorStream(layout[:-1], iter_merged_weights(model)), tmp_path)


def test_sharded_merged_model_loads_with_from_pretrained(tiny_model_dirs, tmp_path, input_ids):
    model = trained_like_peft_model(tiny_model_dirs["llama"])
    expected = dict(iter_merged_weights(model))

    save_merged_model(model, tmp_path / "merged", max_shard_bytes=100_000)

    assert (tmp_path / "merged" / SAFE_INDEX).is_file()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    state = loaded.state_dict()
    assert state.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(state[key], tensor), key
    torch.testing.assert_close(_logits(loaded, input_ids), _logits(model, input_ids), rtol=0, atol=1e-4)


def test_one_shard_is_named_model_safetensors(tiny_model_dirs, tmp_path):
    model = trained_like_peft_model(tiny_model_dirs["qwen2"])
    total = write_safetensors_shards(iter_merged_weights(model), tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]
    tensors = safetensors.torch.load_file(tmp_path / "model.safetensors")
    assert total == sum(t.numel() * t.element_size() for t in tensors.values())
    for key, tensor in iter_merged_weights(model):
        assert torch.equal(tensors.pop(key), tensor), key
    assert not tensors


# --- graft export --------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_export_fp32_matches_peft_merge_and_unload(tiny_model_dirs, adapter_dirs, tmp_path, arch, input_ids, capsys):
    out = tmp_path / "merged"
    assert _export(tiny_model_dirs[arch], adapter_dirs[arch], out) == 0
    assert "wrote merged model" in capsys.readouterr().out

    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer("What is 12 + 7?")["input_ids"] == AutoTokenizer.from_pretrained(tiny_model_dirs[arch])(
        "What is 12 + 7?")["input_ids"]
    assert {p.dtype for p in exported.parameters()} == {torch.float32}  # the base checkpoint's dtype
    peft_merged = PeftModel.from_pretrained(load_model(tiny_model_dirs[arch]), adapter_dirs[arch]).merge_and_unload()
    base_BTV = _logits(load_model(tiny_model_dirs[arch]), input_ids)
    peft_BTV = _logits(peft_merged, input_ids)

    assert (peft_BTV - base_BTV).abs().max() > 0.1  # the adapter matters
    # Measured max |Δ| 0.0 for both archs (PEFT's fp32 merge and graft's agree to the last bit here).
    assert (_logits(exported, input_ids) - peft_BTV).abs().max() <= 1e-5


@pytest.mark.parametrize(("arch", "via"), [("llama", "main"), ("qwen2", "installed-command")])
def test_export_bf16_is_the_fp32_merge_rounded_once(tiny_model_dirs, adapter_dirs, tmp_path, capsys, arch, via):
    fp32_out, bf16_out = tmp_path / "fp32", tmp_path / "bf16"
    assert _export(tiny_model_dirs[arch], adapter_dirs[arch], fp32_out) == 0
    argv = ["export", "--base", str(tiny_model_dirs[arch]), "--adapter", str(adapter_dirs[arch]),
            "--out", str(bf16_out), "--dtype", "bfloat16"]
    if via == "main":
        assert main(argv) == 0
    else:
        # The console script of this venv, importing graft from this checkout; exit status checked.
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        result = subprocess.run([str(Path(sys.executable).parent / "graft"), *argv], env=env,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert "wrote merged model" in result.stdout

    assert json.loads((bf16_out / "config.json").read_text())["dtype"] == "bfloat16"
    bf16 = safetensors.torch.load_file(bf16_out / "model.safetensors")
    fp32 = safetensors.torch.load_file(fp32_out / "model.safetensors")
    assert bf16.keys() == fp32.keys()
    for key, tensor in bf16.items():
        # Both exports sum in fp32 from the fp32 base: the bf16 one is that sum rounded once.
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, fp32[key].to(torch.bfloat16)), key
    loaded = AutoModelForCausalLM.from_pretrained(bf16_out)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    AutoTokenizer.from_pretrained(bf16_out)


def test_export_into_an_existing_empty_directory(tiny_model_dirs, adapter_dirs, tmp_path):
    out = tmp_path / "merged"
    out.mkdir()
    assert _export(tiny_model_dirs["llama"], adapter_dirs["llama"], out) == 0
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert not _leftovers(tmp_path)


# --- failures leave nothing behind ---------------------------------------------------------------

def _bad_adapter(kind: str, adapter: Path, model_dir: Path, tmp_path: Path) -> tuple[Path, str]:
    """(a directory that is not a usable adapter, regex of the problem the error must name)."""
    if kind == "model-dir":
        return model_dir, r"is not a PEFT adapter directory: adapter_config\.json is missing"
    if kind == "missing":
        return tmp_path / "no-such-adapter", r"not a directory, so not a PEFT adapter"
    bad = tmp_path / f"{kind}-adapter"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    data = (adapter / ADAPTER_WEIGHTS).read_bytes()
    (bad / ADAPTER_WEIGHTS).write_bytes(b"not a safetensors file" * 8 if kind == "corrupt" else data[: len(data) // 2])
    return bad, rf"corrupt safetensors file .*{kind}-adapter/adapter_model\.safetensors"


@pytest.mark.parametrize("kind", ["corrupt", "truncated", "model-dir", "missing"])
def test_export_of_a_bad_adapter_fails_and_writes_nothing(tiny_model_dirs, adapter_dirs, tmp_path, capsys, kind):
    bad, problem = _bad_adapter(kind, adapter_dirs["qwen2"], tiny_model_dirs["qwen2"], tmp_path)
    out = tmp_path / "exports" / "merged"
    capsys.readouterr()

    assert _export(tiny_model_dirs["qwen2"], bad, out) == 2

    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("graft: error: "), captured.err
    assert re.search(problem, lines[0]), lines[0]
    assert str(bad) in lines[0]
    assert not out.exists()
    assert not out.parent.exists() or not _leftovers(out.parent)
    assert not _leftovers(tmp_path)


def test_export_failing_while_writing_leaves_nothing(tiny_model_dirs, adapter_dirs, tmp_path, capsys, monkeypatch):
    out = tmp_path / "merged"
    written_before_failure = []

    def failing_merge(model, dtype=None):
        yield from list(iter_merged_weights(model, dtype))[:3]
        written_before_failure.extend(tmp_path.glob(".merged.tmp-*/*"))
        raise ValueError("simulated failure half way through the merge")

    def small_shards(named_tensors, out_dir, max_shard_bytes):
        return write_safetensors_shards(named_tensors, out_dir, max_shard_bytes=100_000)

    monkeypatch.setattr("graft.lora.export.iter_merged_weights", failing_merge)
    monkeypatch.setattr("graft.lora.export.write_safetensors_shards", small_shards)

    assert _export(tiny_model_dirs["qwen2"], adapter_dirs["qwen2"], out, "--dtype", "bfloat16") == 2

    assert written_before_failure  # a shard was already on disk in the temporary directory
    assert capsys.readouterr().err.strip() == "graft: error: simulated failure half way through the merge"
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_export_refuses_an_existing_non_empty_out_and_leaves_it_untouched(tiny_model_dirs, adapter_dirs, tmp_path,
                                                                          capsys):
    out = tmp_path / "merged"
    out.mkdir()
    (out / "keep.txt").write_text("precious")

    assert _export(tiny_model_dirs["qwen2"], adapter_dirs["qwen2"], out) == 2

    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("graft: error: ") and "already exists" in lines[0], lines
    assert str(out) in lines[0]
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "precious"
    assert not _leftovers(tmp_path)


def test_export_of_a_missing_base_without_dtype_is_a_clean_error(adapter_dirs, tmp_path, capsys):
    assert _export(tmp_path / "no-such-model", adapter_dirs["qwen2"], tmp_path / "merged") == 2
    assert capsys.readouterr().err.startswith("graft: error: ")


def test_export_to_an_existing_file_is_a_clean_error(tiny_model_dirs, adapter_dirs, tmp_path, capsys):
    (tmp_path / "merged").write_text("a file")
    assert _export(tiny_model_dirs["qwen2"], adapter_dirs["qwen2"], tmp_path / "merged") == 2
    assert capsys.readouterr().err.startswith("graft: error: ")
    assert (tmp_path / "merged").read_text() == "a file"


# --- a model on a GPU ----------------------------------------------------------------------------

def _read_shards(out_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(out_dir.glob("*.safetensors")):
        tensors.update(safetensors.torch.load_file(file))
    return tensors


@pytest.mark.gpu
@pytest.mark.parametrize("streamed", [True, False], ids=["tensor-stream", "save_file"])
def test_merged_weights_of_a_cuda_model_are_written_from_cpu_copies(tiny_model_dirs, tmp_path, monkeypatch, streamed):
    model = trained_like_peft_model(tiny_model_dirs["qwen2"]).cuda()
    expected = {name: tensor.cpu() for name, tensor in iter_merged_weights(model, torch.bfloat16)}
    devices = []
    save_file = safetensors.torch.save_file

    def recording_save_file(tensors, *args, **kwargs):
        devices.extend(tensor.device.type for tensor in tensors.values())
        return save_file(tensors, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", recording_save_file)
    weights = iter_merged_weights(model, torch.bfloat16)
    stream = TensorStream(merged_layout(model, torch.bfloat16), weights) if streamed else weights
    write_safetensors_shards(stream, tmp_path, max_shard_bytes=1 << 16)

    written = _read_shards(tmp_path)
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[name], tensor) for name, tensor in expected.items())
    assert devices == ([] if streamed else ["cpu"] * len(expected))
