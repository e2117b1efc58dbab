"""`multislice lock`: (re)make an experiment's TPU lock, requirements-tpu.lock (see infra/packaging/lock.py).

Run it after changing the experiment's dependencies, its tpu extra or requires-python, or to move
a stack to another Python; `pulumi preview` refuses a stale lock and names this command.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from scripts.argtypes import UsageError, report_error

EXIT_FAILED = 1
EXIT_USAGE = 2


def _command(args: argparse.Namespace) -> int:
    from infra.packaging.lock import LockError, check_lock, pinned_versions, read_header, write_lock

    experiment: Path = args.experiment
    if not (experiment / "pyproject.toml").is_file():
        report_error("lock", UsageError(f"--experiment {experiment}: no pyproject.toml there; "
                                        "expected a directory made by `multislice new`"))
        return EXIT_USAGE
    try:
        lock = write_lock(experiment, args.python)
        check_lock(experiment, args.python)
    except LockError as exc:
        report_error("lock", exc)
        return EXIT_FAILED
    pins = pinned_versions(lock)
    header = read_header(lock) or {}
    print(f"wrote {lock} for Python {header.get('python')} on {header.get('platform')}: "
          + ", ".join(f"{k} {pins[k]}" for k in ("jax", "jaxlib", "libtpu") if k in pins))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "lock",
        help="resolve an experiment's TPU VM environment into requirements-tpu.lock",
        description="Resolve the experiment's dependencies plus its tpu extra for TPU VMs (linux "
        "x86_64) with uv, exact versions with hashes, into EXPERIMENT/requirements-tpu.lock. "
        "Needs the package index (PyPI). Exit codes: 0 written, 1 resolution failed, 2 usage.",
    )
    parser.add_argument("--experiment", type=Path, required=True, metavar="DIR",
                        help="the experiment directory (made by multislice new)")
    parser.add_argument("--python", default="3.11", metavar="3.MINOR",
                        help="the stack's python_version (default %(default)s)")
    parser.set_defaults(func=_command)
