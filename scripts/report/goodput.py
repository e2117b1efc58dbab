"""Goodput accounting: where the wall time of a run went, across restarts.

Input: the rows of RUN_DIR/metrics.jsonl (trainer process 0, appended by every attempt) and,
when the run was launched by `multislice local`, RUN_DIR/launcher.jsonl. Wall time runs from the
first `process_start` to the last event of either file. Every instant of it gets exactly one
category:

    productive   a step that the final model descends from (`step` rows, `step_time_s` long)
    startup      process launch to the end of distributed init, `data_ready` (finding or
                 preparing the dataset), `fresh_start` (initialising the state from the seed)
    compile      `compile` rows
    restore      `restore` rows
    checkpoint   the time the train loop blocked on a save: `checkpoint` rows (`blocking_s`),
                 `checkpoint_wait` (the last save's commit) and `preempted` (the emergency save)
    lost         steps that a later attempt recomputed (it restored an older step) and the
                 unfinished work between an attempt's last row and its crash
    idle         from a crash (launcher `kill`/`failure`, else the attempt's last row) to the
                 next attempt's `process_start`
    repair       the part of that gap the launcher waited for a slice that went away to come
                 back (launcher `repair`: `multislice local --slice-down-for`, as Cloud TPU's
                 repair of the slice's VMs would take). An elastic job that trains on the
                 other slices meanwhile is not waiting: its attempt's time is its own.
    other        anything inside an attempt not covered above (data set-up, shutdown, ...)

A run that completed (an `end` row) and was started again later (more steps, an edit) is not
waiting on anything in between: that gap is left out of the wall time (`between_runs_s`), not
counted as idle. Each later attempt has a cause (`AttemptSummary.cause`): `new run` (after a
completed one), `edit` (its launch spec generation differs from the attempt before), `disruption`
(the attempt before stopped on a SIGTERM and saved: a preemption, a maintenance event; or
`multislice local`'s launcher says its host was killed or preempted by a drill: a node going
away), `crash` (it ended any other way) or `grow-back` (an elastic job on fewer slices was
stopped at a step boundary to start again on the slices that came back: launcher `grow`).

With launcher.jsonl, each attempt also has the slices it ran on and the job's full count
(`AttemptSummary.slices`, `full_slices`): steps of an attempt on fewer slices are the elastic
job's degraded steps (`Timeline.degraded_steps`), still productive.

Timed rows are intervals [time - duration, time] (rows are written when the thing ends). Where
intervals overlap, the narrower activity wins in the order checkpoint > restore > compile >
startup > step, so a save that blocks inside a measured step counts as checkpoint time once, not
twice. Rows cut short by a kill and rows without a numeric `time` are skipped.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Sequence
from typing import Any

from scripts.report.phases import StartupPhases, finite_number, startup_phases

CATEGORIES: tuple[str, ...] = (
    "productive", "startup", "compile", "restore", "checkpoint", "lost", "idle", "repair",
    "other",
)
BADPUT_LABELS: dict[str, str] = {
    "startup": "start-up and distributed init",
    "compile": "compilation",
    "restore": "checkpoint restore",
    "checkpoint": "checkpoint blocking",
    "lost": "work lost to restarts",
    "idle": "idle between attempts",
    "repair": "waiting for a slice's repair",
    "other": "other",
}
# Higher wins where intervals overlap; "other" is the attempt window underneath everything.
_PRIORITY: dict[str, int] = {
    "other": 0, "productive": 1, "lost": 1, "startup": 2, "compile": 3, "restore": 4,
    "checkpoint": 5, "between": 8,
    # Only where no attempt runs: the gap between attempts, a repair wait above it. An elastic
    # job training through a repair is not waiting for it.
    "idle": -2, "repair": -1,
}
_CRASH_EVENTS = frozenset({"kill", "failure"})
RESTART_CAUSES: tuple[str, ...] = ("disruption", "crash", "edit")


def _spec_generation(rows: Sequence[dict[str, Any]]) -> Any:
    return next((r.get("spec_generation") for r in rows if r.get("event") == "distributed_init"
                 and r.get("spec_generation") is not None), None)


# What `multislice local` (launcher.jsonl `failure`) says ended an attempt that the host lost
# rather than the trainer: its drills stand for a node going away, with or without a notice.
_DISRUPTION_CAUSES = frozenset({"kill-at", "preempted"})


def _cause(before: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]],
           launcher_causes: Sequence[str] = ()) -> str:
    """Why the attempt of `rows` followed the one of `before` (see the module docstring);
    `launcher_causes`: the launcher's `failure` causes between the two."""
    if any(r.get("event") == "end" for r in before):
        return "new run"
    if "grow" in launcher_causes:
        return "grow-back"
    was, now = _spec_generation(before), _spec_generation(rows)
    if was is not None and now is not None and was != now:
        return "edit"
    if any(r.get("event") == "preempted" for r in before) or (
            launcher_causes and set(launcher_causes) <= _DISRUPTION_CAUSES):
        return "disruption"
    return "crash"


