"""Random tiny causal LMs, built locally (there is no model hub here).

``build_tiny_model`` writes a directory that both HF transformers and vLLM load: a Qwen2 or Llama
config, float32 safetensors weights drawn from a fixed seed, a generation config and the project's
locally trained tokenizer with its ChatML template.

Sizes: ``hidden=128, layers=2`` (the default) has about 0.6M parameters; ``hidden=1024, layers=8``
has about 95M (the benchmark model).
"""

import math
from pathlib import Path

import torch
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from graft.atomic import atomic_dir, require_empty_dir
from graft.models.tokenizer import train_tokenizer

# Architecture name -> (config class, model class).
ARCHS: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel]]] = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
}

# vLLM's CPU attention supports only these head sizes; a model with another one (e.g. 16) starts,
# answers /health, then kills the engine on the first generate (see shared/notes/vllm-cpu.md).
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def attention_shape(hidden: int) -> tuple[int, int, int]:
    """Chooses ``(head_dim, num_heads, num_key_value_heads)`` for a hidden size.

    head_dim is 64 when ``hidden`` is a multiple of 64 and at least 256, else 32, so it is always in
    ``VLLM_CPU_HEAD_DIMS``; num_heads is ``hidden // head_dim`` (vLLM's Qwen2 derives head_dim that
    way); the key/value heads are the largest divisor of num_heads not above half of it (GQA), or 1.

    Raises:
        ValueError: If ``hidden`` is not a positive multiple of 32.
    """
    if hidden < 32 or hidden % 32:
        raise ValueError(
            f"hidden={hidden} gives no head_dim that vLLM on CPU supports: hidden must be a multiple "
            f"of 32 and at least 32 (head_dim 64 if hidden is a multiple of 64 and >= 256, else 32; "
            f"supported head_dims: {VLLM_CPU_HEAD_DIMS})"
        )
    head_dim = 64 if hidden % 64 == 0 and hidden >= 256 else 32
    num_heads = hidden // head_dim
    num_kv_heads = max(d for d in range(1, max(1, num_heads // 2) + 1) if num_heads % d == 0)
    return head_dim, num_heads, num_kv_heads


def default_intermediate(hidden: int) -> int:
    """Llama-style MLP width: 8/3 of ``hidden``, rounded up to a multiple of 64."""
    return math.ceil(8 * hidden / 3 / 64) * 64


def tiny_config(
    tokenizer: PreTrainedTokenizerFast,
    *,
    arch: str = "qwen2",
    hidden: int = 128,
    layers: int = 2,
    intermediate: int | None = None,
) -> PretrainedConfig:
    """Builds the config of a tiny model whose vocabulary and special ids come from ``tokenizer``.

    Raises:
        ValueError: If ``arch`` is not in ``ARCHS`` or ``hidden`` has no supported head_dim.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; supported: {sorted(ARCHS)}")
    head_dim, num_heads, num_kv_heads = attention_shape(hidden)
    config_cls, _ = ARCHS[arch]
    return config_cls(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate or default_intermediate(hidden),
        num_hidden_layers=layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype=torch.float32,
    )


def build_tiny_model(
    out_dir: str | Path,
    *,
    arch: str = "qwen2",
    hidden: int = 128,
    layers: int = 2,
    seed: int = 0,
    vocab_size: int = 1024,
    intermediate: int | None = None,
) -> Path:
    """Writes a randomly initialised causal LM and its tokenizer to ``out_dir``.

    The weights are drawn after ``torch.manual_seed(seed)`` (inside a forked RNG, so the caller's
    RNG state is untouched): the same arguments give bit-identical tensors. The directory is built
    in a hidden sibling and renamed into place (``graft.atomic.atomic_dir``), so a failure leaves
    nothing at ``out_dir``.

    Args:
        out_dir: Target directory; must not exist or be empty.
        arch: One of ``ARCHS`` ("qwen2", "llama").
        hidden: Hidden size; a multiple of 32 (see ``attention_shape``).
        layers: Number of decoder layers.
        seed: Seed of the weight initialisation.
        vocab_size: Tokenizer vocabulary size asked for (the model uses ``len(tokenizer)``).
        intermediate: MLP width; defaults to ``default_intermediate(hidden)``.

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        ValueError: If ``out_dir`` exists and is not empty, or on a bad ``arch`` or ``hidden``.
    """
    out_dir = require_empty_dir(out_dir)
    tokenizer = train_tokenizer(vocab_size)
    config = tiny_config(tokenizer, arch=arch, hidden=hidden, layers=layers, intermediate=intermediate)
    _, model_cls = ARCHS[arch]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    return save_model_dir(out_dir, model, tokenizer)


def save_model_dir(out_dir: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                   files: dict[str, str] | None = None) -> Path:
    """Writes `model` with a generation config holding the tokenizer's bos/eos/pad ids, `tokenizer`
    and `files` (name -> text) through ``atomic_dir``: a failure leaves nothing at `out_dir`."""
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    with atomic_dir(out_dir) as tmp_dir:
        model.save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        for name, text in (files or {}).items():
            (tmp_dir / name).write_text(text)
    return out_dir
