"""`multislice report RUN_DIR`: goodput with the badput by cause, and RUN_DIR/report.png.

Reads RUN_DIR/metrics.jsonl (required) and RUN_DIR/launcher.jsonl (optional, written by
`multislice local`); the accounting is in `scripts.report.goodput`. RUN_DIR may be a local path or a
gs:// path. `build_report(run_dir)` is the API other commands (e.g. `multislice demo`) call.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from scripts.argtypes import report_error
from scripts.report.goodput import (
    BADPUT_LABELS,
    CATEGORIES,
    RESTART_CAUSES,
    Timeline,
    TimelineError,
    build_timeline,
    parse_jsonl,
)
from scripts.report.phases import format_phases

METRICS_FILE = "metrics.jsonl"
LAUNCHER_FILE = "launcher.jsonl"
PNG_FILE = "report.png"
EXIT_ERROR = 2


class ReportError(ValueError):
    """The run directory cannot be reported on; the message names the path and what is wrong."""


@dataclasses.dataclass(frozen=True)
class Report:
    run_dir: str
    timeline: Timeline
    final_step: int | None
    final_loss: float | None
    skipped_lines: int  # unparseable lines (e.g. cut short by a kill) in the two files
    png_path: str | None
    first_bad: str | None = None  # "line N is not ...: PREVIEW", the first unreadable metrics line
    final_values: dict[str, float] = dataclasses.field(default_factory=dict)  # the model's own

    @property
    def goodput(self) -> float:
        return self.timeline.goodput

    @property
    def restarts(self) -> int:
        """Attempts after the first that restarted an unfinished run (a new invocation of a
        finished one is not a restart, nor an elastic job's grow-back)."""
        return sum(1 for a in self.timeline.attempts[1:]
                   if not a.new_invocation and a.cause != "grow-back")

    def badput_s(self) -> dict[str, float]:
        return {c: self.timeline.seconds[c] for c in CATEGORIES if c != "productive"}


def _join(run_dir: str, name: str) -> str:
    return f"{run_dir.rstrip('/')}/{name}"


def _path(location: str):
    if location.startswith("gs://"):
        from etils import epath

        return epath.Path(location)
    from pathlib import Path

    return Path(location)


def _read(run_dir: str, name: str, *, required: bool) -> str | None:
    if _path(run_dir).is_file():
        raise ReportError(f"{run_dir} is a file, not a directory; pass the run directory the "
                          "trainer wrote (its --run-dir), which holds metrics.jsonl")
    path = _path(_join(run_dir, name))
    if path.is_file():
        data = path.read_bytes()
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as err:
            line = data[:err.start].count(b"\n") + 1
            raise ReportError(f"{path} is not UTF-8 text (line {line}, byte {err.start}); it is "
                              "not a metrics file the trainer wrote") from None
    if not required:
        return None
    if not _path(run_dir).is_dir():
        raise ReportError(f"run directory {run_dir} does not exist; pass the trainer's --run-dir "
                          "(e.g. runs/local-template-2x4)")
    raise ReportError(f"{_join(run_dir, name)} does not exist; {run_dir} is not a run directory "
                      "written by the trainer, or the trainer has not started yet")


def _first_bad_line(text: str) -> str:
    """'line N is not ...: PREVIEW' for the first line parse_jsonl skips."""
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        preview = line.strip()[:60] + ("..." if len(line.strip()) > 60 else "")
        bad, _ = parse_jsonl(line)
        if not bad:
            return f"line {number} is not a JSON object with a numeric time: {preview!r}"
    return "no line could be read"


def build_report(run_dir: str, *, write_png: bool = True, png_path: str | None = None) -> Report:
    """The goodput report of RUN_DIR; also writes report.png (RUN_DIR/report.png by default)."""
    run_dir = str(run_dir)
    if run_dir.startswith("gs://"):
        from scripts.gcs import StorageUnreachable, check_reachable, filesystem

        try:
            check_reachable(run_dir)
        except StorageUnreachable as err:
            raise ReportError(str(err)) from None
        filesystem()  # the same gcsfs set-up (and quiet imports) as every toolkit command
    metrics_text = _read(run_dir, METRICS_FILE, required=True) or ""
    metrics, skipped = parse_jsonl(metrics_text)
    metrics_path = _join(run_dir, METRICS_FILE)
    if not metrics:
        if not metrics_text.strip():
            raise ReportError(f"{metrics_path} is empty; the trainer has not logged anything "
                              "yet")
        raise ReportError(f"{metrics_path} has no JSON rows with a numeric time ({skipped} "
                          f"unreadable lines; {_first_bad_line(metrics_text)}); this is not the "
                          "trainer's metrics file")
    launcher_text = _read(run_dir, LAUNCHER_FILE, required=False)
    launcher, skipped_launcher = parse_jsonl(launcher_text) if launcher_text else ([], 0)
    try:
        timeline = build_timeline(metrics, launcher)
    except TimelineError as err:
        raise ReportError(f"{metrics_path}: {err}") from None

    latest: dict[int, Any] = {}
    for run in timeline.steps:
        if not run.lost:
            latest[run.step] = run
    final_step = max(latest) if latest else None
    first_bad = _first_bad_line(metrics_text) if skipped else None
    final = latest[final_step] if final_step is not None else None
    report = Report(run_dir=run_dir, timeline=timeline, final_step=final_step, first_bad=first_bad,
                    final_loss=final.loss if final is not None else None,
                    final_values=dict(final.reported) if final is not None else {},
                    skipped_lines=skipped + skipped_launcher, png_path=None)
    if write_png:
        from scripts.report.plot import render_png

        target = png_path or _join(run_dir, PNG_FILE)
        image = render_png(timeline, f"run {run_dir}")
        try:
            _path(target).write_bytes(image)
        except OSError as exc:  # under a file, a missing or read-only directory, a full disk
            raise ReportError(f"--png {target}: cannot write the figure ({exc.strerror or exc}); "
                              "give a writable path, or --no-png") from None
        report = dataclasses.replace(report, png_path=target)
    return report


def report_to_json(report: Report) -> dict[str, Any]:
    tl = report.timeline
    return {
        "run_dir": report.run_dir,
        "wall_s": tl.wall_s,
        "productive_s": tl.seconds["productive"],
        "goodput": tl.goodput,
        "badput_s": report.badput_s(),
        "attempts": [
            {"index": a.index, "start": a.start, "end": a.end, "crashed": a.crashed,
             "restored_step": a.restored_step, "first_step": a.first_step,
             "last_step": a.last_step, "seconds": a.seconds, "cause": a.cause,
             "slices": a.slices, "full_slices": a.full_slices,
             "restore": None if a.restore is None else dataclasses.asdict(a.restore),
             "to_first_step": None if a.phases is None else {
                 "start": a.phases.start, "seconds": a.phases.to_first_step_s,
                 "phases": a.phases.seconds,
                 "compile_overlapped_s": a.phases.compile_overlapped_s}}
            for a in tl.attempts
        ],
        "restarts": report.restarts,
        "restarts_by_cause": tl.restarts_by_cause(),
        "between_runs_s": tl.between_runs_s,
        "steps_recomputed": tl.steps_recomputed,
        "degraded_steps": tl.degraded_steps,
        "final_step": report.final_step,
        "final_loss": report.final_loss,
        "final_values": report.final_values,
        "skipped_lines": report.skipped_lines,
        "first_unreadable_line": report.first_bad,
        "png": report.png_path,
    }


def _by_cause(tl: Timeline) -> str:
    counts = {c: n for c, n in tl.restarts_by_cause().items() if n}
    plural = {"disruption": "disruptions", "crash": "crashes", "edit": "edits"}
    return (": " + ", ".join(f"{n} {plural[c] if n != 1 else c}" for c, n in counts.items())
            if counts else "")


def format_report(report: Report) -> str:
    tl = report.timeline
    wall = tl.wall_s

    def share(seconds: float) -> str:
        return f"{100 * seconds / wall:5.1f}%" if wall > 0 else "  n/a"

    attempts = len(tl.attempts)
    loss = f"{report.final_loss:.4f}" if report.final_loss is not None else "n/a"
    lines = [
        f"run {report.run_dir}: {wall:.1f} s wall time over {attempts} attempt"
        f"{'s' if attempts != 1 else ''} ({report.restarts} restart"
        f"{'s' if report.restarts != 1 else ''}{_by_cause(tl)}), final step "
        f"{report.final_step}, final loss {loss}"
        + (" (" + ", ".join(f"{k} {v:.4g}" for k, v in report.final_values.items()) + ")"
           if report.final_values else "")
        + (f"; {tl.between_runs_s:.1f} s between completed runs left out"
           if tl.between_runs_s > 0 else ""),
        f"goodput {100 * tl.goodput:.1f}%  ({tl.seconds['productive']:.1f} s of productive steps)",
    ]
    shrunk = [a for a in tl.attempts if a.degraded]
    if shrunk:
        grown = sum(1 for a in tl.attempts if a.cause == "grow-back")
        lines.append(f"elastic: {len(shrunk)} re-formation(s) on fewer slices, {grown} "
                     f"grow-back(s), {tl.degraded_steps} step(s) kept from fewer slices")
    lines.append("badput by cause:")
    labels = {c: BADPUT_LABELS[c] for c in report.badput_s()}
    labels["lost"] += f" ({tl.steps_recomputed} steps recomputed)"
    width = max(len(label) for label in labels.values())
    for category, seconds in report.badput_s().items():
        lines.append(f"  {labels[category]:<{width}}  {seconds:9.2f} s  {share(seconds)}")
    for a in tl.attempts:
        start = "fresh" if a.restored_step == 0 else (
            f"from step {a.restored_step}" if a.restored_step is not None else "start unknown")
        steps = (f"steps {a.first_step}-{a.last_step}" if a.first_step is not None
                 else "no steps")
        end = "crashed" if a.crashed else "ended"
        length = a.end - a.start
        good = f"{100 * a.seconds['productive'] / length:.1f}%" if length > 0 else "n/a"
        why = f" after a {a.cause}" if a.cause in RESTART_CAUSES else (
            " (a new run of the finished one)" if a.cause == "new run" else
            " (grown back)" if a.cause == "grow-back" else "")
        on = (f" on {a.slices} of {a.full_slices} slices" if a.degraded else "")
        lines.append(f"  attempt {a.index}{why}{on}: {start}, {steps}, {end} after "
                     f"{length:.1f} s (goodput {good} of the attempt)")
        if a.restore is not None:
            lines.append(f"    {a.restore.describe()}")
        if a.phases is not None:
            lines.append(f"    {format_phases(a.phases)}")
    if report.skipped_lines:
        lines.append(f"note: skipped {report.skipped_lines} unreadable line(s) "
                     "(a row cut short by a kill is normal)"
                     + (f"; metrics.jsonl {report.first_bad}" if report.first_bad else ""))
    if report.png_path:
        lines.append(f"wrote {report.png_path}")
    return "\n".join(lines)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "report",
        help="goodput breakdown of a run and RUN_DIR/report.png",
        description="Goodput of a run (productive step time over wall time) with the badput by "
        "cause, from RUN_DIR/metrics.jsonl (and launcher.jsonl when there is one); the timeline "
        "is also written as RUN_DIR/report.png.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the trainer's --run-dir (local or gs://)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--png", default=None, metavar="PATH",
                        help=f"where to write the figure (default: RUN_DIR/{PNG_FILE})")
    parser.add_argument("--no-png", action="store_true", help="do not write the figure")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    try:
        report = build_report(args.run_dir, write_png=not args.no_png, png_path=args.png)
    except ReportError as err:
        report_error("report", err)
        return EXIT_ERROR
    if args.json:
        print(json.dumps(report_to_json(report), sort_keys=True))
    else:
        print(format_report(report))
    return 0
