"""The layout is the architecture: imports point one way (README's "Where things live" order), no
module imports itself through others, torch.distributed is imported in graft/parallel/ alone (so the
math, `lora/` and `rl/`, never sees it), the service (`tenants/`) and the trainer (`train/`) share
only the layers below them, and files stay small enough to read."""

import ast
import re
from pathlib import Path

GRAFT = Path(__file__).parents[1] / "graft"
# README's table, lowest layer first: a module may import only from its own layer or those before it.
# `host` (CPU threads and allocator) and `parallel` (process group, collectives, parallelize) are the
# platform under both `train` and `tenants`.
LAYERS = ["atomic", "config", "host", "models", "rl", "lora", "tasks", "rollout", "sync", "evaluation", "parallel",
          "train", "tenants", "quickstart", "bench", "commands", "cli"]
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


def _module_name(path: Path) -> str:
    parts = path.relative_to(GRAFT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The graft modules `path` imports, at its top or inside a function (a lazy import closes a
    circle as well): `from graft.a import b` is graft.a.b where that is a module, else graft.a."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                      for alias in node.names} & modules
    return found - {_module_name(path)}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = stack[stack.index(node):]
                    del stack[stack.index(node):]
                    if len(group) > 1:
                        circles.append(sorted(group))
    return circles


def test_no_import_circle():
    paths = {_module_name(p): p for p in GRAFT.rglob("*.py")}
    graph = {name: _imported_modules(path, set(paths)) for name, path in paths.items()}
    assert _circles(graph) == []


def test_the_circle_check_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_math_packages_import_no_torch_distributed():
    offenders = [str(p.relative_to(GRAFT)) for package in ("lora", "rl") for p in (GRAFT / package).rglob("*.py")
                 if "torch.distributed" in p.read_text()]
    assert offenders == []


def _imports_torch_distributed(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        if any(name == "torch.distributed" or name.startswith("torch.distributed.") for name in names):
            return True
    return False


def test_only_the_parallel_package_imports_torch_distributed():
    """Process groups, collectives and sharding are graft/parallel/'s: a package that needs one calls it
    there, so every collective the ranks must make in the same order is in one place."""
    offenders = [str(p.relative_to(GRAFT)) for p in GRAFT.rglob("*.py")
                 if p.relative_to(GRAFT).parts[0] != "parallel" and _imports_torch_distributed(p)]
    assert offenders == []


def test_the_service_imports_nothing_of_the_trainer():
    """graft/tenants/ (the Tinker service) and graft/train/ (the GRPO loop) are siblings on the platform
    below them (graft/parallel/, graft/host.py); the service imports no trainer module."""
    paths = {_module_name(p): p for p in GRAFT.rglob("*.py")}
    offenders = {str(path.relative_to(GRAFT)): sorted(m for m in _imported_modules(path, set(paths))
                                                      if m == "graft.train" or m.startswith("graft.train."))
                 for path in (GRAFT / "tenants").rglob("*.py")}
    assert {path: found for path, found in offenders.items() if found} == {}


# Files of 380 lines or more, each with its line count today (it may shrink, not grow) and why it stays.
LONG_FILES = {
    "lora/adapter_io.py": (381, "the adapter format's reader and writer, gathered and sharded; split in a later step"),
}


def test_no_file_reaches_380_lines():
    long = {str(p.relative_to(GRAFT)): n for p in GRAFT.rglob("*.py") if (n := len(p.read_text().splitlines())) >= 380}
    assert {path: n for path, n in long.items() if path not in LONG_FILES or n > LONG_FILES[path][0]} == {}


def _reached(start: str, graph: dict[str, set[str]]) -> set[str]:
    """`start` and every graft module its imports run, through graft modules and the packages above
    each (importing graft.a.b runs graft/a/__init__.py first)."""
    reached, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in reached:
            continue
        reached.add(name)
        parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]
        todo += [m for m in graph[name] | set(parents) if m in graph]
    return reached


def test_the_vllm_server_process_imports_no_graft_config():
    """graft.config pulls pydantic and the whole config tree into every vLLM server process; what the
    server reads from its launcher is an environment variable (graft/rollout/vllm/server/environment.py)."""
    paths = {_module_name(p): p for p in GRAFT.rglob("*.py")}
    graph = {name: _imported_modules(path, set(paths)) for name, path in paths.items()}
    offenders = {server: sorted(m for m in _reached(server, graph) if m == "graft.config" or
                                m.startswith("graft.config."))
                 for server in graph if server.startswith("graft.rollout.vllm.server")}
    assert {server: found for server, found in offenders.items() if found} == {}
