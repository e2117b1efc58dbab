"""The experiment's lock: exact versions with hashes of everything the TPU VMs install.

`requirements-tpu.lock` in the experiment directory is `uv pip compile` output for the TPU VM
(linux x86_64, the stack's Python, the experiment's dependencies plus its `tpu` extra, libtpu
included), with one line of our own at the top:

    # multislice-lock: {"body": "<sha256>", "inputs": "<sha256>", "interpreter": "3.11.18", "platform": "x86_64-manylinux_2_35", "python": "3.11"}

`inputs` is the digest of what the resolution depends on in pyproject.toml (requires-python,
dependencies, the tpu extra), so a lock goes stale exactly when one of those changes, not when the
description does. `body` is the digest of everything below the header, so a hand-edited pin, a
removed hash or an added package is refused at preview, not on the VMs. `interpreter` is the exact CPython every VM runs the lock with (a managed
python-build-standalone build that the startup script installs with its pinned uv, under
/opt/multislice; part of the environment's key), so the lock and its interpreter travel together.
`multislice new` creates the lock and `multislice lock` remakes it; preview
refuses a missing or stale one (`check_lock`); every VM installs exactly it with
`uv pip sync --require-hashes`, so a slice rebuilt by auto-repair weeks later runs the same jax,
jaxlib and libtpu as the slices it talks to.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import tempfile
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

LOCK_FILE = "requirements-tpu.lock"
LOCK_EXTRA = "tpu"
# TPU VM images are Ubuntu 22.04 (glibc 2.35) on x86_64.
TPU_PLATFORM = "x86_64-manylinux_2_35"
HEADER_PREFIX = "# multislice-lock: "
# The CPython build of each supported minor version that the VMs install: managed downloads the
# startup script's pinned uv (UV_VERSION in infra/boot/startup.sh) lists with their sha256
# (`uv python list --only-downloads`), so every host installs byte-identical interpreters.
VM_INTERPRETERS = {"3.11": "3.11.18", "3.12": "3.12.16", "3.13": "3.13.18"}
_INTERPRETER_RE = re.compile(r"^3\.(\d+)\.(\d+)$")


class LockError(ValueError):
    """The experiment's lock is missing, stale or for another platform; the message says the fix."""


def lock_inputs(pyproject: Path) -> dict[str, Any]:
    """The parts of pyproject.toml that decide the resolution."""
    try:
        project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    except (OSError, tomllib.TOMLDecodeError, KeyError) as exc:
        raise LockError(f"{pyproject}: cannot read its [project] table ({exc})") from None
    extras = project.get("optional-dependencies") or {}
    if LOCK_EXTRA not in extras:
        raise LockError(
            f"{pyproject}: no [project.optional-dependencies] {LOCK_EXTRA} extra; TPU VMs install "
            f"it (e.g. {LOCK_EXTRA} = [\"jax[tpu]\"]) or JAX runs on the host CPU"
        )
    return {
        "requires-python": project.get("requires-python", ""),
        "dependencies": sorted(project.get("dependencies") or []),
        LOCK_EXTRA: sorted(extras[LOCK_EXTRA]),
    }


def inputs_digest(pyproject: Path) -> str:
    text = json.dumps(lock_inputs(pyproject), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def read_header(lock: Path) -> dict[str, Any] | None:
    """Our header of a lock file, or None when the file has none."""
    with open(lock, encoding="utf-8") as fh:
        first = fh.readline()
    if not first.startswith(HEADER_PREFIX):
        return None
    try:
        header = json.loads(first[len(HEADER_PREFIX):])
    except json.JSONDecodeError:
        return None
    return header if isinstance(header, dict) else None


def pinned_versions(lock: Path) -> dict[str, str]:
    """{normalised package name: version} of every `name==version` pin in a lock file."""
    pins = {}
    for line in lock.read_text(encoding="utf-8").splitlines():
        match = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;\\]+)", line)
        if match:
            pins[match[1].lower().replace("_", "-")] = match[2]
    return pins


def body_digest(text: str) -> str:
    """sha256 of a lock's text after its header line: what `multislice lock` wrote below it."""
    return hashlib.sha256(text.partition("\n")[2].encode()).hexdigest()


def body_problems(text: str) -> list[str]:
    """What in a lock's body `uv pip sync --require-hashes` would refuse on the VMs: an entry that
    is not an exact `name==version` pin, or a pin without a `--hash=sha256:` line."""
    problems: list[str] = []
    entry, hashes = None, 0
    for line in [*text.splitlines()[1:], ""]:
        stripped = line.strip()
        starts_entry = bool(line) and not line[0].isspace() and not line.startswith("#")
        if (starts_entry or not line) and entry is not None and hashes == 0:
            problems.append(f"{entry} has no --hash line")
        if starts_entry:
            entry = line.split(" \\")[0].split(";")[0].strip()
            hashes = 0
            if not re.match(r"^[A-Za-z0-9_.\-]+(\[[^\]]*\])?==[^\s=]+$", entry):
                problems.append(f"{entry!r} is not an exact name==version pin")
        elif stripped.startswith("--hash=sha256:"):
            hashes += 1
    return problems


def fix_command(experiment: Path, python_version: str) -> str:
    return f"multislice lock --experiment {experiment} --python {python_version}"


