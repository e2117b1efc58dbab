"""No module of infra/ imports one that imports it back (annotation imports included)."""

from __future__ import annotations

import ast
from pathlib import Path

INFRA = Path(__file__).resolve().parents[2] / "infra"


def infra_imports() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in INFRA.rglob("*.py"):
        parts = path.relative_to(INFRA.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):  # function-level and TYPE_CHECKING too
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
        graph[name] = {m for m in found if m == "infra" or m.startswith("infra.")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                return path[path.index(dep):] + [dep]
            if dep in graph and dep not in state and (cycle := visit(dep, [*path, dep])):
                return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_infra_module_imports_one_that_imports_it_back():
    graph = infra_imports()
    assert "infra.stack_config.schema" in graph and "infra.stack_config.validation" in graph
    assert "infra.packaging.experiment" not in graph["infra.stack_config.schema"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])