class TimelineError(ValueError):
    """The metrics cannot be turned into a timeline; the message names the file and the problem."""


@dataclasses.dataclass(frozen=True)
class Segment:
    start: float
    end: float
    category: str

    @property
    def seconds(self) -> float:
        return self.end - self.start


# The fields the trainer writes on every step row (its runtime/metrics.py contract); any other
# numeric field is a value the model reported (its trainer/model/aux.py), shown by name.
TRAINER_STEP_FIELDS = frozenset({
    "event", "time", "step", "loss", "grad_norm", "learning_rate", "batch_digest",
    "step_time_s", "tokens_per_s", "tflops_per_device", "mfu"})


def model_values(row: dict[str, Any]) -> dict[str, float]:
    """The values a step row carries beyond the trainer's own fields."""
    return {key: float(value) for key, value in sorted(row.items())
            if key not in TRAINER_STEP_FIELDS and isinstance(value, int | float)
            and not isinstance(value, bool) and finite_number(value) is not None}


@dataclasses.dataclass(frozen=True)
class StepRun:
    """One execution of a step: `lost` when a later attempt rolled back past it."""

    attempt: int
    step: int
    time: float
    step_time_s: float
    loss: float | None
    lost: bool
    # what the model reported beside the loss (its auxiliary losses and metrics), by name
    reported: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class AttemptSummary:
    index: int
    start: float
    end: float  # its crash, or its last event
    crashed: bool
    restored_step: int | None  # the step it started from (0 = fresh), None if unknown
    first_step: int | None
    last_step: int | None
    seconds: dict[str, float]
    segments: tuple[Segment, ...]  # merged, in time order, clipped to the wall window
    # A separate invocation: the attempt before it ended its run (an `end` row), so this one
    # continues a finished run rather than restarting a failed one.
    new_invocation: bool = False
    # Its time from start to first step by phase (scripts.report.phases); None without rows.
    phases: StartupPhases | None = None
    # Why it started: None (the first), "new run", "edit", "disruption" or "crash".
    cause: str | None = None
    # Where its state came from (the trainer's restore row): tier (local, peer or bucket),
    # processes and bytes per tier, seconds; and the steps of work its restart lost.
    restore: RestoreSource | None = None
    # The slices it ran on and the job's full count (launcher `launch` rows; None without).
    slices: int | None = None
    full_slices: int | None = None

    @property
    def degraded(self) -> bool:
        """An elastic job's attempt on fewer slices than the job has."""
        return self.slices is not None and self.full_slices is not None and \
            self.slices < self.full_slices


