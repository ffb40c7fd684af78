"""Generated blocks of the docs: the one rewriter and the one staleness check for every renderer.

The docs hold text rendered from the code (the config reference, from the schema) and from kept
results (the benches' tables, from docs/results/*.json) between marker comments:

    <!-- results:e2e -->
    ...
    <!-- /results:e2e -->

Each renderer is a `BlockKind`: its markers and a function from a block's name to its body. This
module finds the blocks, renders them afresh, says which block of which file is stale and rewrites
the files; `graft bench report [--check]` runs it over every kind and every generated page. It lives
in `config`, the lowest package with a renderer, so that every package above may use it
(tests/test_layout.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BlockKind:
    """One renderer's blocks: `opening` is the regex of an opening marker with a group `name` (the
    line's newline is added), `closing` that of its closing marker (it may refer to `(?P=name)`);
    `render` returns the body of the block named `name`; `command` rewrites stale blocks."""

    label: str
    opening: str
    closing: str
    render: Callable[[str], str]
    command: str

    @property
    def pattern(self) -> re.Pattern:
        """A whole block: groups `open` (the opening line), `name`, `body`, `close`."""
        return re.compile(f"(?P<open>{self.opening}\n)(?P<body>.*?)(?P<close>{self.closing})", re.S)


@dataclass(frozen=True)
class StaleBlock:
    """A block of `path` whose body differs from its rendering."""

    path: Path
    kind: BlockKind
    name: str

    def describe(self, *, rewritten: bool) -> str:
        """The line a command prints for this block: stale and how to fix it, or rewritten."""
        done = "rewritten" if rewritten else f"is stale; run {self.kind.command}"
        return f"{self.path}: {self.kind.label} block {self.name!r} {done}"


def rewrite(text: str, kind: BlockKind, source: str = "text") -> tuple[str, list[str]]:
    """`text` with every block of `kind` rendered afresh, and the names of the blocks that changed.

    Raises:
        ValueError: an opening marker of `kind` without its closing marker (`source` names where), or
            what `kind.render` raises (an unknown block name).
    """
    starts = {match.start() for match in kind.pattern.finditer(text)}
    if unclosed := [m["name"] for m in re.finditer(kind.opening, text) if m.start() not in starts]:
        raise ValueError(f"{source}: {kind.label} block {unclosed[0]!r} has no closing marker")
    changed = []

    def replace(match: re.Match) -> str:
        body = kind.render(match["name"])
        if body != match["body"]:
            changed.append(match["name"])
        return match["open"] + body + match["close"]

    return kind.pattern.sub(replace, text), changed


def update(paths: Iterable[Path], kinds: Iterable[BlockKind], *, check: bool) -> list[StaleBlock]:
    """Render every block of each kind in each file; rewrite the files whose blocks were stale unless
    `check`. Returns the stale blocks (rewritten unless `check`), file by file.

    Raises:
        ValueError: as `rewrite`, with the file named.
    """
    kinds = list(kinds)
    stale = []
    for path in paths:
        text = fresh = path.read_text()
        for kind in kinds:
            fresh, changed = rewrite(fresh, kind, str(path))
            stale += [StaleBlock(path, kind, name) for name in changed]
        if fresh != text and not check:
            path.write_text(fresh)
    return stale
