"""Loading models and tokenizers from local directories, and dtype names."""

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

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


def require_model_dir(path: str | Path) -> Path:
    """`path` as a Path, checked to be a local model directory (has config.json)."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"model directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} has no config.json; is it a model directory?")
    return path


def load_model(path: str | Path, dtype: str = "float32") -> PreTrainedModel:
    """Loads a causal LM from a local directory, in eval mode.

    Raises:
        ValueError: If ``path`` is not a directory with a config.json, or ``dtype`` is unknown.
    """
    path = require_model_dir(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype))
    return model.eval()


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Loads the tokenizer stored in a local model directory.

    Raises:
        ValueError: If ``path`` is not a directory.
    """
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"tokenizer directory {path} does not exist")
    return AutoTokenizer.from_pretrained(path)


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
