"""Markdown pieces the result tables are built of (`graft.bench.report`): one place decides how a
table, a size or a percentage is written, so that every table of the docs reads alike."""

from __future__ import annotations

import shlex


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(row) + " |" for row in rows)]


def gib(size_bytes: float) -> str:
    return f"{size_bytes / 2**30:.2f} GiB"


def mib(size_bytes: float) -> str:
    return f"{size_bytes / 2**20:.1f}"


def percent(fraction: float) -> str:
    return f"{100 * fraction:.1f}%"


def seconds(value: float) -> str:
    """Four significant digits: 0.889, 14.61, 94.32 (what run-to-run noise leaves meaningful)."""
    return f"{value:.4g}"


def small(value: float) -> str:
    """A rounding-level number (a log-prob gap, a relative difference): 0 or two digits and an exponent."""
    return "0" if value == 0 else f"{value:.1e}"


def flag(command: str, name: str, default: str) -> str:
    """The value of `name` in a recorded command line (`--seed` of `graft bench learning --seed 2`)."""
    words = shlex.split(command)
    return words[words.index(name) + 1] if name in words[:-1] else default
