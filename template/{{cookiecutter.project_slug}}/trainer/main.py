"""Command line entry: `python -m trainer.main --config tiny --steps N --run-dir R ...`.

Order matters: parse and validate the config, start the distributed runtime, check the expected
slices are all present, then train. Every config, topology or data error surfaces before any
compilation. Running the same command again on the same --run-dir resumes from the newest complete
checkpoint in RUN_DIR/checkpoints (also on another slice count: the state is resharded and the
global data order continues).

Exit codes:
    0   trained until --steps (the final checkpoint is committed)
    1   a checkpoint exists but none could be restored
    2   invalid arguments, config, topology or data (the message names the value)
    42  preempted: SIGTERM arrived, the step in progress finished, a checkpoint of it was saved
        and committed; restart the same command to resume (what the TPU startup script and
        `multislice local --max-restarts` do)
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trainer.main",
                                     description="Train the language model.")
    parser.add_argument("--config", default="default",
                        help="preset name in configs/ (e.g. tiny) or a path to a .toml file")
    parser.add_argument("--steps", type=int, required=True,
                        help="train until this global step (the LR horizon is train.total_steps)")
    parser.add_argument("--run-dir", required=True, help="local path or gs://bucket/path")
    parser.add_argument("--seed", type=int, default=None, help="overrides train.seed")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="override a config value (repeatable)")
    parser.add_argument("--expect-slices", type=int, default=None)
    parser.add_argument("--expect-devices-per-slice", type=int, default=None)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    process_start = time.time()
    args = build_parser().parse_args(argv)
    if (args.expect_slices is None) != (args.expect_devices_per_slice is None):
        print("error: --expect-slices and --expect-devices-per-slice go together", file=sys.stderr)
        return 2
    if args.steps < 0:
        print(f"error: --steps {args.steps}: must be >= 0", file=sys.stderr)
        return 2

    from .checkpoint import CheckpointError
    from .config import ConfigError, load_config
    from .data_pipeline import DataError
    from .distributed import DistributedError, check_expected, initialize
    from .mesh import devices_by_slice
    from .preemption import EXIT_PREEMPTED, PreemptionGuard
    from .train import Preempted, run  # before `try`: its except clause names Preempted

    overrides = list(args.overrides)
    if args.seed is not None:
        overrides.append(f"train.seed={args.seed}")
    try:
        config = load_config(args.config, overrides)
        started = time.time()
        how = initialize()
        timeline = [
            {"event": "process_start", "time": process_start},
            {"event": "distributed_init", "duration_s": time.time() - started, "mode": how},
        ]
        if args.expect_slices is not None:
            check_expected(devices_by_slice(), args.expect_slices, args.expect_devices_per_slice)

        guard = PreemptionGuard().install()  # after initialize: it asks for the process count
        run(config, args.steps, args.run_dir, guard=guard, timeline=timeline)
    except Preempted as exc:
        print(f"{exc}; exit code {EXIT_PREEMPTED}", file=sys.stderr)
        return EXIT_PREEMPTED
    except (ConfigError, DataError, DistributedError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
