"""No import cycles inside `model`, `sessions` and `tools`.

The graph is read from the source with `ast`, not by importing anything: every import
in a file is an edge, at module level or inside a function (an import moved into a
function still runs, and the cycle is still there); only `if TYPE_CHECKING:` blocks are
left out, since they never run. `from a.b import c` is an edge to `a.b.c` when that is a
module, else to `a.b`; relative imports are resolved against the importing file. A
submodule's implicit import of its parent package is not an edge.
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("model", "sessions", "tools")


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under PACKAGES."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, skipping the bodies of `if TYPE_CHECKING:`."""
    found: list[ast.Import | ast.ImportFrom] = []

    def walk(node: ast.AST) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            children: list[ast.AST] = [node.test, *node.orelse]
        else:
            children = list(ast.iter_child_nodes(node))
        for child in children:
            walk(child)

    walk(tree)
    return found


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """`name` if it is one of ours, else its longest prefix that is, else None."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _targets(module: str, path: Path, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join(package + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    return [t for t in (_known(n, modules) for n in names) if t is not None and t != module]


def import_graph() -> dict[str, dict[str, str]]:
    """module -> {imported module: "file:line" of the first import of it}."""
    modules = _modules()
    graph: dict[str, dict[str, str]] = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, {})
        for node in _imports(ast.parse(path.read_text(), filename=str(path))):
            for target in _targets(module, path, node, modules):
                edges.setdefault(target, f"{path.relative_to(ROOT)}:{node.lineno}")
    return graph


def _components(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def _shortest_cycle(graph: dict[str, dict[str, str]], start: str, within: set[str]) -> list[str]:
    """The shortest chain start -> ... -> start inside one component."""
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(graph[node]):
            if child not in within:
                continue
            if child == start:
                chain = [node]
                while chain[-1] != start:
                    chain.append(parent[chain[-1]])
                return [*reversed(chain), start]
            if child not in parent:
                parent[child] = node
                queue.append(child)
    raise AssertionError(f"{start} is in a component but on no cycle")


def cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """For every module in a cycle, the shortest cycle through it (each cycle listed once)."""
    seen: set[tuple[str, ...]] = set()
    out = []
    for component in _components(graph):
        for module in component:
            chain = _shortest_cycle(graph, module, set(component))
            ring = chain[:-1]
            first = ring.index(min(ring))
            key = tuple(ring[first:] + ring[:first])
            if key not in seen:
                seen.add(key)
                out.append([*key, key[0]])
    return out


def describe(graph: dict[str, dict[str, str]], chain: list[str]) -> str:
    return "  " + "\n    -> ".join(
        [chain[0]] + [f"{b}  ({graph[a][b]})" for a, b in zip(chain, chain[1:])])


def test_graph_resolves_imports():
    graph = import_graph()
    assert "model.kernels" in graph["model.engram"]  # `from model import kernels`
    assert "sessions.blob" in graph["sessions.store"]  # a relative `from .blob import ...`
    assert "model.kernels.fused" in graph["model.kernels.pack"]  # `from model.kernels.fused import ...`
    assert "model.kernels" in graph["model.kernels.bench"]  # `from model.kernels import indexer_scores_ref, ...`
    assert "model.kernels.matvec" in graph["model.kernels"]  # inside a function: it still runs


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b": "a.py:1"}, "b": {"c": "b.py:1"}, "c": {"a": "c.py:9"}, "d": {"a": "d.py:1"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert "c.py:9" in describe(graph, cycles(graph)[0])


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(describe(graph, c) for c in found)
