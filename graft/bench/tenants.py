"""`graft bench tenants`: many tenants trained in shared batches on one base, against one tenant alone.

A random Qwen2 base (`--hidden`, `--layers`; the project's tokenizer size), fp32. The tenants differ
in shape as a service's do: tenant i has LoRA rank 8, 4 or 16 (i mod 3) on all linear layers, its own
seed, and `--datums` supervised sequences per round (cross-entropy, Tinker's loss) of its own length,
from `--tokens` (tenant 0) down to about half of it. "alone" trains tenant 0 alone, one
`forward_backward` + `optim_step` per round; "together" trains `--tenants` tenants, one shared
`forward_backward` over all their datums + one `optim_step` each per round; "invariant" does the same
with `batch_invariant` (graft.tenants.invariant). Rounds alternate between the three after a warm-up;
trained tokens per second are medians over rounds.

Also measured: how far each tenant trained together ends from the same tenant trained alone on the
same datums (the largest relative norm difference of any LoRA matrix after 3 steps):
`isolation_max_rel_diff` with `batch_invariant` (0.0: bit-equal), `isolation_default_max_rel_diff`
without; and the memory the tenants add (their adapters and optimizer state) against the base's.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from graft.config.arguments import COUNT, at_least
from graft.models.loading import load_model
from graft.models.tiny import build_tiny_model
from graft.tenants.policy import AdamParams, Datum, TenantPolicy, TenantSpec

ADAM = AdamParams(learning_rate=1e-3)
ISOLATION_STEPS = 3


RANKS = (8, 4, 16)  # tenant i's LoRA rank: RANKS[i % 3]


def _length(index: int, tenants: int, tokens: int) -> int:
    """Tenant `index`'s sequence length: `tokens` for tenant 0, down to about half for the last."""
    return max(2, tokens - index * tokens // (2 * tenants))


def _datums(index: int, round_: int, count: int, length: int, vocab: int) -> list[Datum]:
    rng = random.Random(f"t{index}-{round_}")
    return [Datum(f"t{index}", [rng.randrange(3, vocab) for _ in range(length)], {"weights": [1.0] * (length - 1)})
            for _ in range(count)]


def _policy(base: Path, tenants: range, invariant: bool) -> TenantPolicy:
    """A policy on a fresh copy of `base` with tenants `t<i>` for each i in `tenants` (seed i)."""
    policy = TenantPolicy(load_model(base), batch_invariant=invariant)
    for index in tenants:
        policy.add(TenantSpec(f"t{index}", rank=RANKS[index % 3], alpha=16, seed=index))
    return policy


def _round(policy: TenantPolicy, round_: int, datums: int, lengths: list[int], vocab: int) -> float:
    """One round for every tenant of `policy` (`t<i>`'s sequences of `lengths[i]` tokens); seconds."""
    indices = [int(name[1:]) for name in policy.tenants]
    batch = [d for index in indices for d in _datums(index, round_, datums, lengths[index], vocab)]
    start = time.perf_counter()
    policy.forward_backward(batch, "cross_entropy")
    for name in policy.tenants:
        policy.optim_step(name, ADAM)
    return time.perf_counter() - start


def _isolation(base: Path, tenants: int, datums: int, lengths: list[int], vocab: int, invariant: bool) -> float:
    """The largest relative difference of any tenant's LoRA matrix, trained together vs alone."""
    together = _policy(base, range(tenants), invariant)
    for round_ in range(ISOLATION_STEPS):
        _round(together, round_, datums, lengths, vocab)
    worst = 0.0
    for index in range(tenants):
        alone = _policy(base, range(index, index + 1), invariant)
        for round_ in range(ISOLATION_STEPS):
            _round(alone, round_, datums, lengths, vocab)
        mine, theirs = together.parameters(f"t{index}"), alone.parameters(f"t{index}")
        worst = max(worst, *((mine[k] - theirs[k]).norm().item() / theirs[k].norm().item() for k in mine))
    return worst


def _state_bytes(policy: TenantPolicy) -> tuple[int, int]:
    """(the base's bytes, every tenant's adapter + AdamW state bytes: weights, two moments)."""
    adapters = sum(p.numel() * p.element_size() for name in policy.tenants for p in policy.parameters(name).values())
    base = sum(p.numel() * p.element_size() for n, p in policy.model.named_parameters() if ".lora_" not in n)
    return base, 3 * adapters


def run_tenants_bench(tenants: int = 8, hidden: int = 256, layers: int = 4, datums: int = 4, tokens: int = 64,
                      rounds: int = 5) -> dict:
    console = Console(stderr=True)
    lengths = [_length(index, tenants, tokens) for index in range(tenants)]
    with tempfile.TemporaryDirectory(prefix="graft-bench-tenants-") as tmp:
        base = build_tiny_model(Path(tmp) / "base", arch="qwen2", hidden=hidden, layers=layers, seed=0)
        vocab = load_model(base).config.vocab_size
        sides = {"alone": _policy(base, range(1), False), "together": _policy(base, range(tenants), False),
                 "invariant": _policy(base, range(tenants), True)}
        seconds = {side: [] for side in sides}
        for round_ in range(rounds + 1):  # round 0 warms up, not counted
            console.print(f"round {round_} of {rounds}: 1 tenant, then {tenants} together, then batch-invariant")
            for side, policy in sides.items():
                elapsed = _round(policy, round_, datums, lengths, vocab)
                seconds[side] += [elapsed] if round_ else []
        base_bytes, tenant_bytes = _state_bytes(sides["together"])
        console.print(f"isolation: {tenants} tenants together vs each alone, {ISOLATION_STEPS} steps, both ways")
        isolation = {mode: _isolation(base, tenants, datums, lengths, vocab, mode) for mode in (True, False)}
    alone_rate = datums * lengths[0] / statistics.median(seconds["alone"])
    together_rate, invariant_rate = (datums * sum(lengths) / statistics.median(seconds[side])
                                     for side in ("together", "invariant"))
    return {"tenants": tenants, "hidden": hidden, "layers": layers, "datums": datums, "tokens": tokens,
            "lengths": lengths, "ranks": [RANKS[i % 3] for i in range(tenants)], "rounds": rounds,
            "threads": torch.get_num_threads(), "alone_tokens_per_s": alone_rate,
            "together_tokens_per_s": together_rate, "aggregate_over_single": together_rate / alone_rate,
            "invariant_tokens_per_s": invariant_rate, "invariant_over_together": invariant_rate / together_rate,
            "isolation_max_rel_diff": isolation[True], "isolation_default_max_rel_diff": isolation[False],
            "base_bytes": base_bytes, "tenant_state_bytes": tenant_bytes}


def print_tenants_report(result: dict) -> None:
    table = Table(title=f"{result['tenants']} tenants on one base (hidden {result['hidden']}, {result['layers']} "
                        f"layers, fp32), {result['datums']} sequences of {min(result['lengths'])}-{result['tokens']} "
                        f"tokens per tenant per round, ranks {sorted(set(result['ranks']))}, "
                        f"medians of {result['rounds']} rounds")
    for column in ("1 tenant alone", f"{result['tenants']} together", "aggregate / alone", "batch-invariant",
                   "isolation (max rel): invariant / default", "tenants' state / base"):
        table.add_column(column, justify="right")
    table.add_row(f"{result['alone_tokens_per_s']:.0f} tok/s", f"{result['together_tokens_per_s']:.0f} tok/s",
                  f"{result['aggregate_over_single']:.2f}x",
                  f"{result['invariant_tokens_per_s']:.0f} tok/s ({result['invariant_over_together']:.2f}x)",
                  f"{result['isolation_max_rel_diff']:.1e} / {result['isolation_default_max_rel_diff']:.1e}",
                  f"{result['tenant_state_bytes'] / 2**20:.1f} / {result['base_bytes'] / 2**20:.1f} MiB")
    Console().print(table)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tenants", type=COUNT, default=8, help="tenants trained together (default %(default)s)")
    parser.add_argument("--hidden", type=COUNT, default=256, help="the random base's hidden size (default %(default)s)")
    parser.add_argument("--layers", type=COUNT, default=4, help="its layers (default %(default)s)")
    parser.add_argument("--datums", type=COUNT, default=4, help="sequences per tenant per round (default %(default)s)")
    parser.add_argument("--tokens", type=at_least(2), default=64,  # position i scores token i + 1
                        help="tokens per sequence of tenant 0; the others' are shorter, down to about half "
                             "(default %(default)s)")
    parser.add_argument("--rounds", type=COUNT, default=5, help="counted rounds per side (default %(default)s)")


def run(args: argparse.Namespace) -> dict:
    """`graft bench tenants`: measure, print the table, return what --json writes."""
    result = run_tenants_bench(args.tenants, args.hidden, args.layers, args.datums, args.tokens, args.rounds)
    print_tenants_report(result)
    return result
