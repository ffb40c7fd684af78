"""`graft bench report`: the docs' generated blocks rendered afresh — the benches' result tables
from the kept results (docs/results/*.json), and the config reference from the schema.

The README's quickstart tables and every table of docs/benchmarks.md and docs/tenants.md sit between
marker comments:

    <!-- results:e2e -->
    ...
    <!-- /results:e2e -->

`graft bench report` (or `python -m graft.bench.report.render`) rewrites each block from its result
files (`TABLES`: block -> the files it shows and its renderer), under one line per run saying when,
on which machine, at which commit and by which command it was measured, and docs/config.md's
reference from the schema (`graft.config.reference`). `--check` changes nothing and exits 1 naming
each stale block (tests/bench/report/test_report.py asserts none is, so a changed result file or
schema and its docs are committed together); `--add NAME PATH` first keeps a result made outside
`graft bench` (`graft.bench.report.results.add`). Benches keep theirs with `--record`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from graft.bench.report.parts import TABLES as PART_TABLES
from graft.bench.report.results import RESULTS_DIR, ROOT, add, load_results
from graft.bench.report.runs import TABLES as RUN_TABLES
from graft.config.docs_blocks import BlockKind, update
from graft.config.reference import REFERENCE_BLOCKS

DOCS = ("README.md", "docs/benchmarks.md", "docs/tenants.md", "docs/config.md")
TABLES = {**RUN_TABLES, **PART_TABLES}


def describe_machine(machine: dict) -> str:
    """`2-core AMD EPYC with AVX-512, 24 GiB`, with the GPU where there was one (a GPU box whose
    CPU went unrecorded: the GPU alone)."""
    parts = []
    if machine.get("cores"):
        cpu = f"{machine['cores']}-core {machine.get('cpu') or 'CPU'}"
        parts.append(cpu + (f" with {machine['vector']}" if machine.get("vector") else ""))
    parts += [f"{machine['memory_gib']} GiB"] if machine.get("memory_gib") else []
    parts += [machine["gpu"]] if machine.get("gpu") else []
    return ", ".join(parts)


def provenance(kept: list[dict]) -> list[str]:
    """One line per group of runs measured alike (same day, machine, commit and note): their
    commands and files; hand-typed numbers say so."""
    groups: dict[tuple, list[dict]] = {}
    for run in kept:
        key = (run["date"], describe_machine(run["machine"]), run.get("git"), run.get("note"),
               run.get("typed_by_hand", False))
        groups.setdefault(key, []).append(run)
    lines = []
    for (date, machine, git, note, typed), runs in groups.items():
        line = f"- {date}, {machine}" + (f", graft {git}" if git else "") + ": "
        line += ", ".join(f"`{run['command']}`" for run in runs)
        line += f"; {note}" if note else ""
        line += "; hand-typed numbers, as the docs printed them" if typed else ""
        lines.append(line + " (" + ", ".join(f"docs/results/{run['name']}.json" for run in runs) + ")")
    return lines


def render_block(name: str, results: dict[str, dict]) -> str:
    """The body of block `name`: the provenance lines, a blank line, the table.

    Raises:
        ValueError: an unknown block, or a result file it shows is missing.
    """
    if name not in TABLES:
        raise ValueError(f"unknown results block {name!r}: one of {', '.join(sorted(TABLES))}")
    files, render = TABLES[name]
    if missing := [f for f in files if f not in results]:
        raise ValueError(f"results block {name!r}: no docs/results/{missing[0]}.json")
    kept = [results[f] for f in files]
    return "\n".join([*provenance(kept), "", *render(kept)]) + "\n"


def results_blocks(results: dict[str, dict]) -> BlockKind:
    """The results blocks, rendered from `results` (`load_results`)."""
    return BlockKind("results", r"<!-- results:(?P<name>[\w-]+) -->", "<!-- /results:(?P=name) -->",
                     lambda name: render_block(name, results), "graft bench report")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graft bench report", description="Render the generated blocks of the "
                                     "docs: the result tables from docs/results/*.json, the config reference from "
                                     "the schema.")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 where a block is stale")
    parser.add_argument("--add", nargs=2, metavar=("NAME", "PATH"),
                        help="first keep PATH (a quickstart's run directory, or a JSON file such as make gpu-check's "
                             "gpu-check.json) as docs/results/NAME.json, with this machine, its date and the git "
                             "revision")
    parser.add_argument("--command", help="with --add of a JSON file: the command that made it")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="where the result files are")
    parser.add_argument("docs", nargs="*", type=Path, default=[ROOT / doc for doc in DOCS],
                        help=f"the files whose blocks are rendered (default: {' '.join(DOCS)})")
    args = parser.parse_args(argv)
    if args.add:
        print(f"kept {add(args.add[0], Path(args.add[1]), args.command, args.results)}")
    kinds = [results_blocks(load_results(args.results)), REFERENCE_BLOCKS]
    stale = update(args.docs, kinds, check=args.check)
    for block in stale:
        print(block.describe(rewritten=not args.check))
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
