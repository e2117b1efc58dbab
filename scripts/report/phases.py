"""Where each attempt's time to its first step went: boot, environment, imports, distributed
start-up, restore, compile, the first step, and the rest.

Input: one attempt's metrics rows (scripts.report.goodput.split_attempts). The trainer's
`process_start` row carries the instants its supervisor passed (trainer.runtime.launch_times):
`boot_at` (the host or pod began its start-up script), `setup_at` and `setup_done_at` (fetching
the code and environment of the launch spec), `launched_at` (the trainer process was started).
The attempt starts at the earliest of them, else at `process_start`, and ends with its first
`step` row. Between those instants:

    boot          boot_at -> setup_at: reading the launch spec (a VM's or pod's start-up)
    environment   setup_at -> launched_at: code archive, Python environment, trainer user
    imports       the `imports` row: interpreter start and the trainer's libraries
    distributed   the `distributed_init` row: jax.distributed, every peer joining
    restore       the `restore` (or `fresh_start`) row: the state read or initialised
                  (shown as "restore/init")
    compile       the `compile` row, less the part that ran while the state was restored
    first step    the first `step` row's step time
    other         the rest: data set-up, mesh, the supervisor's own work

A phase whose rows are missing (an older trainer, a launch without a supervisor) is 0 and its
time lands in `other`, so the phases always add up to the attempt's time to its first step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

PHASES: tuple[str, ...] = (
    "boot", "environment", "imports", "distributed", "restore", "compile", "first_step", "other",
)
PHASE_LABELS: dict[str, str] = {
    "boot": "boot", "environment": "environment", "imports": "imports",
    "distributed": "distributed start-up", "restore": "restore/init", "compile": "compile",
    "first_step": "first step", "other": "other",
}


@dataclasses.dataclass(frozen=True)
class StartupPhases:
    start: float  # the earliest instant the attempt's rows name
    first_step_at: float | None  # None: the attempt never reached a step
    seconds: dict[str, float]  # every phase; sums to to_first_step_s when that is known
    compile_overlapped_s: float  # compile time hidden under the restore
    # The rows' instants contradict each other (the first step before the attempt's start: a
    # clock that stepped back, hand-edited rows): nothing is split, nothing negative is shown.
    inconsistent: bool = False

    @property
    def to_first_step_s(self) -> float | None:
        if self.first_step_at is None or self.inconsistent:
            return None
        return self.first_step_at - self.start


def finite_number(value: Any) -> float | None:
    """A metrics field as a float: None for anything but a finite int or float (bools too)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _instant(value: Any) -> float | None:
    number = finite_number(value)
    return number if number is not None and number > 0 else None


def _first(rows: Sequence[dict[str, Any]], *events: str) -> dict[str, Any] | None:
    return next((r for r in rows if r.get("event") in events), None)


def _interval(row: dict[str, Any] | None, key: str = "duration_s") -> tuple[float, float] | None:
    if row is None:
        return None
    end, length = finite_number(row.get("time")), finite_number(row.get(key))
    if end is None or length is None or length < 0:
        return None
    return end - length, end


def startup_phases(rows: Sequence[dict[str, Any]]) -> StartupPhases | None:
    """The phases of one attempt, or None for rows without a `process_start`."""
    process = _first(rows, "process_start")
    if process is None or finite_number(process.get("time")) is None:
        return None
    instants = {k: _instant(process.get(k)) for k in ("boot_at", "setup_at", "setup_done_at",
                                                      "launched_at")}
    launched = instants["launched_at"]
    start = min(v for v in (*instants.values(), float(process["time"])) if v is not None)
    seconds = dict.fromkeys(PHASES, 0.0)
    if instants["boot_at"] is not None and instants["setup_at"] is not None:
        seconds["boot"] = max(0.0, instants["setup_at"] - instants["boot_at"])
    if instants["setup_at"] is not None:
        seconds["environment"] = max(0.0, (launched if launched is not None
                                           else float(process["time"])) - instants["setup_at"])
    for phase, event in (("imports", "imports"), ("distributed", "distributed_init")):
        interval = _interval(_first(rows, event))
        if interval is not None:
            seconds[phase] = interval[1] - interval[0]
    restore = _interval(_first(rows, "restore", "fresh_start"))
    compile_ = _interval(_first(rows, "compile"))
    overlapped = 0.0
    if restore is not None:
        seconds["restore"] = restore[1] - restore[0]
    if compile_ is not None:
        if restore is not None:
            overlapped = max(0.0, min(compile_[1], restore[1]) - max(compile_[0], restore[0]))
        seconds["compile"] = compile_[1] - compile_[0] - overlapped
    step = _first(rows, "step")
    first_step_at = finite_number(step.get("time")) if step is not None else None
    if first_step_at is not None and first_step_at < start:
        return StartupPhases(start=start, first_step_at=first_step_at,
                             seconds=dict.fromkeys(PHASES, 0.0), compile_overlapped_s=0.0,
                             inconsistent=True)
    if step is not None:
        seconds["first_step"] = max(0.0, finite_number(step.get("step_time_s")) or 0.0)
    if first_step_at is not None:
        named = sum(v for k, v in seconds.items() if k != "other")
        seconds["other"] = max(0.0, (first_step_at - start) - named)
    return StartupPhases(start=start, first_step_at=first_step_at, seconds=seconds,
                         compile_overlapped_s=overlapped)


def format_phases(phases: StartupPhases) -> str:
    """`to first step 12.3 s: boot 0.4, environment 3.1, ...` (phases of 0 s left out)."""
    shown = ", ".join(f"{PHASE_LABELS[k]} {v:.1f}" for k, v in phases.seconds.items() if v >= 0.05)
    hidden = (f"; {phases.compile_overlapped_s:.1f} s of compile ran under the restore/init"
              if phases.compile_overlapped_s >= 0.05 else "")
    if phases.inconsistent:
        return ("to first step: not split (its first step row is timed before the attempt's "
                "start: the rows' clocks disagree)")
    total = phases.to_first_step_s
    head = f"to first step {total:.1f} s" if total is not None else "no step reached"
    return f"{head}: {shown or 'nothing timed'}{hidden}"