@dataclasses.dataclass(frozen=True)
class RestoreSource:
    tier: str  # "local": every process its own part; "peer": some a twin's; "bucket"
    seconds: float | None
    processes: dict[str, int]  # by tier: local, peer, bucket
    bytes: dict[str, int]
    steps_lost: int | None

    def describe(self) -> str:
        labels = {"local": "own local copy", "peer": "a peer slice's local copy",
                  "bucket": "the bucket"}
        used = [f"{labels[name]} on {self.processes[name]} process(es), "
                f"{self.bytes[name] / 2**20:.1f} MiB" for name in labels
                if self.processes.get(name)]
        took = f" in {self.seconds:.1f} s" if self.seconds is not None else ""
        lost = (f"; {self.steps_lost} step(s) of work lost" if self.steps_lost is not None
                else "")
        return (f"restored from {'; '.join(used) or 'its checkpoints (tiers not recorded)'}"
                f"{took}{lost}")


def restore_source(rows: Sequence[dict[str, Any]]) -> RestoreSource | None:
    """The restore row's account of where the state came from (None: a fresh start, or a
    trainer older than the local tier)."""
    restore = next((r for r in rows if r.get("event") == "restore"), None)
    if restore is None:
        return None
    restart = next((r for r in rows if r.get("event") == "restart"), None)
    lost = restart.get("steps_recomputed") if restart is not None else None
    names = ("local", "peer", "bucket")
    return RestoreSource(
        tier=str(restore.get("tier", "bucket")),
        seconds=_duration(restore, "duration_s"),
        processes={n: int(restore.get(f"processes_{n}") or 0) for n in names},
        bytes={n: int(restore.get(f"bytes_{n}") or 0) for n in names},
        steps_lost=lost if isinstance(lost, int) else None)


@dataclasses.dataclass(frozen=True)
class Timeline:
    start: float
    end: float
    seconds: dict[str, float]  # every category, summing to wall_s
    attempts: tuple[AttemptSummary, ...]
    steps: tuple[StepRun, ...]
    idle_segments: tuple[Segment, ...]
    between_runs_s: float = 0.0  # gaps after a completed run, outside the wall time

    @property
    def wall_s(self) -> float:
        return self.end - self.start - self.between_runs_s

    def restarts_by_cause(self) -> dict[str, int]:
        """Restarts of an unfinished run, by what caused them."""
        counts = dict.fromkeys(RESTART_CAUSES, 0)
        for attempt in self.attempts:
            if attempt.cause in counts:
                counts[attempt.cause] += 1
        return counts

    @property
    def goodput(self) -> float:
        return self.seconds["productive"] / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def steps_recomputed(self) -> int:
        return sum(1 for s in self.steps if s.lost)

    @property
    def degraded_steps(self) -> int:
        """Kept steps an elastic job made on fewer slices than it has."""
        degraded = {a.index for a in self.attempts if a.degraded}
        return sum(1 for s in self.steps if s.attempt in degraded and not s.lost)


def parse_jsonl(text: str) -> tuple[list[dict[str, Any]], int]:
    """The JSON object rows with a numeric `time`, and how many lines were skipped."""
    rows, skipped = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            skipped += 1
            continue
        if isinstance(row, dict) and finite_number(row.get("time")) is not None:
            rows.append(row)
        else:
            skipped += 1
    return rows, skipped


def _duration(row: dict[str, Any], *keys: str) -> float:
    for key in keys:
        value = finite_number(row.get(key))
        if value is not None:
            return max(value, 0.0)
    return 0.0


