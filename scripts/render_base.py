"""`multislice render STACK --diff-base REF`: the base of a review rendered from a git ref.

The way CI's render-diff job does it: the tree at REF (`git archive`, so the working tree and the
index are untouched) is rendered by REF's own code, with this interpreter. An example stack whose
experiments/NAME is not committed gets it rendered from REF's template (`multislice new NAME`), a
stack config that REF does not have compares against an empty stack, and a base that cannot render
is shown as empty with its error line. Every such fallback is a `base:` line above the diff.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml

from scripts import PROJECT_ROOT as ROOT


class BaseRefError(ValueError):
    """REF or the repository cannot give a base; the message says why."""

_NEW_EXPERIMENT = re.compile(r"^experiments/[a-z][a-z0-9-]*[a-z0-9]$")


def _git(top: Path, *args: str, binary: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(top), *args], capture_output=True, text=not binary,
                          timeout=120)


def _last_line(text: str | bytes) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no message"


def repository_top(root: Path = ROOT) -> Path:
    try:
        result = _git(root, "rev-parse", "--show-toplevel")
    except FileNotFoundError:
        raise BaseRefError("--diff-base needs git on PATH (it reads the base from the "
                          "repository); use --diff FILE with a manifest instead") from None
    if result.returncode != 0:
        raise BaseRefError(f"--diff-base: {root} is not in a git repository "
                          f"({_last_line(result.stderr)}); use --diff FILE instead")
    return Path(result.stdout.strip()).resolve()


def resolve_commit(ref: str, top: Path) -> str:
    result = _git(top, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    if result.returncode != 0 or not result.stdout.strip():
        raise BaseRefError(f"--diff-base {ref!r}: not a commit of the repository at {top}; give "
                          "a branch (main, origin/main), a tag or a commit sha")
    return result.stdout.strip()


def extract_tree(commit: str, top: Path, into: Path) -> None:
    """The committed tree at `commit` under `into` (what a checkout of it would hold)."""
    result = _git(top, "archive", "--format=tar", commit, binary=True)
    if result.returncode != 0:
        raise BaseRefError(f"--diff-base: git archive {commit[:12]} failed "
                          f"({_last_line(result.stderr)})")
    with tarfile.open(fileobj=io.BytesIO(result.stdout), mode="r:") as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(into, filter="data")
        else:  # Python < 3.11.4: git archive writes plain relative members
            tar.extractall(into)  # noqa: S202


def _experiment_dir(stack_file: Path) -> str:
    from infra.stack_config.userfile import UserFileError, load_yaml, read_text

    try:
        doc = load_yaml(read_text(stack_file, "stack file"), str(stack_file)) or {}
    except (UserFileError, yaml.YAMLError):
        return ""
    config = doc.get("config") if isinstance(doc, dict) else None
    value = config.get("multislice:experiment_dir") if isinstance(config, dict) else None
    return value if isinstance(value, str) else ""


def _python_env(project: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(project)
    return env


def _ensure_experiment(base_project: Path, base_stack: Path, ref: str) -> list[str]:
    """Render a stack's uncommitted experiments/NAME from the base's template, as CI does."""
    rel = _experiment_dir(base_stack)
    if not _NEW_EXPERIMENT.match(rel) or (base_project / rel).exists():
        return []
    if not (base_project / "scripts" / "new.py").is_file():
        return []
    name = rel.split("/", 1)[1]
    result = subprocess.run([sys.executable, "-m", "scripts.cli", "new", name], cwd=base_project,
                            env=_python_env(base_project), capture_output=True, text=True,
                            timeout=300)
    if result.returncode != 0:
        return [f"base: {ref} cannot render {rel} from its template "
                f"({_last_line(result.stderr)})"]
    return [f"base: {rel} is not committed at {ref}: rendered from {ref}'s template "
            f"(`multislice new {name}`), as CI does"]


@dataclass(frozen=True)
class BaseRender:
    """The stack as REF renders it: `manifest` (a file under `project`, None when REF has no
    render of it) and the `base:` lines that say how it was made."""

    project: Path
    manifest: Path | None
    notes: list[str]


@contextmanager
def render_base(ref: str, stack_file: Path, root: Path = ROOT) -> Iterator[BaseRender]:
    """Render the stack config from the tree at REF by REF's code; the tree lives until exit."""
    top = repository_top(root)
    commit = resolve_commit(ref, top)
    try:
        stack_rel = stack_file.resolve().relative_to(top)
        project_rel = root.resolve().relative_to(top)
    except ValueError:
        raise BaseRefError(f"--diff-base: the stack config {stack_file} is outside the repository "
                           f"{top}, so it has no version at {ref}; use --diff FILE") from None
    notes = [f"base: {ref} at {commit[:12]}, rendered by its own code"]
    with tempfile.TemporaryDirectory(prefix="multislice-base-") as tmp:
        tree = Path(tmp)
        extract_tree(commit, top, tree)
        base_project, base_stack = tree / project_rel, tree / stack_rel
        if not base_stack.is_file():
            yield BaseRender(base_project, None, [
                *notes, f"base: {stack_rel} is not in {ref}: a new stack config, everything in it "
                        "is added"])
            return
        if not (base_project / "scripts" / "render.py").is_file():
            yield BaseRender(base_project, None, [
                *notes, f"base: {ref} has no `multislice render`: everything is shown as added"])
            return
        notes += _ensure_experiment(base_project, base_stack, ref)
        out = tree / ".multislice-base-manifest.yaml"
        result = subprocess.run(
            [sys.executable, "-m", "scripts.cli", "render", str(base_stack), "--output", str(out)],
            cwd=base_project, env=_python_env(base_project), capture_output=True, text=True,
            timeout=600)
        if result.returncode != 0 or not out.is_file():
            notes.append(f"base: {ref} cannot render {stack_rel} ({_last_line(result.stderr)}): "
                         "everything is shown as added")
            yield BaseRender(base_project, None, notes)
            return
        yield BaseRender(base_project, out, notes)
