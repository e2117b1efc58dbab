"""What happened before this trainer process ran: the start-up phases its supervisor timed.

The supervisor that starts the trainer (infra/boot/startup.sh on a TPU VM or a GKE pod,
`multislice local` on a laptop) passes wall-clock instants (seconds since the epoch) in the
environment; the trainer writes them into its `process_start` row, where `multislice report`
splits each attempt's time to its first step into boot, environment, imports, distributed
start-up, restore, compile and the first step:

    MULTISLICE_BOOT_AT        the host or pod began its start-up script (first launch of a boot)
    MULTISLICE_SETUP_AT       it began fetching the code and environment of the launch spec
    MULTISLICE_SETUP_DONE_AT  the code, environment and trainer user were ready
    MULTISLICE_LAUNCHED_AT    the supervisor started this process (every launch)

They are timing only: a value that is not a finite number, or lies in the future, is left out
of the row rather than failing a run over a report.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

SUPERVISOR_TIMES: dict[str, str] = {
    "boot_at": "MULTISLICE_BOOT_AT",
    "setup_at": "MULTISLICE_SETUP_AT",
    "setup_done_at": "MULTISLICE_SETUP_DONE_AT",
    "launched_at": "MULTISLICE_LAUNCHED_AT",
}
CLOCK_SKEW_S = 5.0  # a supervisor's instant may read slightly ahead of this process's clock


def supervisor_times(now: float, environ: Mapping[str, str] | None = None) -> dict[str, float]:
    """The instants the supervisor passed, by row field, each at most `now` (+ clock skew)."""
    environ = os.environ if environ is None else environ
    out: dict[str, float] = {}
    for field, variable in SUPERVISOR_TIMES.items():
        try:
            value = float(environ[variable])
        except (KeyError, ValueError):
            continue
        if math.isfinite(value) and 0 < value <= now + CLOCK_SKEW_S:
            out[field] = value
    return out
