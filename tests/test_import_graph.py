"""The project's modules import each other without circles.

Imports inside functions count (a lazy circle still ties two modules together); imports under
`if TYPE_CHECKING:` do not (they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("infra", "scripts", "policy")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _type_checking_only(tree: ast.Module) -> set[ast.AST]:
    """Import statements under `if TYPE_CHECKING:` (never run, so never part of a circle)."""
    skipped: set[ast.AST] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {n for child in node.body for n in ast.walk(child)}
    return skipped


def _imports(path: Path, modules: set[str]) -> set[str]:
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    skipped = _type_checking_only(tree)
    for node in ast.walk(tree):
        if node in skipped:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        else:
            continue
        found |= {name for name in names if name in modules}
    return found


def import_graph() -> dict[str, set[str]]:
    files = [p for package in PACKAGES for p in (ROOT / package).rglob("*.py")]
    modules = {_module_name(p): p for p in files}
    graph = {}
    for name, path in modules.items():
        # importing a.b runs a/__init__ first: a package importing its own module is no circle
        graph[name] = {m for m in _imports(path, set(modules)) if m != name
                       and not m.startswith(f"{name}.")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_circles_in_infra_scripts_or_policy():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_vm_side_files_use_the_standard_library_only():
    """infra/vm/launch.py runs on a fresh TPU VM before anything of this project is installed."""
    import sys

    tree = ast.parse((ROOT / "infra" / "vm" / "launch.py").read_text())
    top = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
           for alias in node.names}
    top |= {node.module.split(".")[0] for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
    assert top - {"__future__"} <= set(sys.stdlib_module_names), top
