"""The last step this process finished, in a file its supervisor reads: `MULTISLICE_PROGRESS_FILE`.

One line, `STEP UNIX_TIME STEP_TIME_S LONGEST_PAUSE_S`, replaced (write, then rename) after every
step; the pause is the longest time this process spent between two steps on anything but a step
(an evaluation, a blocking save). The GKE pod's start-up script reads it after a pod deletion's
SIGTERM: a trainer that finishes a step after the notice reaches its save; one that does not
within a few step times (or twice its longest pause) is blocked on a peer that is gone, and is
ended instead of waiting out JAX's heartbeat timeout (infra/boot/startup.sh).
"""

from __future__ import annotations

import os
import time

PROGRESS_FILE_ENV = "MULTISLICE_PROGRESS_FILE"


class ProgressFile:
    """Writes nothing when the variable is unset or the file cannot be written (a report, never a
    reason to stop training)."""

    def __init__(self, path: str | None = None) -> None:
        self.path = os.environ.get(PROGRESS_FILE_ENV) if path is None else path
        self.longest_pause_s = 0.0

    def paused(self, seconds: float) -> None:
        """Time spent between steps on something else; the next `step` reports the longest."""
        self.longest_pause_s = max(self.longest_pause_s, seconds)

    def step(self, step: int, step_time_s: float) -> None:
        if not self.path:
            return
        partial = f"{self.path}.part"
        try:
            with open(partial, "w") as out:
                out.write(f"{step} {time.time():.3f} {step_time_s:.3f} "
                          f"{self.longest_pause_s:.3f}\n")
            os.replace(partial, self.path)
        except OSError:
            self.path = None  # once is enough: the supervisor then falls back to its own limit
