"""specd's packages form layers: no import cycle between packages, no upward import.

Every import in ``specd/`` counts, including those inside functions (a lazy
import is still a dependency).  A unit is a subpackage (``specd/engine``) or
a top-level module (``specd/cli.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path

SPECD = Path(__file__).resolve().parents[1] / "specd"

# Lowest first; a unit may import units of its own layer's predecessors only.
LAYERS = [
    {"api", "core", "metrics", "logs"},
    {"speculation"},
    {"engine"},
    {"parallel"},
    {"control", "forge"},
    {"server", "client", "service", "serve"},
    {"doctor"},
    {"cli"},
]


def unit_of(module: str) -> str | None:
    """``specd.engine.engine`` -> ``engine``; None outside specd."""
    parts = module.split(".")
    return parts[1] if parts[0] == "specd" and len(parts) > 1 else None


def module_name(path: Path) -> str:
    rel = path.relative_to(SPECD.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> set[str]:
    """Absolute names of the specd modules ``path`` imports."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found |= {f"{target}.{alias.name}" for alias in node.names}
    return {m for m in found if m.startswith("specd.")}


def unit_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in SPECD.rglob("*.py"):
        source = unit_of(module_name(path)) if path.parent != SPECD or path.name != "__init__.py" else None
        if source is None:
            continue
        targets = {unit_of(m) for m in imports(path)} - {None, source}
        graph.setdefault(source, set()).update(t for t in targets if (SPECD / t).exists()
                                               or (SPECD / f"{t}.py").exists())
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one unit (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_between_packages():
    assert cycles(unit_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"engine": {"spec"}, "spec": {"core", "engine"}, "core": set()}) == [["engine", "spec"]]


def test_every_import_goes_down_the_layers():
    layer = {unit: n for n, units in enumerate(LAYERS) for unit in units}
    graph = unit_graph()
    assert set(graph) <= set(layer), f"units without a layer: {sorted(set(graph) - set(layer))}"
    upward = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if layer[b] >= layer[a])
    assert upward == []
