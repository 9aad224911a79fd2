"""pdserve's module graph has no cycle: every import, lazy ones inside functions included, points down.

A cycle hidden behind a function-level import still ties two modules into one unit that cannot be
read, tested or moved apart; the parser sees those imports too, so nothing is imported here.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pdserve

PACKAGE_ROOT = Path(pdserve.__file__).parent
PACKAGE = "pdserve"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(tree: ast.Module, *, module: str, is_package: bool) -> Iterator[str]:
    """Every absolute name an import in ``tree`` refers to, relative imports resolved."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def import_graph() -> dict[str, set[str]]:
    """Module -> the pdserve modules it imports (a package's ``from x import y`` may name a submodule)."""
    paths = {module_name(path): path for path in sorted(PACKAGE_ROOT.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        names = imported_names(tree, module=module, is_package=path.name == "__init__.py")
        graph[module] = {name for name in names if name in paths and name != module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first; the graph is a few dozen modules)."""
    is_on_path: dict[str, bool] = {}  # absent: not seen; True: on the current path; False: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        is_on_path[node] = True
        path.append(node)
        for child in sorted(graph.get(node, ())):
            if is_on_path.get(child):
                return [*path[path.index(child):], child]
            if child not in is_on_path and (cycle := visit(child)):
                return cycle
        path.pop()
        is_on_path[node] = False
        return None

    for start in sorted(graph):
        if start not in is_on_path and (cycle := visit(start)):
            return cycle
    return None


def test_graph_sees_imports_inside_functions() -> None:
    graph = import_graph()

    assert "pdserve.verify.nixl_pair" in graph["pdserve.verify.microbench"]  # imported inside a function
    assert "pdserve.bench.plot" in graph["pdserve.bench.report"]


def test_find_cycle_names_the_modules_in_order() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_pdserve_module_graph_has_no_cycle() -> None:
    cycle = find_cycle(import_graph())

    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
