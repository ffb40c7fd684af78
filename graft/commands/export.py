"""`graft export`: base + LoRA adapter written as one standalone merged model."""

from __future__ import annotations

import argparse


def add_command(sub) -> None:
    p = sub.add_parser("export", help="write base + LoRA adapter as a standalone merged model",
                       description="Merge a PEFT LoRA adapter into its base model (fp32 math, one rounding, "
                                   "base never modified) and write a standalone HF model: safetensors, config, "
                                   "tokenizer.")
    p.add_argument("--base", required=True, help="base HF model directory, or a packaged model's name (smollm2, "
                   "see `graft model`), a .gguf file, a hub id in the local Hugging Face cache")
    p.add_argument("--adapter", required=True, help="PEFT LoRA adapter directory")
    p.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    p.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], default=None,
                   help="dtype of the merged weights (default: the base checkpoint's)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from graft.lora.export import export_merged

    total = export_merged(args.base, args.adapter, args.out, dtype=args.dtype)
    print(f"wrote merged model ({total / 2**20:.1f} MiB of weights) to {args.out}")
