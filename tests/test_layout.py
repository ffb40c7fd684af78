"""The layout is the architecture: imports point one way (README's "Where things live" order), the
math (`lora/`, `rl/`) never imports torch.distributed, and files stay small enough to read."""

import re
from pathlib import Path

GRAFT = Path(__file__).parents[1] / "graft"
# README's table, lowest layer first: a module may import only from its own layer or those before it.
LAYERS = ["atomic", "config", "models", "rl", "lora", "tasks", "rollout", "sync", "evaluation", "train", "tenants",
          "quickstart", "bench", "cli"]
IMPORT = re.compile(r"^\s*(?:from|import)\s+graft\.(\w+)", re.M)


def _modules():
    return sorted(p for p in GRAFT.rglob("*.py") if p.relative_to(GRAFT).parts[0].removesuffix(".py") in LAYERS)


def test_every_package_is_in_the_layer_order():
    tops = {p.relative_to(GRAFT).parts[0].removesuffix(".py") for p in GRAFT.rglob("*.py")}
    assert tops - {"__init__", "__main__"} <= set(LAYERS)


def test_imports_point_one_way():
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = []
    for path in _modules():
        layer = path.relative_to(GRAFT).parts[0].removesuffix(".py")
        upward += [f"{path.relative_to(GRAFT)} imports graft.{m}" for m in IMPORT.findall(path.read_text())
                   if rank[m] > rank[layer]]
    assert upward == []


def test_math_packages_import_no_torch_distributed():
    offenders = [str(p.relative_to(GRAFT)) for package in ("lora", "rl") for p in (GRAFT / package).rglob("*.py")
                 if "torch.distributed" in p.read_text()]
    assert offenders == []


def test_no_file_passes_400_lines():
    long = {str(p.relative_to(GRAFT)): n for p in GRAFT.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}
