"""No import cycle between the packages of ``flm_runtime``, read from the sources (nothing is run).

A unit is a top-level part of the package: a subpackage (``backends``, ``scheduling``, ...) or a
top-level module (``api``, ``registry``, ...). Every ``import`` and ``from ... import`` counts,
wherever it stands: at module level, inside a function (a deferred import is still a dependency,
and the usual way a cycle is hidden) and under ``if TYPE_CHECKING:`` (the annotated code still
needs the other unit to be read and to type-check). Relative imports count as the absolute
ones they name. Not counted: modules named in strings (``importlib.import_module``,
``importlib.resources.files``), which no layering can see.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import flm_runtime


def unit_graph(package_dir: Path, package: str) -> dict[str, dict[str, str]]:
    """unit -> {unit it imports: the first ``file:line`` that does} for the package in
    ``package_dir`` (its ``__init__.py`` is the unit ``__init__``)."""
    graph: dict[str, dict[str, str]] = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir).with_suffix("").parts
        edges = graph.setdefault(parts[0], {})
        is_package = parts[-1] == "__init__"
        module = [package, *parts[:-1]] if is_package else [package, *parts]
        nodes = [n for n in ast.walk(ast.parse(path.read_text(), str(path))) if isinstance(n, (ast.Import, ast.ImportFrom))]
        for node in sorted(nodes, key=lambda n: n.lineno):
            for name in _imported(node, module, is_package=is_package):
                other = _unit(name, package, package_dir)
                if other is not None and other != parts[0]:
                    edges.setdefault(other, f"{path.relative_to(package_dir)}:{node.lineno}")
    return graph


def _imported(node: ast.Import | ast.ImportFrom, module: list[str], *, is_package: bool) -> list[list[str]]:
    """The dotted names an import node brings in (``from a import b`` brings in ``a.b``: ``b``
    may be a submodule), resolved against ``module`` for a relative import."""
    if isinstance(node, ast.Import):
        return [alias.name.split(".") for alias in node.names]
    base = (node.module or "").split(".") if node.module else []
    if node.level:
        anchor = module if is_package else module[:-1]
        base = anchor[: len(anchor) - node.level + 1] + base
    return [base + [alias.name] for alias in node.names]


def _unit(name: list[str], package: str, package_dir: Path) -> str | None:
    """The unit of ``package`` a dotted name falls in; None outside it."""
    if name[0] != package:
        return None
    if len(name) == 1 or not ((package_dir / name[1]).is_dir() or (package_dir / f"{name[1]}.py").is_file()):
        return "__init__"  # the package itself, or a name its __init__.py defines
    return name[1]


def find_cycle(graph: dict[str, dict[str, str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None (depth-first, units in sorted order)."""
    state: dict[str, str] = {}  # unit -> "open" while on the path, "done" after
    path: list[str] = []

    def visit(unit: str) -> list[str] | None:
        state[unit] = "open"
        path.append(unit)
        for other in sorted(graph.get(unit, {})):
            if state.get(other) == "open":
                return path[path.index(other):] + [other]
            if other not in state and (cycle := visit(other)):
                return cycle
        state[unit] = "done"
        path.pop()
        return None

    for unit in sorted(graph):
        if unit not in state and (cycle := visit(unit)):
            return cycle
    return None


def describe(cycle: list[str], graph: dict[str, dict[str, str]]) -> str:
    """``a -> b (file:line) -> a (file:line)``: each step with the import that makes it."""
    return cycle[0] + "".join(f" -> {b} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:]))


RUNTIME = Path(flm_runtime.__file__).parent


def test_no_import_cycle_between_flm_runtime_packages():
    graph = unit_graph(RUNTIME, "flm_runtime")
    assert {"api", "backends", "model_config", "models", "outputs", "pull", "registry", "sampling", "scheduling", "speculation",
            "text"} <= set(graph)  # the sources were read
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle between flm_runtime packages: {describe(cycle, graph)}"


@pytest.mark.parametrize("leaf", ["model_config", "outputs", "kv_cache"])
def test_the_shared_types_are_leaves(leaf):
    """The shared types import nothing of ``flm_runtime``: every layer may build on them."""
    assert unit_graph(RUNTIME, "flm_runtime")[leaf] == {}


def write_package(root: Path, files: dict[str, str]) -> Path:
    """The package ``pkg`` under ``root`` from {relative path: source}; returns its directory."""
    for name, source in {"__init__.py": "", **files}.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return root / "pkg"


# a -> b at module level; b -> a in one of the ways a cycle hides, and the line of that import
BACK_EDGES = {
    "in a function": ("def late():\n    from pkg.a import x\n", 2),
    "under TYPE_CHECKING": ("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from pkg.a.x import X\n", 4),
    "relative": ("from ..a import x\n", 1),
    "plain import": ("import pkg.a.x\n", 1),
    "from the package": ("from pkg import a\n", 1),
}


@pytest.mark.parametrize("back_edge, line", BACK_EDGES.values(), ids=BACK_EDGES.keys())
def test_a_cycle_is_found_and_named(tmp_path, back_edge, line):
    pkg = write_package(tmp_path, {"a/__init__.py": "", "a/x.py": "from pkg.b.y import f\n",
                                   "b/__init__.py": "", "b/y.py": back_edge,
                                   "c.py": "import numpy\n\nfrom pkg.a import x\n"})
    graph = unit_graph(pkg, "pkg")
    assert graph == {"__init__": {}, "a": {"b": "a/x.py:1"}, "b": {"a": f"b/y.py:{line}"}, "c": {"a": "c.py:3"}}
    cycle = find_cycle(graph)
    assert cycle == ["a", "b", "a"]
    assert describe(cycle, graph) == f"a -> b (a/x.py:1) -> a (b/y.py:{line})"


def test_layers_without_a_cycle_pass(tmp_path):
    pkg = write_package(tmp_path, {"core.py": "import numpy\n", "models/__init__.py": "from pkg import core\n",
                                   "engine.py": "from pkg.models import m\nfrom . import core\n",
                                   "models/m.py": "from .. import core\n"})
    graph = unit_graph(pkg, "pkg")
    assert graph == {"__init__": {}, "core": {}, "engine": {"models": "engine.py:1", "core": "engine.py:2"},
                     "models": {"core": "models/__init__.py:1"}}
    assert find_cycle(graph) is None