def split_attempts(rows: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Metrics rows grouped per attempt: a new attempt begins at every `process_start` row."""
    attempts: list[list[dict[str, Any]]] = []
    for row in rows:
        if row.get("event") == "process_start" or not attempts:
            attempts.append([])
        attempts[-1].append(row)
    return attempts


def _restored_step(rows: Sequence[dict[str, Any]]) -> int | None:
    """The step an attempt started from: its restore row, else its first step row minus one."""
    for row in rows:
        event = row.get("event")
        if event in ("restore", "restart") and isinstance(row.get("restored_step"), int):
            return row["restored_step"]
        if event == "fresh_start":
            return 0
    steps = [r["step"] for r in rows if r.get("event") == "step" and isinstance(r.get("step"), int)]
    return min(steps) - 1 if steps else None


def _activity(row: dict[str, Any]) -> tuple[str, float] | None:
    """(category, seconds) of a timed metrics row that ends at row['time'], or None."""
    event = str(row.get("event", ""))
    if event == "compile":
        return "compile", _duration(row, "duration_s")
    if event == "restore":
        return "restore", _duration(row, "duration_s")
    if event in ("data_ready", "fresh_start"):
        return "startup", _duration(row, "duration_s")
    if event.startswith("checkpoint") or event == "preempted":
        return "checkpoint", _duration(row, "blocking_s", "duration_s")
    return None


def _attempt_start(rows: Sequence[dict[str, Any]]) -> float:
    first = rows[0]
    if first.get("event") == "process_start":
        # From when its supervisor started the process (the interpreter and imports come first).
        launched = finite_number(first.get("launched_at"))
        start = float(first["time"])
        return min(launched, start) if launched is not None else start
    # No process_start (a trainer that does not log it): the earliest instant a row covers.
    return min(float(r["time"]) - _duration(r, "duration_s", "step_time_s") for r in rows)


def build_timeline(metrics: Sequence[dict[str, Any]],
                   launcher: Sequence[dict[str, Any]] = ()) -> Timeline:
    """The goodput accounting of one run directory's rows (see the module docstring)."""
    groups = split_attempts(metrics)
    if not groups:
        raise TimelineError("no metrics rows with a numeric time")
    starts = [_attempt_start(g) for g in groups]
    t0 = starts[0]
    t_end = max(float(r["time"]) for r in (*metrics, *launcher))
    t_end = max(t_end, t0)
    restored = [_restored_step(g) for g in groups]

    intervals: list[tuple[float, float, str, int | None]] = []  # (start, end, category, attempt)
    steps: list[StepRun] = []
    ends: list[float] = []
    crashed: list[bool] = []
    for k, rows in enumerate(groups):
        nxt = starts[k + 1] if k + 1 < len(groups) else math.inf
        last_row = max(float(r["time"]) for r in rows)
        crash_times = [float(e["time"]) for e in launcher
                       if e.get("event") in _CRASH_EVENTS and starts[k] <= float(e["time"]) < nxt]
        crash = max(min(crash_times), last_row) if crash_times else None
        if k + 1 < len(groups):
            end = min(crash if crash is not None else last_row, nxt)
        else:
            end = crash if crash is not None else t_end
        ends.append(end)
        crashed.append(crash is not None)
        rolled_back_to = [r for r in restored[k + 1:] if r is not None]
        floor = min(rolled_back_to) if rolled_back_to else math.inf

        intervals.append((starts[k], end, "other", k))
        if crash is not None and crash > last_row:
            intervals.append((last_row, crash, "lost", k))
        if k + 1 < len(groups) and nxt > end:
            finished = any(r.get("event") == "end" for r in rows)
            intervals.append((end, nxt, "between" if finished else "idle", None))
        for row in rows:
            t = float(row["time"])
            event = row.get("event")
            if event == "distributed_init":
                intervals.append((starts[k], t, "startup", k))
            elif event == "step" and isinstance(row.get("step"), int):
                length = _duration(row, "step_time_s")
                lost = row["step"] > floor
                loss = finite_number(row.get("loss"))
                steps.append(StepRun(k, row["step"], t, length, loss, lost,
                                     model_values(row)))
                intervals.append((t - length, t, "lost" if lost else "productive", k))
            else:
                activity = _activity(row)
                if activity is not None and activity[1] > 0:
                    intervals.append((t - activity[1], t, activity[0], k))

    for event in launcher:
        down_s = finite_number(event.get("down_s"))
        if event.get("event") == "repair" and down_s is not None and down_s > 0:
            intervals.append((float(event["time"]), float(event["time"]) + down_s, "repair",
                              None))
    painted = _paint(intervals, t0, t_end)
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    per_attempt: list[dict[str, float]] = [dict.fromkeys(CATEGORIES, 0.0) for _ in groups]
    per_attempt_segments: list[list[Segment]] = [[] for _ in groups]
    idle_segments: list[Segment] = []
    between = 0.0
    for seg, attempt in painted:
        if seg.category == "between":
            between += seg.seconds
            continue
        seconds[seg.category] += seg.seconds
        if seg.category in ("idle", "repair"):
            idle_segments.append(seg)
        elif attempt is not None:
            per_attempt[attempt][seg.category] += seg.seconds
            per_attempt_segments[attempt].append(seg)

    summaries = []
    for k in range(len(groups)):
        numbers = [s.step for s in steps if s.attempt == k]
        summaries.append(AttemptSummary(
            index=k, start=starts[k], end=ends[k], crashed=crashed[k], restored_step=restored[k],
            first_step=min(numbers) if numbers else None,
            last_step=max(numbers) if numbers else None,
            seconds=per_attempt[k], segments=tuple(_merge(per_attempt_segments[k])),
            new_invocation=k > 0 and not crashed[k - 1]
            and any(r.get("event") == "end" for r in groups[k - 1]),
            phases=startup_phases(groups[k]), restore=restore_source(groups[k]),
            cause=_cause(groups[k - 1], groups[k], [
                "grow" if e.get("event") == "grow" else str(e.get("cause"))
                for e in launcher if e.get("event") in ("failure", "grow")
                and starts[k - 1] <= float(e["time"]) < starts[k]]) if k > 0 else None,
            **_slices(launcher, starts[k]),
        ))
    return Timeline(start=t0, end=t_end, seconds=seconds, attempts=tuple(summaries),
                    steps=tuple(steps), idle_segments=tuple(_merge(idle_segments)),
                    between_runs_s=between)


def _slices(launcher: Sequence[dict[str, Any]], start: float) -> dict[str, int]:
    """The slices of the attempt whose trainer started at `start` (the launcher's `launch` row
    nearest it: written as the processes start) and the job's full count (its largest launch),
    when the launcher says."""
    launches = [e for e in launcher if e.get("event") == "launch"
                and isinstance(e.get("slices"), int)]
    if not launches:
        return {}
    nearest = min(launches, key=lambda e: abs(float(e["time"]) - start))
    return {"slices": nearest["slices"], "full_slices": max(e["slices"] for e in launches)}


def _paint(intervals: Iterable[tuple[float, float, str, int | None]], lo: float,
           hi: float) -> list[tuple[Segment, int | None]]:
    """Cuts [lo, hi] into pieces, each labelled with the highest-priority interval covering it."""
    clipped = [(max(a, lo), min(b, hi), cat, k) for a, b, cat, k in intervals]
    clipped = [iv for iv in clipped if iv[1] > iv[0]]
    points = sorted({lo, hi, *(iv[0] for iv in clipped), *(iv[1] for iv in clipped)})
    opens: dict[float, list[int]] = {}
    closes: dict[float, list[int]] = {}
    for i, (a, b, _, _) in enumerate(clipped):
        opens.setdefault(a, []).append(i)
        closes.setdefault(b, []).append(i)
    active: dict[int, set[int]] = {}  # priority -> open interval indices
    out: list[tuple[Segment, int | None]] = []
    for left, right in zip(points, points[1:], strict=False):
        for i in closes.get(left, ()):
            active[_PRIORITY[clipped[i][2]]].discard(i)
        for i in opens.get(left, ()):
            active.setdefault(_PRIORITY[clipped[i][2]], set()).add(i)
        live = [p for p, members in active.items() if members]
        if not live:
            out.append((Segment(left, right, "other"), None))
            continue
        winner = clipped[min(active[max(live)])]  # ties: the earliest-listed interval
        out.append((Segment(left, right, winner[2]), winner[3]))
    return out


def _merge(segments: Sequence[Segment]) -> list[Segment]:
    merged: list[Segment] = []
    for seg in sorted(segments, key=lambda s: s.start):
        if merged and merged[-1].category == seg.category and merged[-1].end >= seg.start:
            merged[-1] = Segment(merged[-1].start, max(merged[-1].end, seg.end), seg.category)
        else:
            merged.append(seg)
    return merged
