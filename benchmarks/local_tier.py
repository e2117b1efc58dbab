"""What the local checkpoint tier buys: the same drilled run with and without it, side by side.

    .venv/bin/python benchmarks/local_tier.py [--repeats 3] [--steps 120] [--failures 5]
                                              [--local-every 10] [--save-interval 50]

Each repeat trains the demo's model (the template's tiny config, 2 slices x 4 CPU devices under
`multislice local`) twice into run directories in a bucket of the GCS emulator (every bucket
read and write goes over loopback HTTP, as the trainer's on a TPU VM go to GCS): once with the
bucket tier alone (checkpoint.save_interval_steps = --save-interval), once adding the local tier
(checkpoint.local_every = --local-every). Both runs lose a slice --failures times, at the same
steps (drawn from the repeat's seed), each time coming back with its storage wiped as a recreated
VM does: so every local-tier restart restores the lost slice from its peer's copy.

Printed per repeat and as medians over the repeats:

- steps of work lost per failure (the restart rows' steps recomputed);
- restore seconds (the restore rows: a peer's and the slice's own local copy, or the bucket),
  and their ratio local-tier / bucket (the issue wants <= 0.25);
- the local save's blocking seconds over the step time (per save, and amortized over
  --local-every steps; the issue wants <= 2% at local_every = 10);
- goodput (productive step time over wall time, `multislice report`) of each run.

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
from scripts.report.command import build_report  # noqa: E402

BUCKET = "ms-bench-local-tier"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--failures", type=int, default=5)
    parser.add_argument("--local-every", type=int, default=10)
    parser.add_argument("--save-interval", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE",
                        help="a trainer override for both runs (repeatable), e.g. a larger "
                        "model: --set model.d_model=512 --set model.n_layers=8")
    args = parser.parse_args(argv)
    for name in ("repeats", "steps", "failures", "local_every", "save_interval"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.failures * 8 > args.steps:
        parser.error(f"--failures {args.failures} needs --steps >= {args.failures * 8} "
                     f"(got {args.steps}): each failure is followed by steps of its own")
    return args


def rows_of(log_dir: Path, gcs: Any, run: str) -> list[dict[str, Any]]:
    text = gcs.get(BUCKET, f"{run}/metrics.jsonl").decode()
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a row cut short by a kill
    return out


def _attempt_starts(rows: list[dict[str, Any]]) -> list[int]:
    """The step each attempt started from, in order (its restore row, or 0 for a fresh start)."""
    starts = []
    for row in rows:
        if row.get("event") == "restore":
            starts.append(int(row["restored_step"]))
        elif row.get("event") == "fresh_start":
            starts.append(0)
    return starts


def one_run(gcs: Any, experiment: Path | None, work: Path, name: str, args: argparse.Namespace,
            drills: list[Drill], local_every: int) -> dict[str, Any]:
    log_dir = work / name
    run = f"runs/{name}"
    sets = ["--set", f"checkpoint.save_interval_steps={args.save_interval}",
            "--set", f"checkpoint.local_every={local_every}",
            "--set", f"data.path={work / 'data'}", "--set", "data.prepare_if_missing=true",
            *[arg for value in args.overrides for arg in ("--set", value)]]
    code = run_local(experiment=experiment, slices=2, devices_per_slice=4,
                     run_dir=f"gs://{BUCKET}/{run}", log_dir=log_dir,
                     trainer_args=["--config", "tiny", "--steps", str(args.steps), *sets],
                     kill_at=drills, max_restarts=len(drills), init_timeout_s=120,
                     stall_timeout_s=300, stop_grace_s=3)
    if code != 0:
        raise SystemExit(f"{name}: multislice local exited {code}; see {log_dir}/logs")
    rows = rows_of(log_dir, gcs, run)
    restores = [r for r in rows if r.get("event") == "restore"]
    # Work lost per failure: the step a slice had reported when it was killed (the launcher's
    # own record) minus the step the next attempt resumed from (0: a fresh start). The trainer's
    # restart rows are not used: metrics.jsonl in a bucket is flushed periodically, so rows
    # written shortly before a kill may be missing.
    launcher = [json.loads(line) for line in (log_dir / "launcher.jsonl").read_text().splitlines()]
    kills = [e["step"] for e in launcher if e.get("event") == "kill"]
    starts = _attempt_starts(rows)
    steps = [r["step_time_s"] for r in rows if r.get("event") == "step"]
    local_saves = [r["blocking_s"] for r in rows if r.get("event") == "local_checkpoint"]
    report = build_report(f"gs://{BUCKET}/{run}", write_png=False)
    step_s = statistics.median(steps)
    out = {
        "steps_lost": [kill - start for kill, start in zip(kills, starts[1:], strict=False)],
        "restore_s": [r["duration_s"] for r in restores],
        "local_phases_s": [r["local_phases_s"] for r in restores if "local_phases_s" in r],
        "state_bytes_per_process": max((int(r.get(f"bytes_{t}") or 0)
                                        // max(1, int(r.get(f"processes_{t}") or 0))
                                        for r in restores for t in ("local", "peer", "bucket")),
                                       default=0),
        "restore_tiers": [r.get("tier") for r in restores],
        "bucket_bytes_read": sum(int(r.get("bytes_bucket") or 0) for r in restores),
        "step_s": step_s,
        "goodput": report.goodput,
    }
    if local_saves:
        blocking = statistics.median(local_saves)
        out["local_save_blocking_s"] = blocking
        out["local_save_over_step"] = blocking / step_s
        out["local_save_over_step_amortized"] = blocking / (local_every * step_s)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results: list[dict[str, Any]] = []
    with serving_bucket(BUCKET) as gcs, tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for repeat in range(args.repeats):
            rng = random.Random(args.seed + repeat)
            kill_steps = failure_steps(args.steps, args.failures, rng, spread=3)
            drills = [Drill(step=s, slice=rng.randrange(2), wipe=True) for s in kill_steps]
            print(f"[bench] repeat {repeat}: failures at steps {kill_steps}", flush=True)
            pair = {}
            for name, every in (("bucket-only", 0), ("local-tier", args.local_every)):
                pair[name] = one_run(gcs, None, work, f"r{repeat}-{name}", args, drills, every)
                print(f"[bench] repeat {repeat} {name}: {json.dumps(pair[name])}", flush=True)
            results.append(pair)

    def med(name: str, key: str, reduce=statistics.median) -> float:
        return statistics.median(reduce(r[name][key]) if isinstance(r[name][key], list)
                                 else r[name][key] for r in results)

    summary = {
        "command": "benchmarks/local_tier.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "steps_lost_per_failure": {n: med(n, "steps_lost", statistics.mean)
                                   for n in ("bucket-only", "local-tier")},
        "restore_s": {n: med(n, "restore_s") for n in ("bucket-only", "local-tier")},
        "goodput": {n: med(n, "goodput") for n in ("bucket-only", "local-tier")},
        "local_save_over_step": med("local-tier", "local_save_over_step"),
        "local_save_over_step_amortized": med("local-tier", "local_save_over_step_amortized"),
        "local_tier_bucket_bytes_read": [r["local-tier"]["bucket_bytes_read"] for r in results],
        "repeats": results,
    }
    summary["restore_ratio_local_over_bucket"] = (summary["restore_s"]["local-tier"]
                                                  / summary["restore_s"]["bucket-only"])
    print(f"[bench] steps lost per failure: bucket only "
          f"{summary['steps_lost_per_failure']['bucket-only']:.1f}, local tier "
          f"{summary['steps_lost_per_failure']['local-tier']:.1f}")
    print(f"[bench] restore: bucket {summary['restore_s']['bucket-only']:.2f} s, local tier "
          f"{summary['restore_s']['local-tier']:.2f} s (ratio "
          f"{summary['restore_ratio_local_over_bucket']:.2f})")
    print(f"[bench] local save blocking / step time: {summary['local_save_over_step']:.1%} per "
          f"save, {summary['local_save_over_step_amortized']:.2%} amortized over "
          f"{args.local_every} steps")
    print(f"[bench] goodput: bucket only {summary['goodput']['bucket-only']:.1%}, local tier "
          f"{summary['goodput']['local-tier']:.1%}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
