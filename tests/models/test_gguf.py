"""GGUF bases: which paths name a GGUF file, and a wrong one is one `graft: error:` line before any server.

The files here are written with the `gguf` package itself (a tiny tensor, a header naming an
architecture), so each failure is a real file of that kind, not a mocked reader. Converting a real
model is tests/models/test_packaged_models.py's.
"""

import numpy as np
import pytest

from graft.cli import main
from graft.models.gguf import CONVERSION, DONE, added_special_tokens, check_gguf, converted_dir, gguf_file


def write_gguf(path, arch: str = "llama", add_bos: bool | None = None) -> None:
    from gguf import GGUFWriter

    writer = GGUFWriter(path, arch)
    writer.add_block_count(1)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.add_tensor("token_embd.weight", np.ones((64, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_which_paths_name_a_gguf_file(tmp_path):
    assert gguf_file(tmp_path / "m.gguf") == tmp_path / "m.gguf"  # by its suffix, existing or not
    one = tmp_path / "one"
    one.mkdir()
    write_gguf(one / "m.gguf")
    assert gguf_file(one) == one / "m.gguf"
    (one / "config.json").write_text("{}")
    assert gguf_file(one) is None  # a Hugging Face directory that also holds a GGUF file stays an HF directory
    two = tmp_path / "two"
    two.mkdir()
    write_gguf(two / "a.gguf")
    write_gguf(two / "b.gguf")
    with pytest.raises(ValueError, match="several GGUF files"):
        gguf_file(two)
    assert gguf_file(tmp_path) is None  # no GGUF file in it


def test_a_whole_gguf_of_a_readable_architecture_passes_the_check(tmp_path):
    write_gguf(tmp_path / "m.gguf", "llama")
    assert check_gguf(tmp_path / "m.gguf") == "llama"


def _not_a_model(path):
    path.write_bytes(b"PK\x03\x04" + bytes(4096))


def _truncated(path):
    write_gguf(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1024])


def _cut_in_the_header(path):
    write_gguf(path)
    path.write_bytes(path.read_bytes()[:40])


def _no_tensors(path):
    from gguf import GGUFWriter

    writer = GGUFWriter(path, "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


def _llama_header_without_a_model(path):
    write_gguf(path, "llama")  # one embedding, no tokenizer, no layers: nothing transformers can build


def _unsupported(path):
    write_gguf(path, "graftnet")


@pytest.mark.parametrize("make, message", [
    (_not_a_model, "is not a GGUF model file"),
    (_truncated, "is a truncated or damaged GGUF file"),
    (_cut_in_the_header, "is a truncated or damaged GGUF file"),
    (_no_tensors, "holds no tensors"),
    (_llama_header_without_a_model, "transformers could not convert this llama GGUF file"),
    (_unsupported, "GGUF architecture 'graftnet' cannot be read by transformers"),
])
def test_a_bad_gguf_is_one_line_before_any_server(tmp_path, capsys, monkeypatch, make, message):
    monkeypatch.setenv("GRAFT_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "model.gguf"
    make(bad)
    code = main(["eval", "-o", f"model.path={bad}", "--run-dir", str(tmp_path / "run")])
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("graft: converting")]
    assert code == 2 and len(err) == 1 and err[0].startswith(f"graft: error: {bad}") and message in err[0], err
    assert not (tmp_path / "run" / "logs").exists()  # no vLLM was launched
    assert not list((tmp_path / "cache").glob("gguf/*"))  # nothing half-converted is left in the cache


def test_a_missing_gguf_is_one_line(tmp_path, capsys):
    code = main(["eval", "-o", f"model.path={tmp_path / 'absent.gguf'}", "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"graft: error: GGUF file {tmp_path / 'absent.gguf'} does not exist"]


def test_a_first_conversion_says_what_it_does_before_it_starts(tmp_path, capsys, monkeypatch):
    """Converting runs once per file and takes minutes for a larger model: it is told on stderr first."""
    import graft.models.gguf as gguf_module
    from graft.models.loading import resolve_model_path

    write_gguf(tmp_path / "m.gguf", "llama")
    monkeypatch.setenv("GRAFT_CACHE", str(tmp_path / "cache"))
    converted = []
    monkeypatch.setattr(gguf_module, "_convert", lambda gguf, arch, target: converted.append((gguf, arch, target)))
    target = resolve_model_path(tmp_path / "m.gguf")
    assert converted == [(tmp_path / "m.gguf", "llama", target)]
    err = capsys.readouterr().err
    assert err.startswith("graft: converting m.gguf (llama, 0 MiB) to a Hugging Face directory at ") and "once" in err


@pytest.mark.parametrize("add_bos, expected", [(True, {"add_bos_token": True}), (False, {"add_bos_token": False}),
                                               (None, {})])
def test_the_tokenizer_adds_what_the_gguf_metadata_states(tmp_path, add_bos, expected):
    write_gguf(tmp_path / "m.gguf", add_bos=add_bos)
    assert added_special_tokens(tmp_path / "m.gguf") == expected  # an unstated flag is the tokenizer class's


def test_a_conversion_written_by_an_earlier_graft_is_redone(tmp_path, monkeypatch):
    """Conversion 1 dropped the GGUF's add_bos_token (Gemma lost its <bos>): its cache entry is not reused."""
    import graft.models.gguf as gguf_module

    write_gguf(tmp_path / "m.gguf")
    earlier = tmp_path / "cache" / "gguf" / gguf_module.file_sha256(tmp_path / "m.gguf")[:16]
    earlier.mkdir(parents=True)
    (earlier / DONE).write_text("{}")
    converted = []
    monkeypatch.setattr(gguf_module, "_convert", lambda gguf, arch, target: converted.append(target))
    target = converted_dir(tmp_path / "m.gguf", tmp_path / "cache")
    assert converted == [target] and target == earlier.with_name(f"{earlier.name}-c{CONVERSION}")
