"""How long the train loop blocks per async checkpoint save, over the mean step time.

    .venv/bin/python benchmarks/checkpoint_blocking.py [--repeats 3] [--steps 60] [--config tiny]
                                                       [--set SECTION.KEY=VALUE ...]

Each repeat trains the template's config (one process, --devices CPU devices) into a fresh run
directory at the config's own checkpoint.save_interval_steps. From that run's metrics.jsonl:
the `blocking_s` of every `checkpoint` row (the time `Checkpointer.save` held the loop: the
device-to-host copy and any wait for the previous save) and the mean `step_time_s` of the step
rows after the first (which includes the pipeline fill), leaving out the steps that saved (their
measured time contains the blocking). Both come from the same run, so
machine noise hits them alike. Reported per repeat and as medians: blocking per save over the
mean step time (how many steps one save costs) and the amortised overhead, total blocking over
total step time. The commit wait after the last step (`checkpoint_wait`) is reported apart. The
last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from trainer_runs import (
    BenchmarkError,
    attempts,
    median,
    prepare_data,
    render_experiment,
    run_trainer,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--devices", type=int, default=1, help="CPU devices of the one process")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="passed to the trainer (repeatable)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.steps < 2 or args.devices < 1:
        parser.error(f"--repeats {args.repeats} >= 1, --steps {args.steps} >= 2 and --devices "
                     f"{args.devices} >= 1 are required")
    return args


def measure(rows: list[dict[str, Any]]) -> dict[str, Any]:
    steps = [r for r in rows if r.get("event") == "step"]
    saves = [r for r in rows if r.get("event") == "checkpoint"]
    if len(steps) < 2 or not saves:
        raise BenchmarkError(f"need >= 2 step rows and a checkpoint row; got {len(steps)} steps "
                             f"and {len(saves)} saves (is --steps below the save interval?)")
    saved_at = {r.get("step") for r in saves}
    # A save blocks inside the measured time of the step it saves; leave those steps out.
    step_times = [r["step_time_s"] for r in steps[1:] if r["step"] not in saved_at]
    if not step_times:
        raise BenchmarkError("every step after the first saved a checkpoint; raise --steps")
    blocking = [r["blocking_s"] for r in saves]
    mean_step = sum(step_times) / len(step_times)
    wait = next((r.get("duration_s") for r in rows if r.get("event") == "checkpoint_wait"), None)
    return {
        "saves": len(saves),
        "save_steps": [r.get("step") for r in saves],
        "blocking_s": blocking,
        "median_blocking_s": median(blocking),
        "mean_step_time_s": mean_step,
        "blocking_over_mean_step": median(blocking) / mean_step,
        "amortised_overhead": sum(blocking) / sum(r["step_time_s"] for r in steps),
        "final_commit_wait_s": wait,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        root = Path(tmp)
        experiment = render_experiment(root)
        data = prepare_data(experiment, root / "data", args.config)
        trainer_args = ["--config", args.config, "--steps", str(args.steps),
                        "--set", f"data.path={json.dumps(str(data))}"]
        for override in args.overrides:
            trainer_args += ["--set", override]
        interval = _save_interval(experiment, args)
        for i in range(args.repeats):
            run_dir = root / f"run-{i}"
            run_trainer(experiment, run_dir, trainer_args, devices_per_slice=args.devices)
            (rows,) = attempts(run_dir)
            result = measure(rows)
            print(f"repeat {i + 1}/{args.repeats}: {result['saves']} saves, median blocking "
                  f"{1e3 * result['median_blocking_s']:.1f} ms, mean step "
                  f"{1e3 * result['mean_step_time_s']:.1f} ms", file=sys.stderr, flush=True)
            results.append(result)
    summary = {
        "config": args.config,
        "overrides": args.overrides,
        "save_interval_steps": interval,
        "steps": args.steps,
        "devices": args.devices,
        "repeats": args.repeats,
        "median_blocking_s": median([r["median_blocking_s"] for r in results]),
        "mean_step_time_s": median([r["mean_step_time_s"] for r in results]),
        "blocking_over_mean_step": median([r["blocking_over_mean_step"] for r in results]),
        "amortised_overhead": median([r["amortised_overhead"] for r in results]),
        "per_repeat": results,
    }
    print(f"async save blocks the loop {1e3 * summary['median_blocking_s']:.1f} ms = "
          f"{summary['blocking_over_mean_step']:.2f} mean steps "
          f"({1e3 * summary['mean_step_time_s']:.1f} ms) per save every {interval} steps; "
          f"amortised overhead {100 * summary['amortised_overhead']:.1f}% of step time")
    print(json.dumps(summary, sort_keys=True))
    return 0


def _save_interval(experiment: Path, args: argparse.Namespace) -> int | None:
    """checkpoint.save_interval_steps after the overrides, read the way the trainer reads it."""
    import subprocess

    code = ("import sys; from trainer.config import load_config; "
            "print(load_config(sys.argv[1], sys.argv[2:]).checkpoint.save_interval_steps)")
    done = subprocess.run([sys.executable, "-c", code, args.config, *args.overrides],
                          cwd=experiment, capture_output=True, text=True, check=False)
    return int(done.stdout.strip()) if done.returncode == 0 else None


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchmarkError as err:
        print(f"benchmark failed: {err}", file=sys.stderr)
        sys.exit(1)
