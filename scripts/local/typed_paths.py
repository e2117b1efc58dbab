"""One rule for relative paths: a path typed on a command line is relative to where it was typed.

`multislice local` starts each trainer in the experiment directory (it imports the experiment's
`trainer` package from there), so a relative path handed on as typed would be read against the
experiment, not the user's shell. The launcher makes the trainer's path arguments absolute first:
`--config FILE.toml`, and `--set KEY=PATH` for the trainer's path keys. gs:// URIs and empty
values pass unchanged. Paths inside a stack file or a preset are relative to what holds them and
are not touched here.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Sequence
from pathlib import Path

# The trainer's settings that name a local path or a gs:// URI (trainer/config.py makes the same
# ones absolute against its own working directory).
TRAINER_PATH_KEYS = ("data.path", "train.init_from")


def _absolute(value: str, cwd: Path) -> str:
    if not value or value.startswith("gs://"):
        return value
    return os.path.normpath(os.path.join(cwd, os.path.expanduser(value)))


def _absolute_setting(value: str, cwd: Path) -> str:
    """`KEY=PATH` with PATH absolute when KEY is a path key. The value is read as the trainer
    reads it (trainer.config.parse_override: a TOML scalar, else the bare text), so a quoted path
    stays quoted and a path inside the quotes is what gets resolved."""
    key, sep, raw = value.partition("=")
    if not sep or key.strip() not in TRAINER_PATH_KEYS:
        return value
    raw = raw.strip()
    try:
        parsed = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = raw
    if not isinstance(parsed, str):
        return value  # not a path: the trainer names the wrong type
    path = _absolute(parsed, cwd)
    if path == parsed:
        return value
    return f"{key}={json.dumps(path) if parsed != raw else path}"


def absolute_trainer_paths(args: Sequence[str], cwd: Path) -> tuple[list[str], list[str]]:
    """(the arguments with every relative path made absolute against `cwd`, "KEY=PATH" for each
    one that changed)."""
    out, changed = list(args), []
    index = 0
    while index < len(out):
        arg = out[index]
        flag, eq, inline = arg.partition("=")
        if flag in ("--set", "--config") and (eq or index + 1 < len(out)):
            at = index if eq else index + 1
            value = inline if eq else out[at]
            if flag == "--set":
                new = _absolute_setting(value, cwd)
            else:
                new = _absolute(value, cwd) if value.endswith(".toml") else value
            if new != value:
                changed.append(new if flag == "--set" else f"--config {new}")
                out[at] = f"{flag}={new}" if eq else new
            index = at + 1
            continue
        index += 1
    return out, changed
