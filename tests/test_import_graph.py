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
    """infra/boot/launch.py runs on a fresh TPU VM before anything of this project is installed."""
    import sys

    tree = ast.parse((ROOT / "infra" / "boot" / "launch.py").read_text())
    top = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
           for alias in node.names}
    top |= {node.module.split(".")[0] for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
    assert top - {"__future__"} <= set(sys.stdlib_module_names), top


ORCHESTRATIONS = ("infra.gke", "infra.tpu_vm")
# The shared top of infra/ that may reach into an orchestration package: the stack's wiring, and
# the validation that runs the shared checks and then the orchestration's own.
WIRES_ORCHESTRATIONS = {"infra.stack", "infra.stack_config.validation"}


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(f"{package}.")


def test_an_orchestration_package_never_imports_the_other():
    graph = import_graph()
    crossings = [f"{name} -> {dep}" for name, deps in graph.items() for dep in deps
                 for a in ORCHESTRATIONS for b in ORCHESTRATIONS
                 if a != b and _in(name, a) and _in(dep, b)]
    assert crossings == []


def test_only_the_wiring_and_the_validation_of_infra_reach_into_an_orchestration():
    graph = import_graph()
    shared = {name for name in graph if _in(name, "infra")
              and not any(_in(name, o) for o in (*ORCHESTRATIONS, "infra.boot"))}
    reaching = {name for name in shared for dep in graph[name]
                if any(_in(dep, o) for o in ORCHESTRATIONS)}
    allowed = WIRES_ORCHESTRATIONS
    assert reaching <= allowed, sorted(reaching - allowed)
    assert reaching, "the stack wires the orchestrations: the graph lost its imports"


def test_the_shared_schema_and_checks_import_no_orchestration_even_through_others():
    """The orchestrations stand above the schema: what the schema or the shared checks reach,
    directly or not, never includes infra.gke or infra.tpu_vm."""
    graph = import_graph()
    for root in ("infra.stack_config.schema", "infra.stack_config.checks", "infra.stack_config.stack_file"):
        seen, todo = set(), [root]
        while todo:
            for dep in graph[todo.pop()] - seen:
                seen.add(dep)
                todo.append(dep)
        assert not [d for d in seen if any(_in(d, o) for o in ORCHESTRATIONS)], (root, seen)


def test_infra_imports_neither_scripts_nor_policy():
    graph = import_graph()
    wrong = [f"{name} -> {dep}" for name, deps in graph.items() if _in(name, "infra")
             for dep in deps if _in(dep, "scripts") or _in(dep, "policy")]
    assert wrong == []


def test_the_trainer_never_imports_the_toolkit():
    """The template is forkable on its own: a team's experiment runs without infra/ or scripts/."""
    trainer = ROOT / "template" / "{{cookiecutter.project_slug}}" / "trainer"
    files = sorted(trainer.rglob("*.py"))
    assert len(files) > 20
    wrong = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module
                     and node.level == 0 else [])
            wrong += [f"{path.relative_to(trainer)}: {n}" for n in names
                      if n.split(".")[0] in ("infra", "scripts", "policy")]
    assert wrong == []


def test_the_pod_image_copies_every_module_its_environment_build_imports():
    """infra/boot/Dockerfile copies only the modules `python3 -m infra.packaging.env_build` runs:
    each module of that import closure (and every package __init__ on its way) must be copied."""
    graph = import_graph()
    needed, todo = set(), ["infra.packaging.env_build"]
    while todo:
        module = todo.pop()
        parts = module.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__ and a/b/__init__
            package = ".".join(parts[:i])
            if package not in needed:
                needed.add(package)
                todo.extend(graph.get(package, ()))
    files = {("/".join(m.split(".")) + ("/__init__.py" if (ROOT / m.replace(".", "/")).is_dir()
                                         else ".py")) for m in needed}
    copied = {word for line in (ROOT / "infra" / "boot" / "Dockerfile").read_text().splitlines()
              if line.startswith("COPY ") for word in line.split()[1:-1]}
    assert files <= copied, sorted(files - copied)