def check_lock(experiment: Path, python_version: str) -> dict[str, Any]:
    """Raises LockError unless the experiment's lock is fresh for this Python on TPU VMs."""
    lock = experiment / LOCK_FILE
    fix = fix_command(experiment, python_version)
    if not lock.is_file():
        raise LockError(f"{lock} is missing: the TPU VMs install exactly that lock; create it "
                        f"with `{fix}`")
    header = read_header(lock)
    if header is None:
        raise LockError(f"{lock} has no '{HEADER_PREFIX.strip()}' header line, so its inputs are "
                        f"unknown; remake it with `{fix}`")
    want = inputs_digest(experiment / "pyproject.toml")
    if header.get("inputs") != want:
        raise LockError(f"{lock} is stale: pyproject.toml's dependencies, tpu extra or "
                        f"requires-python changed since it was made; remake it with `{fix}`")
    if header.get("python") != python_version:
        raise LockError(f"{lock} was resolved for Python {header.get('python')!r}, but the stack "
                        f"runs python_version {python_version!r}; remake it with `{fix}` (or set "
                        f"python_version: {header.get('python')!r})")
    interpreter = str(header.get("interpreter", ""))
    if not _INTERPRETER_RE.match(interpreter) or \
            not interpreter.startswith(f"{python_version}."):
        raise LockError(f"{lock} names interpreter {header.get('interpreter')!r}; the VMs need a "
                        f"full CPython {python_version}.PATCH version there (the one they "
                        f"install); remake it with `{fix}`")
    if header.get("platform") != TPU_PLATFORM:
        raise LockError(f"{lock} was resolved for platform {header.get('platform')!r}; TPU VMs "
                        f"need {TPU_PLATFORM!r}; remake it with `{fix}`")
    # The body, not only the header: a hand-edited pin, a removed hash or an added package would
    # pass here and fail only on the VMs, after the slices are provisioned.
    text = lock.read_text(encoding="utf-8")
    problems = body_problems(text)
    if "body" not in header:
        raise LockError(f"{lock} has no body digest in its header (made by an older toolkit); "
                        f"remake it with `{fix}`")
    if header["body"] != body_digest(text):
        detail = f" ({'; '.join(problems[:3])})" if problems else ""
        raise LockError(f"{lock} was edited after `multislice lock` made it: its body no longer "
                        f"matches the digest in its header{detail}; the VMs install it with "
                        f"`uv pip sync --require-hashes`; remake it with `{fix}`")
    if problems:
        raise LockError(f"{lock}: {'; '.join(problems[:3])}; the VMs install it with `uv pip "
                        f"sync --require-hashes`, which refuses that; remake it with `{fix}`")
    return header


def find_uv() -> str:
    try:
        import uv

        return uv.find_uv_bin()
    except (ImportError, FileNotFoundError) as exc:
        raise LockError(f"the uv binary is not installed in this environment ({exc}); "
                        "`pip install uv`") from None


def vm_interpreter(python_version: str) -> str:
    """The exact CPython the VMs install for a 3.MINOR python_version."""
    try:
        return VM_INTERPRETERS[python_version]
    except KeyError:
        raise LockError(f"python_version {python_version!r} has no pinned VM interpreter; "
                        f"allowed: {', '.join(VM_INTERPRETERS)}") from None


def write_lock(experiment: Path, python_version: str, *, platform: str = TPU_PLATFORM,
               interpreter: str | None = None, extra_args: Sequence[str] = ()) -> Path:
    """Resolves the experiment for the TPU VMs with uv and writes LOCK_FILE atomically.

    `interpreter` (default: VM_INTERPRETERS) is recorded in the header: the CPython the VMs run
    the lock with. `extra_args` go to `uv pip compile` (e.g. --offline, -c constraints.txt).
    Raises LockError with uv's own message when the resolution fails.
    """
    pyproject = experiment / "pyproject.toml"
    interpreter = interpreter or vm_interpreter(python_version)
    if not _INTERPRETER_RE.match(interpreter) or not interpreter.startswith(f"{python_version}."):
        raise LockError(f"interpreter {interpreter!r} is not a CPython {python_version}.PATCH "
                        "version")
    header = {"inputs": inputs_digest(pyproject), "interpreter": interpreter,
              "platform": platform, "python": python_version}
    target = experiment / LOCK_FILE
    fd, tmp = tempfile.mkstemp(dir=experiment, prefix=f".{LOCK_FILE}.")
    os.close(fd)
    try:
        cmd = [find_uv(), "pip", "compile", "--quiet", str(pyproject), "--extra", LOCK_EXTRA,
               "--python-version", python_version, "--python-platform", platform,
               "--generate-hashes", "--no-header", "--output-file", tmp, *extra_args]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise LockError(f"resolving {pyproject} for {platform}, Python {python_version} "
                            f"failed:\n{result.stderr.strip()}")
        below = (f"# Made by `{fix_command(Path('.'), python_version)}`; the TPU VMs install "
                 "exactly this (uv pip sync --require-hashes).\n"
                 + Path(tmp).read_text(encoding="utf-8"))
        header["body"] = body_digest("\n" + below)
        Path(tmp).write_text(HEADER_PREFIX + json.dumps(header, sort_keys=True) + "\n" + below,
                             encoding="utf-8")
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return target
