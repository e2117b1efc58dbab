"""Command line entry: `python -m trainer.main --config tiny --steps N --run-dir R ...`.

`--check` validates everything without training or compiling and prints one JSON line
(`trainer.check`): `python -m trainer.main --config llama-3.2-1b --check`.

Order matters: parse and validate the config, start the distributed runtime, check the expected
slices are all present, then train. Every config, topology or data error surfaces before any
compilation. Running the same command again on the same --run-dir resumes from the newest complete
checkpoint in RUN_DIR/checkpoints (also on another slice count: the state is resharded and the
global data order continues).

Exit codes:
    0   trained until --steps (the final checkpoint is committed)
    1   an unhandled exception (a crash; restartable)
    2   invalid arguments, config, topology, data or storage (the message names the value),
        checkpoints that cannot be restored (another model, another data set, all unreadable),
        or a step that does not fit in device memory when compiled
    3   diverged: a step's loss or gradient norm was not finite; nothing computed from it was
        saved, so the newest checkpoint is still a good one (restarting would diverge again)
    42  preempted: SIGTERM arrived, the step in progress finished, a checkpoint of it was saved
        and committed; restart the same command to resume (what the TPU startup script and
        `multislice local --max-restarts` do)
    4   the distributed runtime did not form: a peer or the coordinator was not reachable
        within the initialization timeout; restart once the other hosts are up

Restartable: 4 and 42 (and a crash: a signal, or 1 from an unhandled exception). Never restarted:
2 and 3, which would fail the same way again.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence

from .runtime.launch_times import supervisor_times
from .runtime.storage import absolute

EXIT_DIVERGED = 3
EXIT_CLUSTER_UNAVAILABLE = 4
EXIT_SPEC_MISMATCH = 5


def _positive_gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GiB > 0, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number of GiB > 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trainer.main", allow_abbrev=False,
                                     description="Train the language model.")
    parser.add_argument("--config", default="default",
                        help="preset name in configs/ (e.g. tiny) or a path to a .toml file")
    parser.add_argument("--steps", type=int, default=None,
                        help="train until this global step (the LR horizon is train.total_steps)")
    parser.add_argument("--run-dir", type=absolute, default=None,
                        help="local path (relative to here) or gs://bucket/path")
    parser.add_argument("--check", action="store_true",
                        help="validate config, mesh and data, print sizes as JSON, and exit "
                             "without compiling")
    parser.add_argument("--device-memory-gib", type=_positive_gib, default=None, metavar="GIB",
                        help="with --check: the memory one device has (e.g. 16 for v5e), to "
                             "check a TPU's fit on a laptop; default: the runtime's own limit")
    parser.add_argument("--seed", type=int, default=None, help="overrides train.seed")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="override a config value (repeatable)")
    parser.add_argument("--expect-slices", type=int, default=None)
    parser.add_argument("--expect-devices-per-slice", type=int, default=None)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    process_start = time.time()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.check and (args.steps is None or args.run_dir is None):
        parser.error("--steps and --run-dir are required (except with --check)")
    if (args.expect_slices is None) != (args.expect_devices_per_slice is None):
        print("error: --expect-slices and --expect-devices-per-slice go together", file=sys.stderr)
        return 2
    if args.steps is not None and args.steps < 0:
        print(f"error: --steps {args.steps}: must be >= 0", file=sys.stderr)
        return 2

    from .config import ConfigError, load_config
    from .dataset.input_pipeline import DataError
    from .hf.weights import WeightsError
    from .mesh import devices_by_slice
    from .runtime.checkpoint import CheckpointError, CheckpointMismatch
    from .runtime.distributed import (
        ClusterUnavailable,
        DistributedError,
        SpecMismatch,
        check_expected,
        check_same_spec,
        initialize,
    )
    from .runtime.preemption import EXIT_PREEMPTED, PreemptionGuard
    from .runtime.storage import StorageError
    from .train import Preempted, TrainingDiverged, run  # before `try`: named by `except`

    imported = time.time()
    launched = supervisor_times(process_start)

    overrides = list(args.overrides)
    if args.seed is not None:
        overrides.append(f"train.seed={args.seed}")
    try:
        config = load_config(args.config, overrides)
        started = time.time()
        how = initialize()
        init_s = time.time() - started
        if args.expect_slices is not None:
            check_expected(devices_by_slice(), args.expect_slices, args.expect_devices_per_slice)
        generation = check_same_spec()  # every process runs it: no mixed job trains
        # Written by run() later: each row carries the instant it describes.
        timeline = [
            {"event": "process_start", "time": process_start, **launched},
            {"event": "imports", "time": imported,
             "duration_s": imported - launched.get("launched_at", process_start)},
            {"event": "distributed_init", "time": started + init_s, "duration_s": init_s,
             "mode": how, **({"spec_generation": generation} if generation is not None else {})},
        ]

        if args.check:
            import json

            import jax

            from .check import check_report

            report = check_report(config, args.run_dir, args.device_memory_gib)
            if jax.process_index() == 0:
                print(json.dumps(report), flush=True)
            return 0
        guard = PreemptionGuard().install()  # after initialize: it asks for the process count
        run(config, args.steps, args.run_dir, guard=guard, timeline=timeline)
    except Preempted as exc:
        print(f"{exc}; exit code {EXIT_PREEMPTED}", file=sys.stderr)
        return EXIT_PREEMPTED
    except SpecMismatch as exc:
        print(f"error: {exc}; exit code {EXIT_SPEC_MISMATCH} (restartable)", file=sys.stderr)
        return EXIT_SPEC_MISMATCH
    except ClusterUnavailable as exc:
        print(f"error: {exc}; exit code {EXIT_CLUSTER_UNAVAILABLE} (restartable)",
              file=sys.stderr)
        return EXIT_CLUSTER_UNAVAILABLE
    except (ConfigError, DataError, DistributedError, StorageError, WeightsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except CheckpointMismatch as exc:  # another model's checkpoints: a restart cannot help
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except CheckpointError as exc:  # none restorable, or processes disagree: a restart cannot help
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except TrainingDiverged as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_DIVERGED
    return 0


if __name__ == "__main__":
    sys.exit(main())
