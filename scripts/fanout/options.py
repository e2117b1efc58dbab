"""What one `multislice run` does and how patiently: the options every fan-out part reads."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REMOTE_ROOT = "~/.multislice/runs"
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class RunOptions:
    command: str
    run_id: str
    log_dir: Path
    max_concurrency: int = 16
    poll_interval_s: float = 5.0
    # How long a worker may stay unreachable (at launch or while polling) before the run fails.
    unreachable_timeout_s: float = 120.0
    call_timeout_s: float = 60.0  # one SSH call, end to end
    stop_grace_s: float = 10.0  # SIGTERM, then SIGKILL after this long
    run_timeout_s: float | None = None
    workdir: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    upload: Path | None = None
    tail_lines: int = 20
    remote_root: str = REMOTE_ROOT  # per-run directories go under here on every worker
    max_log_chunk_bytes: int = 4 * 1024 * 1024

    def __post_init__(self) -> None:
        if not _RUN_ID_RE.match(self.run_id):
            raise ValueError(
                f"run id {self.run_id!r} is not allowed; use 1-64 letters, digits, '.', '_' or '-', "
                "starting with a letter or digit"
            )
        if self.max_concurrency < 1:
            raise ValueError(f"max concurrency must be at least 1, got {self.max_concurrency}")
        for key, _ in self.env:
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key):
                raise ValueError(f"environment variable name {key!r} is not a valid shell name")
