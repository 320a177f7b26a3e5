"""The project's import graph (module-level and function-local imports alike) has no circles
(issue 32), and keeps DESIGN.md's layers: profiles below simulator below planner; reports
draw plain data and import nothing from the planner or the executor; the executor reads
plans and specs, never the planner's search."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("planner", "simulator", "profiles", "reports", "executor")
KNOWN_CIRCLES: list[set[str]] = []
"""Circles left: none (the last, executor.run <-> executor.session, went when the entry
points moved to executor.session)."""


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its text."""
    modules = {}
    for path in ROOT.rglob("*.py"):
        relative = path.relative_to(ROOT)
        if relative.parts[0] not in PACKAGES:
            continue
        name = ".".join(relative.with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles() -> None:
    assert sorted(map(sorted, circles(import_graph()))) == sorted(map(sorted, KNOWN_CIRCLES))


def test_the_layers_import_downwards() -> None:
    graph = import_graph()
    upward = sorted((a, b) for a, targets in graph.items() for b in targets
                    if (a.startswith("profiles") and b.split(".")[0] in ("simulator", "planner"))
                    or (a.startswith("simulator") and b.startswith("planner"))
                    or (a.startswith("executor") and b.startswith("planner.search"))
                    # Reports take plain data: tables, figures' series, simulator records.
                    or (a.startswith("reports") and b.split(".")[0] in ("planner", "executor")))
    assert upward == []
