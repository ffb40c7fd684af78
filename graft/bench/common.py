"""What several benches share: random models of a named shape and the vLLM server serving one, a
random adapter and its merged model for a served base, the syncs the sync benches measure, medians
of timed rounds, and plots.

The sync benches (`sync`, its `--stall` and `--sweep` variants, `verify`) take these from here, not
from one another: `graft bench sync` and the variants' modules imported each other in a circle.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
from rich.console import Console
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM

from graft.lora.adapter_io import adapter_state_dict, save_adapter
from graft.lora.attach import attach_lora, lora_parameters
from graft.lora.export import save_merged_model
from graft.models.loading import load_model
from graft.models.tokenizer import train_tokenizer
from graft.rollout.engine import RolloutEngine
from graft.rollout.vllm.launcher import VllmServer, VllmServerConfig
from graft.sync.adapter import AdapterSync
from graft.sync.inflight import InFlightVersions
from graft.sync.merged import MergedSync
from graft.sync.publish import WeightPublisher


@dataclass(frozen=True)
class ModelShape:
    """A Qwen2-shaped random model and the LoRA rank trained on it."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    rank: int


SHAPES = {
    "tiny": ModelShape("tiny", hidden=128, layers=2, heads=4, kv_heads=2, intermediate=384, vocab=1024, tied=False,
                       rank=16),
    # Qwen2.5-0.5B's shape (random weights): 24 layers, hidden 896, 14 heads, 2 KV heads, tied embeddings.
    "qwen2.5-0.5b-shape": ModelShape("qwen2.5-0.5b-shape", hidden=896, layers=24, heads=14, kv_heads=2,
                                     intermediate=4864, vocab=151936, tied=True, rank=16),
}
# The adapter sync benches' modes and the transport (graft.sync.transport) each syncs by.
ADAPTER_MODES = {"adapter": "disk", "adapter-memory": "memory", "adapter-memory-shm": "shm"}
ADAPTER = "bench-v1"  # the name `prepare_adapter_and_merged`'s adapter is served under


def qwen2_config(shape: ModelShape, *, eos_token_id: int | None = None, pad_token_id: int | None = None
                 ) -> Qwen2Config:
    """The bf16 Qwen2 config of `shape` (no weights: tests count its parameters on the meta device)."""
    return Qwen2Config(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                       num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                       num_key_value_heads=shape.kv_heads, max_position_embeddings=2048,
                       tie_word_embeddings=shape.tied, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                       dtype=torch.bfloat16)


def build_base(shape: ModelShape, out: Path) -> Path:
    """A random bf16 model of `shape` with graft's local tokenizer (ids fit in the vocabulary)."""
    tokenizer = train_tokenizer()
    config = qwen2_config(shape, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@contextlib.contextmanager
def bench_server(shape: ModelShape, work: Path, max_lora_rank: int,
                 console: Console) -> Iterator[tuple[Path, VllmServer]]:
    """(WORK/base, a bf16 vLLM server serving it) for the block: a random model of `shape`, served
    with the dev endpoints merged sync reloads weights through; the server stops after."""
    with console.status(f"{shape.name}: building a random model and starting vLLM"):
        base = build_base(shape, work / "base")
        server = VllmServer(VllmServerConfig(model=str(base), dtype="bfloat16", max_lora_rank=max_lora_rank,
                                             max_loras=4, max_model_len=512, log_dir=work,
                                             dev_endpoints=True)).start()
    try:
        yield base, server
    finally:
        server.stop()


def prepare_adapter_and_merged(base: Path, work: Path, rank: int, dtype: torch.dtype) -> tuple[Path, Path]:
    """A random non-zero adapter for `base`, and `base` with it merged, both in `dtype`."""
    model = attach_lora(load_model(base), rank=rank, alpha=2 * rank, seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in lora_parameters(model).values():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    adapter = save_adapter(model, work / "adapter", dtype=dtype)
    merged = work / "merged"
    save_merged_model(model, merged, dtype=dtype)
    return adapter, merged


def adapter_bench_sync(engine: RolloutEngine, work: Path, transport: str,
                       inflight: InFlightVersions | None = None) -> AdapterSync:
    """An adapter sync by `transport` keeping 3 versions, with its own publish root and lora.name (one
    run per root and name): WORK/weights for disk, WORK/weights-<transport> otherwise."""
    root = work / ("weights" if transport == "disk" else f"weights-{transport}")
    return AdapterSync(engine, WeightPublisher(root, keep_versions=3), lora_name=f"bench-{transport}", keep_versions=3,
                       max_loras=4, inflight=inflight or InFlightVersions(), transport=transport)


def bench_syncs(engine: RolloutEngine, work: Path) -> tuple[AdapterSync, MergedSync]:
    """The adapter and merged syncs the sync benches measure, publishing under WORK/weights."""
    merged = MergedSync(engine, WeightPublisher(work / "weights", keep_versions=1), dtype=torch.bfloat16)
    return adapter_bench_sync(engine, work, "disk"), merged


def new_policy_weights(policy: nn.Module) -> None:
    """New random LoRA values: a new policy each round, as after an optimizer step."""
    with torch.no_grad():
        for param in lora_parameters(policy).values():
            param.normal_(std=0.01)


def save_fsync(tensors: dict[str, torch.Tensor], path: Path) -> int:
    """`safetensors.save_file` + fsync: what any publish must at least do. Returns tensor bytes. Tensors
    on a GPU are copied to the CPU first, as every graft writer does (merged weights stay on the
    base's device)."""
    tensors = {name: tensor.cpu() for name, tensor in tensors.items()}
    safetensors.torch.save_file(tensors, path)
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return sum(t.numel() * t.element_size() for t in tensors.values())


def raw_write_seconds(policy: nn.Module, path: Path) -> tuple[float, int]:
    """The floor: gather the adapter tensors (as publishing does) and write them, fsynced. (seconds, bytes)"""
    start = time.perf_counter()
    size = save_fsync(adapter_state_dict(policy), path)
    return time.perf_counter() - start, size


def medians(samples: dict[str, list[tuple[float, int]]]) -> dict[str, tuple[float, int]]:
    """mode -> (median seconds, the last round's bytes)."""
    return {mode: (statistics.median(s for s, _ in values), values[-1][1]) for mode, values in samples.items()}


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display), set when a bench plots rather
    than when its module is imported: importing a bench then never changes another caller's backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path) -> Path:
    """Write `fig` to `path` as a PNG (its folder made if missing) and close it; the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return path
