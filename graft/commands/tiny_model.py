"""`graft tiny-model`: a random tiny model and tokenizer, for tests and the quickstart's base."""

from __future__ import annotations

import argparse

from graft.config.arguments import COUNT, SEED


def add_command(sub) -> None:
    p = sub.add_parser("tiny-model", help="build a random tiny HF model + locally trained tokenizer",
                       description="Build a random tiny causal LM (head_dim >= 32, so vLLM on CPU serves it) "
                                   "and a tokenizer trained locally, with a chat template. Deterministic for a seed.")
    p.add_argument("out", help="output directory (must not exist or be empty)")
    p.add_argument("--arch", choices=["qwen2", "llama"], default="qwen2")
    p.add_argument("--hidden", type=COUNT, default=128, help="hidden size, a multiple of 32 (default 128)")
    p.add_argument("--layers", type=COUNT, default=2, help="decoder layers (default 2)")
    p.add_argument("--seed", type=SEED, default=0, help="weight initialisation seed (default 0)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from graft.models.tiny import build_tiny_model

    out = build_tiny_model(args.out, arch=args.arch, hidden=args.hidden, layers=args.layers, seed=args.seed)
    print(f"wrote {args.arch} tiny model (hidden {args.hidden}, {args.layers} layers, seed {args.seed}) to {out}")
