"""`graft bench memory`: peak memory and seconds of one GRPO update at real shapes.

Each measurement runs in a fresh process (`python -m graft.bench.memory --worker ...`), so its peak
resident memory (`ru_maxrss`) is that update's alone: a random Qwen2 of the Qwen2.5-0.5B shape
(hidden 896, intermediate 4864, 14 heads / 2 KV heads, vocab 151,936, tied embeddings) cut to
`layers`, LoRA r16 on all linear layers, fp32, and one `policy_update` of 32 sequences: 128-token
prompts, completions alternating 512 and 256 tokens, groups of 8 (the batch of the real-scale
issue). Reported above the model's own memory (RSS after building it).

TRL's side of this comparison is not measured yet: `trl_peak_bytes` and `trl_seconds` are null.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

from rich.console import Console
from rich.table import Table

SHAPES = ({"name": "qwen2.5-0.5b-shape-2-layers", "layers": 2}, {"name": "qwen2.5-0.5b-shape", "layers": 24})
VOCAB = 151_936
SEQUENCES = 32
PROMPT_TOKENS = 128


def _measure_in_this_process(layers: int, overrides: list[str]) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from graft.config import load_config
    from graft.lora.attach import attach_lora, lora_parameters
    from graft.train.rollout_batch import RolloutBatch
    from graft.train.update import policy_update

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)
    model = attach_lora(Qwen2ForCausalLM(config), rank=16, alpha=32, seed=0)
    model_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    g = torch.Generator().manual_seed(0)
    sequences = [(torch.randint(3, VOCAB, (PROMPT_TOKENS,), generator=g).tolist(),
                  torch.randint(3, VOCAB, (512 if i % 2 == 0 else 256,), generator=g).tolist())
                 for i in range(SEQUENCES)]
    batch = RolloutBatch(sequences, [[-5.0] * len(c) for _, c in sequences], torch.rand(SEQUENCES // 8, 8, generator=g),
                         version=0, seconds=0.0)
    train = load_config(None, overrides).train
    optimizer = torch.optim.AdamW(lora_parameters(model).values(), lr=1e-4)
    start = time.perf_counter()
    policy_update(model, optimizer, batch, train, pad_id=0)
    seconds = time.perf_counter() - start
    peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"model_bytes": model_bytes, "peak_bytes": peak_bytes, "seconds": seconds,
            "tokens": sum(len(p) + len(c) for p, c in sequences)}


def run_memory_bench(layers: tuple[int, ...] = (2,), overrides: list[str] | None = None) -> dict:
    """One fresh process per shape; `overrides` are `train.*` config overrides (the defaults if none)."""
    shapes = []
    for shape in SHAPES:
        if shape["layers"] not in layers:
            continue
        command = [sys.executable, "-m", "graft.bench.memory", "--worker", str(shape["layers"]), *(overrides or [])]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        measured = json.loads(done.stdout.strip().splitlines()[-1])
        shapes.append({**shape, "vocab": VOCAB, "sequences": SEQUENCES, "tokens": measured["tokens"],
                       "graft_model_bytes": measured["model_bytes"], "graft_peak_bytes": measured["peak_bytes"],
                       "graft_above_model_bytes": measured["peak_bytes"] - measured["model_bytes"],
                       "graft_seconds": measured["seconds"], "trl_peak_bytes": None, "trl_seconds": None})
    return {"overrides": overrides or [], "shapes": shapes}


def print_memory_report(result: dict) -> None:
    table = Table(title="graft bench memory: one GRPO update, 32 sequences (128 + 512/256 tokens), LoRA r16, fp32")
    for column in ("shape", "tokens", "model GiB", "peak GiB", "above model GiB", "seconds"):
        table.add_column(column, justify="right")
    for s in result["shapes"]:
        table.add_row(s["name"], str(s["tokens"]), f"{s['graft_model_bytes'] / 2**30:.2f}",
                      f"{s['graft_peak_bytes'] / 2**30:.2f}", f"{s['graft_above_model_bytes'] / 2**30:.2f}",
                      f"{s['graft_seconds']:.0f}")
    Console().print(table)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", type=int, required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    print(json.dumps(_measure_in_this_process(args.worker, args.overrides)))
