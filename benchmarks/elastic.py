"""Restart-and-wait against elastic re-formation, on the same failure schedule, side by side.

    .venv/bin/python benchmarks/elastic.py [--repeats 3] [--steps 300] [--down 60]
                                           [--failures 3] [--local-every 5] [--canonical]

Each repeat trains the tiny config on 3 slices x 2 CPU devices under `multislice local`, with
its run directory in a bucket of the GCS emulator and the local checkpoint tier on, twice: with
`elastic.min_slices = 0` (today: the job waits for a lost slice's repair) and with
`elastic.min_slices = 2` (the survivors re-form at once on two slices and the job grows back when
the slice returns). Both lose slice 0, 1, 2 in turn at the same steps (drawn from the repeat's
seed), each kept down --down seconds as a repair of its VMs would be (--slice-down-for). The two
modes alternate within a repeat, so both see the same machine load.

Printed per repeat and as medians over the repeats:

- goodput as `multislice report` counts it (productive step time over wall time), and the
  effective goodput: kept steps x the median step time on 3 slices, over wall time (a step on two
  slices counts only as one step's work). On a machine with fewer cores than the slices' processes
  a step on two slices is *faster* than on three (they share the cores), which real slices never
  are: `effective_goodput_charged` also charges every step on two slices 3/2 of a step on three,
  as separate slices would take, in place of its measured time;
- time with no progress per failure: from the kill to the next step any slice makes (detect,
  re-form or wait, restore, compile, first step); against a warm restart, the waiting mode's
  time from the repair's end to its next step;
- the step rate on two slices over the rate on three, against (N-1)/N = 2/3.

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.schedule import failure_steps  # noqa: E402
from scripts.emulators.gcs_emulator import serving_bucket  # noqa: E402
from scripts.local.attempt import Drill  # noqa: E402
from scripts.local.command import run_local  # noqa: E402
from scripts.report.goodput import build_timeline  # noqa: E402

BUCKET = "ms-bench-elastic"
SLICES = 3
DEVICES = 2
# 24 rows: 2 micro-batches of 2 rows on 6 batch shards (3 slices), 3 on 4 (2 slices).
MODEL = ("train.global_batch_size=24", "train.grad_accum_steps=2")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--down", type=float, default=60.0, help="seconds each lost slice stays "
                        "down (default %(default)s)")
    parser.add_argument("--failures", type=int, default=3)
    parser.add_argument("--local-every", type=int, default=5)
    parser.add_argument("--save-interval", type=int, default=50)
    parser.add_argument("--canonical", action="store_true",
                        help="elastic.canonical_reduction = true in the elastic runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="a trainer override for both runs")
    args = parser.parse_args(argv)
    for name in ("repeats", "steps", "failures", "local_every", "save_interval"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.down <= 0:
        parser.error(f"--down {args.down}: must be > 0 seconds")
    if args.failures * 20 > args.steps:
        parser.error(f"--failures {args.failures} needs --steps >= {args.failures * 20} "
                     f"(got {args.steps}): each failure is followed by steps of its own")
    return args


def _rows(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a row cut short by a kill
    return out


def one_run(gcs: Any, work: Path, name: str, args: argparse.Namespace, drills: list[Drill],
            elastic: bool) -> dict[str, Any]:
    log_dir = work / name
    run = f"runs/{name}"
    values = [*MODEL, f"checkpoint.save_interval_steps={args.save_interval}",
              f"checkpoint.local_every={args.local_every}", "metrics.log_every=50",
              f"data.path={work / 'data'}", "data.prepare_if_missing=true",
              f"elastic.min_slices={2 if elastic else 0}", *args.overrides]
    if elastic and args.canonical:
        values.append("elastic.canonical_reduction=true")
    sets = [arg for value in values for arg in ("--set", value)]
    code = run_local(experiment=None, slices=SLICES, devices_per_slice=DEVICES,
                     run_dir=f"gs://{BUCKET}/{run}", log_dir=log_dir,
                     trainer_args=["--config", "tiny", "--steps", str(args.steps), *sets],
                     kill_at=drills, max_restarts=len(drills), init_timeout_s=120,
                     stall_timeout_s=600, stop_grace_s=3, slice_down_s=args.down)
    if code != 0:
        raise SystemExit(f"{name}: multislice local exited {code}; see {log_dir}/logs")
    rows = _rows(gcs.get(BUCKET, f"{run}/metrics.jsonl").decode())
    launcher = _rows((log_dir / "launcher.jsonl").read_text())
    # The launcher's rows are in the local log directory (a gs:// run directory has none).
    timeline = build_timeline(rows, launcher)
    by_attempt = {a.index: a for a in timeline.attempts}
    full_step_s, shrunk_step_s = [], []
    for step in timeline.steps:
        attempt = by_attempt[step.attempt]
        (shrunk_step_s if attempt.degraded else full_step_s).append(step.step_time_s)
    kept = sum(1 for s in timeline.steps if not s.lost)
    step_s = statistics.median(full_step_s[1:] or full_step_s)
    step_times = sorted(float(r["time"]) for r in rows if r.get("event") == "step")
    kills = [float(e["time"]) for e in launcher if e.get("event") == "kill"]
    no_progress = [next((t for t in step_times if t > kill), timeline.end) - kill
                   for kill in kills]
    repair_ends = [float(e["until"]) for e in launcher if e.get("event") == "repair"]
    warm = [next((t for t in step_times if t > end), timeline.end) - end
            for end in repair_ends] if not elastic else []
    shrunk_kept = [s.step_time_s for s in timeline.steps
                   if by_attempt[s.attempt].degraded and not s.lost]
    charged_wall = timeline.wall_s + sum(SLICES / (SLICES - 1) * step_s - t for t in shrunk_kept)
    out = {
        "wall_s": timeline.wall_s,
        "goodput": timeline.goodput,
        "effective_goodput": kept * step_s / timeline.wall_s,
        "effective_goodput_charged": kept * step_s / charged_wall,
        "no_progress_per_failure_s": no_progress,
        "step_s_full": step_s,
        "steps_on_fewer_slices": timeline.degraded_steps,
        "re_formations": sum(1 for e in launcher if e.get("event") == "reform"),
        "grow_backs": sum(1 for e in launcher if e.get("event") == "grow"),
    }
    if shrunk_step_s:
        out["step_s_shrunk"] = statistics.median(shrunk_step_s[1:] or shrunk_step_s)
        out["rate_ratio_shrunk_over_full"] = step_s / out["step_s_shrunk"]
    if warm:
        out["warm_restart_s"] = warm
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results: list[dict[str, Any]] = []
    with serving_bucket(BUCKET) as gcs, tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for repeat in range(args.repeats):
            rng = random.Random(args.seed + repeat)
            kill_steps = failure_steps(args.steps, args.failures, rng, spread=4)
            drills = [Drill(step=s, slice=k % SLICES) for k, s in enumerate(kill_steps)]
            print(f"[bench] repeat {repeat}: failures at {[str(d) for d in drills]}, each "
                  f"slice down {args.down:g} s", flush=True)
            pair = {}
            order = (("wait", False), ("elastic", True))
            for name, elastic in order if repeat % 2 == 0 else order[::-1]:
                pair[name] = one_run(gcs, work, f"r{repeat}-{name}", args, drills, elastic)
                print(f"[bench] repeat {repeat} {name}: {json.dumps(pair[name])}", flush=True)
            results.append(pair)

    def med(name: str, key: str) -> float:
        values = [r[name][key] for r in results if key in r[name]]
        flat = [statistics.median(v) if isinstance(v, list) else v for v in values]
        return statistics.median(flat) if flat else float("nan")

    summary = {
        "command": "benchmarks/elastic.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "goodput": {n: med(n, "goodput") for n in ("wait", "elastic")},
        "effective_goodput": {n: med(n, "effective_goodput") for n in ("wait", "elastic")},
        "effective_goodput_charged": {n: med(n, "effective_goodput_charged")
                                      for n in ("wait", "elastic")},
        "no_progress_per_failure_s": {n: med(n, "no_progress_per_failure_s")
                                      for n in ("wait", "elastic")},
        "warm_restart_s": med("wait", "warm_restart_s"),
        "rate_ratio_shrunk_over_full": med("elastic", "rate_ratio_shrunk_over_full"),
        "repeats": results,
    }
    summary["effective_goodput_ratio"] = (summary["effective_goodput"]["elastic"]
                                          / summary["effective_goodput"]["wait"])
    summary["effective_goodput_charged_ratio"] = (
        summary["effective_goodput_charged"]["elastic"]
        / summary["effective_goodput_charged"]["wait"])
    summary["elastic_no_progress_over_warm_restart"] = (
        summary["no_progress_per_failure_s"]["elastic"] / summary["warm_restart_s"])
    print(f"[bench] goodput (report): wait {summary['goodput']['wait']:.1%}, elastic "
          f"{summary['goodput']['elastic']:.1%}")
    print(f"[bench] effective goodput: wait {summary['effective_goodput']['wait']:.1%}, elastic "
          f"{summary['effective_goodput']['elastic']:.1%} (ratio "
          f"{summary['effective_goodput_ratio']:.2f}; goal >= 1.25)")
    print(f"[bench] effective goodput, steps on 2 slices charged 3/2 of a full step: wait "
          f"{summary['effective_goodput_charged']['wait']:.1%}, elastic "
          f"{summary['effective_goodput_charged']['elastic']:.1%} (ratio "
          f"{summary['effective_goodput_charged_ratio']:.2f})")
    print(f"[bench] no progress per failure: elastic "
          f"{summary['no_progress_per_failure_s']['elastic']:.1f} s, a warm restart "
          f"{summary['warm_restart_s']:.1f} s (ratio "
          f"{summary['elastic_no_progress_over_warm_restart']:.2f}; goal <= 2); waiting "
          f"{summary['no_progress_per_failure_s']['wait']:.1f} s")
    print(f"[bench] step rate on 2 slices / on 3: {summary['rate_ratio_shrunk_over_full']:.2f} "
          f"(goal >= 0.95 x 2/3 = {0.95 * 2 / 3:.2f})")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
