"""specd's packages form layers, and its files form no cycle.

Packages: no import cycle between them, no upward import.  A unit is a
subpackage (``specd/engine``) or a top-level module (``specd/cli.py``).

Files: no import cycle between modules (a package's ``__init__.py`` is a
module), and the serving boundary holds: no module under ``specd/server/``
(the routes) imports ``specd/control/`` (the control plane); the daemon
composes the two.

Every import in ``specd/`` counts, including those inside functions (a lazy
import is still a dependency).

Sizes: no class of more than ``MAX_METHODS`` methods (properties count) and no
reconciler module of more than ``MAX_RECONCILER_LINES`` lines, so that each reads at
once; a class that grows past it is split along its concerns.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SPECD = Path(__file__).resolve().parents[2] / "specd"
MAX_METHODS = 25
MAX_RECONCILER_LINES = 300

# Lowest first; a unit may import only units of earlier layers, none of its own layer.
LAYERS = [
    {"api", "core", "metrics", "logs"},
    {"speculation", "store"},
    {"engine"},
    {"parallel"},
    {"serving"},              # the request path: engine registry, replica sets, router, remote engines, cluster membership
    {"control", "forge", "server"},   # control reconciles, server holds the routes: neither imports the other
    {"client", "service", "serve", "console"},   # console: the web console over the routes' keys
    {"daemon"},               # composes the control plane and the routes into the running daemon
    {"doctor"},
    {"cli"},
]


def unit_of(module: str) -> str | None:
    """``specd.engine.engine`` -> ``engine``; None outside specd."""
    parts = module.split(".")
    return parts[1] if parts[0] == "specd" and len(parts) > 1 else None


def module_name(path: Path, root: Path = SPECD) -> str:
    """``<root>/engine/engine.py`` -> ``specd.engine.engine``; a package's ``__init__.py`` names the package."""
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_statements(path: Path, root: Path = SPECD) -> Iterator[tuple[str, list[str]]]:
    """Each import in ``path`` as (absolute module, names it takes from it).

    ``import a.b`` gives ``("a.b", [])``; ``from .x import y, z`` gives
    ``("<package>.x", ["y", "z"])``.
    """
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield target, [alias.name for alias in node.names]


def imports(path: Path) -> set[str]:
    """Absolute names of the specd modules ``path`` imports."""
    found = set()
    for target, names in import_statements(path):
        found.add(target)
        found |= {f"{target}.{name}" for name in names}
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


def module_graph(root: Path = SPECD) -> dict[str, set[str]]:
    """Each module under ``root`` -> the modules under ``root`` it imports.

    ``from pkg import name`` imports the submodule ``pkg.name`` when there is
    one, else ``pkg``; ``import pkg.mod`` imports ``pkg.mod`` alone.
    """
    files = {module_name(path, root) for path in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        targets = graph.setdefault(module_name(path, root), set())
        for target, names in import_statements(path, root):
            for name in names or [""]:
                submodule = f"{target}.{name}"
                targets.add(submodule if submodule in files else target)
        targets &= files
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
    found = cycles(unit_graph())
    assert found == [], f"import cycles between packages: {found}"


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"engine": {"spec"}, "spec": {"core", "engine"}, "core": set()}) == [["engine", "spec"]]


def test_no_import_cycle_between_files():
    found = cycles(module_graph())
    assert found == [], f"import cycles between files: {found}"


def test_the_file_graph_finds_a_cycle(tmp_path):
    """A cycle through an import inside a function and a ``from pkg import module``, which
    imports the module, not ``pkg``'s ``__init__.py`` (else ``core`` would join the cycle)."""
    files = {
        "__init__.py": "",
        "core/__init__.py": "from .cache import Cache\n",
        "core/cache.py": "from specd.core import prefix\n",
        "core/prefix.py": "def match():\n    from .cache import Cache\n",
        "core/kv.py": "import specd.core.prefix\nfrom specd.core import Cache\n",
    }
    for name, text in files.items():
        (tmp_path / "specd" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "specd" / name).write_text(text)
    graph = module_graph(tmp_path / "specd")
    assert graph["specd.core.kv"] == {"specd.core.prefix", "specd.core"}
    assert cycles(graph) == [["specd.core.cache", "specd.core.prefix"]]


def test_the_routes_never_import_the_control_plane():
    graph = module_graph()
    crossings = sorted(f"{path.relative_to(SPECD.parent)} -> {target}"
                       for path in (SPECD / "server").rglob("*.py")
                       for target in graph[module_name(path)] if unit_of(target) == "control")
    assert crossings == [], "specd/server/ imports specd/control/:\n" + "\n".join(crossings)


def test_every_import_goes_down_the_layers():
    layer = {unit: n for n, units in enumerate(LAYERS) for unit in units}
    graph = unit_graph()
    assert set(graph) <= set(layer), f"units without a layer: {sorted(set(graph) - set(layer))}"
    upward = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if layer[b] >= layer[a])
    assert upward == [], f"imports up the layers or within one: {upward}"


def methods_by_class(root: Path = SPECD) -> dict[str, int]:
    """``path:Class`` -> how many methods its body defines, for every class under ``root``."""
    counts = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                counts[f"{path.relative_to(root.parent)}:{node.name}"] = sum(
                    isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in node.body)
    return counts


def test_no_class_has_more_methods_than_reads_at_once():
    large = {name: n for name, n in methods_by_class().items() if n > MAX_METHODS}
    assert large == {}, f"classes over {MAX_METHODS} methods: {large}"


def test_the_method_count_sees_properties_and_async_methods(tmp_path):
    (tmp_path / "specd").mkdir()
    (tmp_path / "specd" / "m.py").write_text(
        "class A:\n    x = 1\n    def a(self): pass\n    @property\n    def b(self): pass\n"
        "    async def c(self): pass\n    class Inner:\n        def d(self): pass\n")
    assert methods_by_class(tmp_path / "specd") == {"specd/m.py:A": 3, "specd/m.py:Inner": 1}


def test_no_reconciler_module_is_longer_than_reads_at_once():
    long = {str(path.relative_to(SPECD.parent)): n for path in (SPECD / "control").rglob("*.py")
            if "reconcilers" in path.parts and (n := len(path.read_text().splitlines())) > MAX_RECONCILER_LINES}
    assert long == {}, f"reconciler modules over {MAX_RECONCILER_LINES} lines: {long}"
