"""`multislice new NAME`: render the training template into experiments/NAME/."""

from __future__ import annotations

import argparse
import contextlib
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from scripts import PROJECT_ROOT
from scripts.argtypes import UsageError, report_error

TEMPLATE_DIR = PROJECT_ROOT / "template"
DEFAULT_OUTPUT_DIR = "experiments"
DEFAULT_PYTHON = "3.11"  # template/cookiecutter.json python_version: what its lock is for
CACHE_DIRS = ("__pycache__", ".pytest_cache", ".ruff_cache")
NAME_PATTERN = re.compile(r"^[a-z]([a-z0-9-]{0,62}[a-z0-9])?$")
NAME_RULE = ("1-64 characters: lowercase letters, digits and hyphens, starting with a letter "
             "and not ending with a hyphen")


class NewProjectError(ValueError):
    """The project cannot be created; the message says why and what is allowed."""


def validate_name(name: str) -> str:
    if not NAME_PATTERN.match(name):
        raise NewProjectError(f"invalid experiment name {name!r}: use {NAME_RULE} (e.g. my-model)")
    return name


def render_template(name: str, output_dir: str | Path = DEFAULT_OUTPUT_DIR, *,
                    description: str | None = None, author: str | None = None) -> Path:
    """Render template/ into OUTPUT_DIR/NAME and return that path; never overwrites."""
    from cookiecutter.main import cookiecutter

    validate_name(name)
    output_dir = Path(output_dir)
    target = output_dir / name
    if target.exists():
        raise NewProjectError(
            f"{target} already exists; choose another name or remove it first (nothing was "
            "overwritten)"
        )
    extra: dict[str, str] = {"project_slug": name}
    if description is not None:
        extra["description"] = description
    if author is not None:
        extra["author"] = author
    from infra.stack_config.userfile import UserFileError, directory

    absolute = output_dir.absolute()
    made = [d for d in (absolute, *absolute.parents) if not d.exists()]  # deepest first
    try:
        output_dir = directory(output_dir, "--output-dir")
    except UserFileError as exc:
        raise NewProjectError(str(exc)) from None
    try:
        rendered = cookiecutter(
            str(TEMPLATE_DIR),
            no_input=True,
            extra_context=extra,
            output_dir=str(output_dir),
            overwrite_if_exists=False,
        )
    except BaseException:
        # a refusal (or Ctrl-C) leaves nothing behind it created
        shutil.rmtree(output_dir / name, ignore_errors=True)
        for created in made:
            with contextlib.suppress(OSError):
                created.rmdir()  # only when empty: nothing of anyone else's goes
        raise
    rendered_path = Path(rendered)
    _remove_caches(rendered_path)
    return rendered_path


def _remove_caches(root: Path) -> None:
    # Caches left in template/ by running its tests or linter are not part of the template.
    for name in CACHE_DIRS:
        for cache in sorted(root.rglob(name), reverse=True):
            if cache.is_dir():
                shutil.rmtree(cache)


def _command(args: argparse.Namespace) -> int:
    try:
        path = render_template(args.name, args.output_dir, description=args.description,
                               author=args.author)
    except NewProjectError as exc:
        report_error("new", exc)
        return 2
    print(f"created {path}")
    from infra.packaging.lock import LOCK_FILE, LockError, check_lock

    try:
        header = check_lock(path, DEFAULT_PYTHON)
        print(f"  {LOCK_FILE}: the TPU VM environment for Python {header['python']}, locked with "
              "hashes (after changing dependencies: multislice lock --experiment "
              f"{path})")
    except LockError as exc:  # the template's lock is kept fresh by a test; say so if not
        print(f"  warning: {exc}", file=sys.stderr)
    # The interpreter this command runs on has the template's dependencies (a bare `python`
    # may be another one without jax).
    print(f"  cd {path} && {sys.executable} -m trainer.main --config tiny --steps 40 "
          "--run-dir runs/tiny")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "new",
        help="render the training template into a new experiment",
        description=f"Render template/ into OUTPUT_DIR/NAME. NAME: {NAME_RULE}.",
    )
    parser.add_argument("name", metavar="NAME", help="experiment name, e.g. my-model")
    parser.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR,
                        help=f"where to create it (default: {DEFAULT_OUTPUT_DIR}/)")
    parser.add_argument("--description", default=None, help="one line for pyproject/README")
    parser.add_argument("--author", default=None)
    parser.set_defaults(func=_command)


@contextlib.contextmanager
def experiment_dir(given: Path | None) -> Iterator[Path]:
    """The experiment to run: `given`, checked, or the default template rendered to a temp dir."""
    if given is not None:
        from infra.stack_config.userfile import UserFileError, resolve

        try:
            path = resolve(given, "--experiment")
        except UserFileError as exc:
            raise UsageError(str(exc)) from None
        if not (path / "trainer" / "main.py").is_file():
            raise UsageError(
                f"--experiment {given}: {path} has no trainer/main.py; expected a rendered "
                "experiment directory such as experiments/NAME (create one with `multislice new NAME`)"
            )
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="multislice-local-") as tmp:
        yield Path(render_template("local", Path(tmp))).resolve()
