"""`multislice demo` (what `make demo` runs): a 2-slice x 4-device CPU run of the template's tiny
config that trains for a few dozen steps, then shows the loss curve and the run summary: final
loss, goodput (productive step time / wall time, from `scripts.report.command`) and where report.png is.

It is also a preemption drill: DEMO_DRILL kills slice 1 mid-run and the emulated auto-repair
(`--max-restarts 1`) restarts every slice from the latest checkpoint. `--kill-at` or
`--preempt-at` replace the drill; `--no-drill` (or DEMO_DRILL = None) runs without it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from scripts.argtypes import positive_int
from scripts.local.attempt import Drill
from scripts.local.command import add_launch_arguments, run_local

DEMO_SLICES = 2
DEMO_DEVICES_PER_SLICE = 4
DEMO_STEPS = 40
# tiny saves to the bucket tier every 10 steps; the demo adds the local tier every DEMO_LOCAL_EVERY
# steps, and the drill's slice comes back with its own storage wiped: its restart restores from
# the surviving slice's local copy, the other slice from its own.
DEMO_LOCAL_EVERY = 5
DEMO_DRILL: Drill | None = Drill(step=27, slice=1, wipe=True)
# Once a peer is dead the survivors cannot finish a collective checkpoint, so waiting long for
# them to honour SIGTERM only delays the restart.
DEMO_STOP_GRACE_S = 3


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="emulated 2-slice x 4-device training run on CPU (what make demo runs)",
        description="A 2-slice x 4-device CPU run of the template's tiny config: live logs, the "
        "loss curve, and the run summary.",
    )
    parser.add_argument("--steps", type=positive_int, default=DEMO_STEPS,
                        help=f"global steps to train (default {DEMO_STEPS})")
    parser.add_argument("--experiment", type=Path, default=None, metavar="DIR",
                        help="rendered experiment to run (default: the template)")
    parser.add_argument("--no-drill", action="store_true",
                        help=f"do not kill a slice (default drill: --kill-at {DEMO_DRILL})")
    add_launch_arguments(parser)
    parser.set_defaults(func=main, stop_grace=DEMO_STOP_GRACE_S)


def loss_rows(run_dir: Path) -> list[tuple[int, float]]:
    """(step, loss) per step from RUN_DIR/metrics.jsonl; a step redone after a restart keeps its
    latest loss."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    losses: dict[int, float] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        if row.get("event") == "step" and isinstance(row.get("loss"), int | float):
            losses[int(row["step"])] = float(row["loss"])
    return sorted(losses.items())


def show_loss_curve(rows: list[tuple[int, float]], width: int = 40, max_rows: int = 9) -> None:
    if not rows:
        print("[demo] no step rows in metrics.jsonl", file=sys.stderr)
        return
    top = max(loss for _, loss in rows)
    shown = sorted({round(i * (len(rows) - 1) / (max_rows - 1)) for i in range(max_rows)})
    print("[demo] loss by step:")
    for step, loss in (rows[i] for i in shown):
        bar = "#" * max(1, round(width * loss / top)) if top > 0 else ""
        print(f"  step {step:>5}  loss {loss:8.4f}  {bar}")
    first, last = rows[0][1], rows[-1][1]
    trend = "fell" if last < first else "did NOT fall"
    print(f"[demo] loss {trend} from {first:.4f} (step {rows[0][0]}) to {last:.4f} (step {rows[-1][0]})")


def main(args: argparse.Namespace) -> int:
    chosen = bool(args.kill_at or args.preempt_at)
    default = [DEMO_DRILL] if DEMO_DRILL and not (chosen or args.no_drill) else []
    if default and DEMO_DRILL.step >= args.steps:
        print(f"[demo] no preemption drill: --steps {args.steps} ends before its step "
              f"{DEMO_DRILL.step}", file=sys.stderr)
        default = []
    max_restarts = args.max_restarts or (1 if chosen or default else 0)
    run_dir = args.run_dir or str(Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S"))
    code = run_local(
        experiment=args.experiment,
        slices=DEMO_SLICES,
        devices_per_slice=DEMO_DEVICES_PER_SLICE,
        trainer_args=["--config", "tiny", "--steps", str(args.steps),
                      "--set", f"checkpoint.local_every={DEMO_LOCAL_EVERY}"],
        run_dir=run_dir,
        kill_at=[*args.kill_at, *(d for d in default if not d.preempt)],
        preempt_at=[*args.preempt_at, *(d for d in default if d.preempt)],
        max_restarts=max_restarts,
        init_timeout_s=args.init_timeout,
        stall_timeout_s=args.stall_timeout,
        stop_grace_s=args.stop_grace,
    )
    if code != 2:
        show_loss_curve(loss_rows(Path(run_dir)))
        show_report(run_dir)
    return code


def show_report(run_dir: str) -> None:
    """The goodput accounting of `multislice report`, and where its picture went."""
    from scripts.report.command import ReportError, build_report, format_report

    try:
        report = build_report(run_dir)
    except ReportError as err:
        print(f"[demo] no goodput report: {err}", file=sys.stderr)
        return
    loss = f"{report.final_loss:.4f}" if report.final_loss is not None else "n/a"
    print(format_report(report))
    print(f"[demo] final loss {loss} at step {report.final_step}; goodput "
          f"{100 * report.goodput:.1f}% (productive step time / wall time) over "
          f"{report.restarts} restart(s); report: {report.png_path}")
