"""An offline stand-in for `uv` in startup-script boots: records each call, installs nothing.

The startup script runs `uv venv --python V DIR` and `uv pip install --python DIR/bin/python CODE`.
Tests have no internet, so `venv` makes DIR/bin/python a wrapper around an existing interpreter
(whose environment already holds the experiment's dependencies) and `pip install` only records the
call; the trainer still runs from the unpacked code directory. Every call, and every start of the
wrapped interpreter, is appended to a log so a test can count venv creations and trainer runs.
"""

from __future__ import annotations

import shlex
from pathlib import Path

_UV = """#!/bin/bash
set -euo pipefail
printf 'uv %s\\n' "$*" >>{log}
if [[ "$1" == venv ]]; then
  dir="${{@: -1}}"
  mkdir -p "$dir/bin"
  cat >"$dir/bin/python" <<'EOF'
#!/bin/bash
printf 'python %s\\n' "$*" >>{log}
exec {python} "$@"
EOF
  chmod +x "$dir/bin/python"
fi
"""


def write_fake_uv(dest: Path, python: str, calls_log: Path) -> Path:
    """Write an executable fake `uv` into `dest`; venvs it makes run `python`. Returns its path."""
    dest.mkdir(parents=True, exist_ok=True)
    uv = dest / "uv"
    uv.write_text(_UV.format(log=shlex.quote(str(calls_log)), python=shlex.quote(python)))
    uv.chmod(0o755)
    return uv


def read_calls(calls_log: Path) -> list[list[str]]:
    """The recorded calls, each split into words: ["uv", "venv", ...] or ["python", "-m", ...]."""
    if not calls_log.exists():
        return []
    return [line.split() for line in calls_log.read_text().splitlines() if line.strip()]
