"""Restart-to-first-step with a warm compilation cache, over a cold start of the same run.

    .venv/bin/python benchmarks/restart.py [--repeats 3] [--steps 20] [--more-steps 10]
                                           [--slices 1 --devices-per-slice 1] [--config tiny]

Each repeat trains the template's config into a fresh run directory (cold: empty compilation
cache, no checkpoint, state initialised from the seed), then runs the same command again with
--steps raised by --more-steps (warm: it restores the final checkpoint and compiles from
RUN_DIR/compile_cache). Both read one dataset prepared beforehand (`--set data.path=...`), so
the data preparation of a first run is not part of either number. The time measured is from the
trainer's `process_start` row to its first `step` row in metrics.jsonl (the same timeline
`multislice report` reads); the launch-to-first-step time seen from outside is reported too.
With --slices > 1 the runs go through `multislice local` (one process per emulated slice).
Medians over the repeats; the ratio is warm over cold, both measured in the same repeat. The last
line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from trainer_runs import (  # also puts the repository on sys.path
    BenchmarkError,
    attempts,
    first,
    median,
    prepare_data,
    read_rows,
    render_experiment,
    run_trainer,
)

from scripts.report.phases import PHASES, startup_phases  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="steps of the cold run")
    parser.add_argument("--more-steps", type=int, default=10, help="extra steps of the warm run")
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--slices", type=int, default=1)
    parser.add_argument("--devices-per-slice", type=int, default=1)
    args = parser.parse_args(argv)
    for name in ("repeats", "steps", "more_steps", "slices", "devices_per_slice"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    return args


def phases(rows: list[dict[str, Any]], launched: float | None) -> dict[str, Any]:
    """Seconds from process start to the first step row, and what that time was spent on."""
    start = first(rows, "process_start")
    step = first(rows, "step")
    if start is None or step is None:
        raise BenchmarkError("an attempt lacks a process_start or a step row")
    out: dict[str, Any] = {
        "process_start_to_first_step_s": step["time"] - start["time"],
        "first_step_time_s": step["step_time_s"],
    }
    init = first(rows, "distributed_init")
    if init is not None:
        out["process_start_to_distributed_init_s"] = init["time"] - start["time"]
    for event in ("data_ready", "fresh_start", "restore", "compile"):
        row = first(rows, event)
        if row is not None:
            out[f"{event}_s"] = row.get("duration_s")
    if launched is not None:
        out["launch_to_first_step_s"] = step["time"] - launched
    split = startup_phases(rows)
    if split is not None:
        out.update({f"phase_{k}_s": v for k, v in split.seconds.items()})
        out["compile_overlapped_s"] = split.compile_overlapped_s
    return out


def launch_times(run_dir: Path) -> list[float]:
    return [r["time"] for r in read_rows(run_dir, "launcher.jsonl") if r.get("event") == "launch"]


def one_repeat(experiment: Path, run_dir: Path, data: Path, args: argparse.Namespace,
               ) -> dict[str, Any]:
    common = ["--config", args.config, "--set", f"data.path={json.dumps(str(data))}"]
    shape = {"slices": args.slices, "devices_per_slice": args.devices_per_slice}
    cold_run = run_trainer(experiment, run_dir, [*common, "--steps", str(args.steps)], **shape)
    warm_run = run_trainer(experiment, run_dir,
                           [*common, "--steps", str(args.steps + args.more_steps)], **shape)
    groups = attempts(run_dir)
    if len(groups) != 2:
        raise BenchmarkError(f"expected 2 trainer starts in {run_dir}, found {len(groups)}")
    if args.slices == 1:
        launches = [cold_run.launched, warm_run.launched]
    else:
        launches = launch_times(run_dir)[-2:]
    cold, warm = (phases(g, t) for g, t in zip(groups, launches, strict=True))
    restore = first(groups[1], "restore")
    if restore is None or restore.get("restored_step") != args.steps:
        raise BenchmarkError(f"the warm run did not restore step {args.steps}: {restore}")
    return {"cold": cold, "warm": warm}


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    def med(kind: str, key: str) -> float | None:
        values = [r[kind][key] for r in results if r[kind].get(key) is not None]
        return median(values) if values else None

    keys = sorted({k for r in results for kind in ("cold", "warm") for k in r[kind]})
    out = {kind: {k: med(kind, k) for k in keys} for kind in ("cold", "warm")}
    key = "process_start_to_first_step_s"
    ratios = [r["warm"][key] / r["cold"][key] for r in results]
    out["ratio_warm_over_cold"] = out["warm"][key] / out["cold"][key]
    out["ratio_per_repeat"] = ratios
    out["median_ratio_per_repeat"] = median(ratios)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-restart-") as tmp:
        root = Path(tmp)
        experiment = render_experiment(root)
        data = prepare_data(experiment, root / "data", args.config)
        for i in range(args.repeats):
            result = one_repeat(experiment, root / f"run-{i}", data, args)
            key = "process_start_to_first_step_s"
            print(f"repeat {i + 1}/{args.repeats}: cold {result['cold'][key]:.2f} s, warm "
                  f"{result['warm'][key]:.2f} s to the first step", file=sys.stderr, flush=True)
            results.append(result)
    summary = summarize(results)
    summary.update(config=args.config, slices=args.slices,
                   devices_per_slice=args.devices_per_slice, repeats=args.repeats,
                   steps=args.steps, more_steps=args.more_steps)
    key = "process_start_to_first_step_s"
    print(f"process start to first step: cold {summary['cold'][key]:.2f} s, warm restart "
          f"{summary['warm'][key]:.2f} s (ratio {summary['ratio_warm_over_cold']:.2f}; compile "
          f"{summary['cold'].get('compile_s') or 0:.2f} s -> "
          f"{summary['warm'].get('compile_s') or 0:.2f} s)")
    for kind in ("cold", "warm"):
        print(f"{kind} by phase: " + ", ".join(
            f"{k} {summary[kind].get(f'phase_{k}_s') or 0:.2f}" for k in PHASES))
    print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchmarkError as err:
        print(f"benchmark failed: {err}", file=sys.stderr)
        sys.exit(1)
