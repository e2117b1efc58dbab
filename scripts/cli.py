"""The `multislice` command: a thin dispatcher over one module per subcommand.

Each module in COMMAND_MODULES exposes `register(subparsers)`, which adds its parser and sets
`func` (called with the parsed namespace, returns an exit code). Heavy imports (jax, pulumi,
google-cloud-tpu) stay inside the command functions so `multislice --help` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

COMMAND_MODULES: tuple[str, ...] = (
    "scripts.new",
    "scripts.local.command",
    "scripts.demo",
    "scripts.fanout.command",
    "scripts.plan",
    "scripts.tpu.commands",
    "scripts.render",
    "scripts.report.command",
    "scripts.data",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="multislice",
        description="Train JAX models on Cloud TPU Multislice: local emulation, planning, operations.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
