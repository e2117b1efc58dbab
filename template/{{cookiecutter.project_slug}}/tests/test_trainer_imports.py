"""The trainer's modules import each other without circles, imports inside functions included
(a lazy import still ties two modules together: config.py once asked the model registry, which
imports the transformer, which imports the pipeline, which imports config.py). What describes
the model sits above the config: trainer/model/checks.py and registry.py import config.py,
never the reverse."""

from __future__ import annotations

import ast
from pathlib import Path

TRAINER = Path(__file__).resolve().parents[1] / "trainer"


def module_name(path: Path) -> str:
    parts = ["trainer", *path.relative_to(TRAINER).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, modules: set[str]) -> set[str]:
    """The trainer modules `path` imports anywhere in its body (not under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    skipped = {n for node in ast.walk(tree)
               if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
               for child in node.body for n in ast.walk(child)}
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if node in skipped:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        found |= {n for n in names if n in modules}
    return found


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in TRAINER.rglob("*.py")}
    return {name: {m for m in imported(path, set(paths))
                   if m != name and not m.startswith(f"{name}.")
                   and not name.startswith(f"{m}.")}  # a module's own package: no circle
            for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_trainers_modules_import_each_other_without_a_circle():
    graph = import_graph()
    assert {"trainer.config", "trainer.model.registry", "trainer.model.checks"} <= set(graph)
    assert "trainer.model.registry" in graph["trainer.model.checks"]
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_config_imports_no_model_code_but_rope():
    assert {m for m in import_graph()["trainer.config"] if m.startswith("trainer.model")} <= {
        "trainer.model.rope"}


def test_a_circle_is_found_where_there_is_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
