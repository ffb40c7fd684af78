"""Write base + LoRA as a standalone HF model: merged safetensors shards, config and tokenizer.

The output loads with `AutoModelForCausalLM` and is a valid source for a vLLM weight reload.
Tensors are streamed from `iter_merged_weights` into the shard files one at a time (their layout is
known up front, `graft.lora.stream_write`), so memory stays bounded by a few modules, not a shard.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import peft
import torch
from torch import nn
from transformers import AutoConfig, AutoTokenizer

from graft.atomic import atomic_dir, save_safetensors
from graft.lora.adapter_io import load_adapter
from graft.lora.merge import iter_merged_weights, merged_layout
from graft.lora.stream_write import TensorStream, layout_bytes, plan_shards, write_streamed_shards
from graft.models.loading import (
    load_model,
    model_dtype,
    require_model_dir,
    resolve_dtype,
)

SAFE_INDEX = "model.safetensors.index.json"  # names the shards of a sharded model
SAFE_SINGLE = "model.safetensors"  # an unsharded model


def write_safetensors_shards(named_tensors: Iterable[tuple[str, torch.Tensor]], out_dir: Path,
                             max_shard_bytes: int = 2 << 30) -> int:
    """Write tensors as HF-style shards (`model.safetensors`, or numbered shards + index). Returns bytes.

    A shard is flushed as soon as it reaches `max_shard_bytes`, so at most one shard is held in memory;
    a `TensorStream` of one dtype is written one tensor at a time instead (the same bytes). Tensors
    may be on any device (a GPU's merged weights): each is copied to the CPU as it is written.
    """
    if isinstance(named_tensors, TensorStream) and named_tensors.streamable:
        shards = plan_shards(named_tensors.layout, max_shard_bytes)
        write_streamed_shards(named_tensors, [out_dir / f"shard-{i:05d}.tmp" for i in range(len(shards))], shards)
        return _name_shards(out_dir, [[name for name, _, _ in shard] for shard in shards],
                            layout_bytes(named_tensors.layout))
    shards: list[list[str]] = []
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = total_bytes = 0

    def flush() -> None:
        nonlocal shard, shard_bytes
        save_safetensors(shard, out_dir / f"shard-{len(shards):05d}.tmp", metadata={"format": "pt"})
        shards.append(list(shard))
        shard, shard_bytes = {}, 0

    for name, tensor in named_tensors:
        size = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + size > max_shard_bytes:
            flush()
        shard[name] = tensor.detach().to(device="cpu").contiguous()  # safetensors writes host memory
        shard_bytes += size
        total_bytes += size
    if shard or not shards:
        flush()
    return _name_shards(out_dir, shards, total_bytes)


def _name_shards(out_dir: Path, shards: list[list[str]], total_bytes: int) -> int:
    """Give the written `shard-N.tmp` files their HF names (and an index when there are several)."""
    if len(shards) == 1:
        os.replace(out_dir / "shard-00000.tmp", out_dir / SAFE_SINGLE)
        return total_bytes
    weight_map = {}
    for i, names in enumerate(shards):
        file_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(out_dir / f"shard-{i:05d}.tmp", out_dir / file_name)
        weight_map.update(dict.fromkeys(names, file_name))
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (out_dir / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return total_bytes


def write_merged_model(model: nn.Module, out_dir: Path, *, dtype: torch.dtype | None = None,
                       tokenizer_source: str | os.PathLike | None = None, max_shard_bytes: int = 2 << 30,
                       weights: Iterable[tuple[str, torch.Tensor]] | None = None) -> int:
    """Write `model` (adapter merged, if it has one) as a plain HF checkpoint into the existing
    directory `out_dir`: weight shards, config (with `dtype`), generation config, tokenizer if
    `tokenizer_source` has one. Not atomic by itself; returns weight bytes.

    `weights` replaces `iter_merged_weights(model, dtype)` as the source of the tensors: an FSDP2
    run's rank 0 passes the stream it merges from gathered modules (`model` then only gives configs).
    """
    dtype = dtype or model_dtype(model)
    hf_model = model.get_base_model() if isinstance(model, peft.PeftModel) else model
    weights = iter_merged_weights(model, dtype) if weights is None else weights
    stream = TensorStream(merged_layout(model, dtype), weights)
    total = write_safetensors_shards(stream, out_dir, max_shard_bytes)
    config = hf_model.config.__class__.from_dict(hf_model.config.to_dict())
    config.dtype = dtype
    config.save_pretrained(out_dir)
    if getattr(hf_model, "generation_config", None) is not None:
        hf_model.generation_config.save_pretrained(out_dir)
    if tokenizer_source is not None and (Path(tokenizer_source) / "tokenizer_config.json").is_file():
        AutoTokenizer.from_pretrained(str(tokenizer_source)).save_pretrained(out_dir)
    return total


def save_merged_model(model: nn.Module, out_dir: str | os.PathLike, *, dtype: torch.dtype | None = None,
                      tokenizer_source: str | os.PathLike | None = None, max_shard_bytes: int = 2 << 30) -> int:
    """`write_merged_model` into a new directory, atomically. Returns weight bytes."""
    with atomic_dir(out_dir) as tmp:
        return write_merged_model(model, tmp, dtype=dtype, tokenizer_source=tokenizer_source,
                                  max_shard_bytes=max_shard_bytes)


def export_merged(base: str | os.PathLike, adapter: str | os.PathLike, out_dir: str | os.PathLike,
                  dtype: str | None = None) -> int:
    """`graft export`: base model dir + PEFT adapter dir -> standalone merged model dir.

    The base is loaded in fp32 so the merge sums in full precision whatever the output dtype.
    Raises `AdapterError`/`ValueError` before anything is written at `out_dir`.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"--out {out_dir} already exists and is not an empty directory")
    base = require_model_dir(base)
    out_dtype = resolve_dtype(dtype) if dtype else AutoConfig.from_pretrained(str(base)).dtype
    model = load_adapter(load_model(base, dtype="float32"), adapter)
    return save_merged_model(model, out_dir, dtype=out_dtype, tokenizer_source=base)
