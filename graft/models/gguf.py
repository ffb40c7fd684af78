"""GGUF bases: a `.gguf` file (or a directory holding one) as `model.path`.

Trainer, vLLM, SGLang, export and eval all read Hugging Face directories, so a GGUF file is
converted once into one, cached under `$GRAFT_CACHE/gguf/<sha256 of the file>-c<CONVERSION>` and
reused by every process of every run: the trainer and the engine then read the very same weights.
The weights are dequantized to float32, which holds every dequantized value exactly (a quantized
block is fp16 scale x small integer + fp16 offset); each consumer casts to `model.dtype` as it would
for any HF directory. The tokenizer and its chat template come from the GGUF's own metadata, and so
does whether it adds bos/eos to a text (`tokenizer.ggml.add_bos_token`/`add_eos_token`), which
transformers' own GGUF reading drops: on two plain English sentences Gemma 3 270M's perplexity is
208 without its `<bos>` and 7.6 with it (tests/models/test_packaged_models.py).

The file is checked before transformers sees it (magic, a whole header, an architecture
transformers can read), so a wrong or truncated file is one clear error before any server starts.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import tempfile
from pathlib import Path

from graft.models.cache import default_cache_dir

GGUF_MAGIC = b"GGUF"
SUFFIX = ".gguf"
DONE = "graft-gguf.json"  # what was converted from which file: the cache entry's record
# Part of the cache entry's name: a conversion graft now writes differently is redone, not reused.
# 2: the tokenizer adds bos/eos as the GGUF's add_bos_token/add_eos_token say.
CONVERSION = 2

_SHA256: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> digest: hash once per process


def gguf_file(path: str | os.PathLike) -> Path | None:
    """The GGUF file `path` names: `path` itself when it ends in .gguf, the one .gguf inside a
    directory that has no config.json, else None (not a GGUF base).

    Raises:
        ValueError: a directory without config.json holds several .gguf files (which one is meant?).
    """
    path = Path(path)
    if path.suffix == SUFFIX:
        return path
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(path.glob(f"*{SUFFIX}"))
    if len(found) > 1:
        raise ValueError(f"{path} holds several GGUF files ({', '.join(f.name for f in found)}): "
                         "set model.path to the one to use")
    return found[0] if found else None


def converted_dir(gguf: str | os.PathLike, cache_dir: Path | None = None, log=None) -> Path:
    """The HF directory converted from GGUF file `gguf`, converting it on first use (~20 s for
    SmolLM2-135M here; `log` hears of it).

    Raises:
        ValueError: the file is missing, not a GGUF model, truncated, or of an architecture
            transformers cannot read.
    """
    gguf = Path(gguf)
    if not gguf.is_file():
        raise ValueError(f"GGUF file {gguf} does not exist")
    target = (cache_dir or default_cache_dir()) / "gguf" / f"{file_sha256(gguf)[:16]}-c{CONVERSION}"
    if not (target / DONE).is_file():
        architecture = check_gguf(gguf)
        if log is not None:
            log(f"converting {gguf.name} ({architecture}, {gguf.stat().st_size / 2**20:.0f} MiB) to a Hugging Face "
                f"directory at {target}: once per file, ~20 s for SmolLM2-135M and ~2 min for Gemma 3 270M on "
                "2 CPU cores")
        _convert(gguf, architecture, target)
    return target


def file_sha256(path: Path) -> str:
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _SHA256:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
        _SHA256[key] = digest.hexdigest()
    return _SHA256[key]


def check_gguf(path: Path) -> str:
    """The architecture `path`'s GGUF header names, after checking the file is whole and readable.

    Raises:
        ValueError: not a GGUF file, truncated or unreadable, or an architecture transformers cannot
            convert.
    """
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF model file (it does not start with the GGUF magic bytes)")
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as error:  # a cut file: the reader's reshape of a short tensor fails, or a short header's read
        raise ValueError(f"{path} is a truncated or damaged GGUF file ({type(error).__name__}: {error})") from None
    if not reader.tensors:
        raise ValueError(f"{path} holds no tensors: a GGUF file without weights is not a model")
    field = reader.get_field("general.architecture")
    architecture = "" if field is None else bytes(field.parts[field.data[0]]).decode()
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    readable = sorted(set(GGUF_CONFIG_MAPPING) - {"general", "tokenizer"})  # metadata sections, not models
    if architecture not in readable:
        raise ValueError(f"{path}: GGUF architecture {architecture or '(none)'!r} cannot be read by transformers; "
                         f"it reads {', '.join(readable)}")
    return architecture


def added_special_tokens(gguf: Path) -> dict[str, bool]:
    """The tokenizer keywords (`add_bos_token`, `add_eos_token`) for what `gguf`'s metadata says its
    tokenizer adds to a text; a flag the file does not state is left to the tokenizer class.

    Given to the tokenizer's constructor they become its post-processor, which save_pretrained
    writes to tokenizer.json (transformers saves no add_*_token in tokenizer_config.json).
    """
    from transformers.integrations.gguf import read_gguf_metadata

    metadata, _ = read_gguf_metadata(gguf, ())  # arrays left as counts: ~0.05 s where GGUFReader takes ~12 s
    return {f"add_{kind}_token": bool(metadata[key]) for kind in ("bos", "eos")
            if (key := f"tokenizer.ggml.add_{kind}_token") in metadata}


def _convert(gguf: Path, architecture: str, target: Path) -> None:
    """Write the HF directory for `gguf` at `target`, atomically: another process converting the same
    file at the same time (each torchrun rank resolves the path) finds one whole directory."""
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        try:  # transformers' GGUF reader draws its own progress bar: graft's caller logs the conversion
            with contextlib.redirect_stderr(io.StringIO()):
                loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
                tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                          **added_special_tokens(gguf))
        except Exception as error:  # a header transformers accepts, contents it cannot map
            raise ValueError(f"{gguf}: transformers could not convert this {architecture} GGUF file "
                             f"({type(error).__name__}: {error})") from None
        # save_pretrained refuses a model whose config still names the GGUF quantization; the
        # weights are already dequantized, so the same weights in a plain model save normally.
        loaded.config.quantization_config = None
        del loaded.config.quantization_config
        plain = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
        plain.load_state_dict(loaded.state_dict())
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for written in [tmp, *tmp.iterdir()]:  # mkdtemp makes 0700: engines may run as another user
            written.chmod(0o755 if written.is_dir() else 0o644)
        (tmp / DONE).write_text(json.dumps({"gguf": str(gguf), "sha256": file_sha256(gguf), "conversion": CONVERSION,
                                            "architecture": architecture, "dtype": "float32"}, indent=1))
        try:
            os.replace(tmp, target)
        except OSError:  # another process finished first: its directory is the same conversion
            if not (target / DONE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
