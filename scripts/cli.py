"""The `multislice` command: a thin dispatcher over one module per subcommand.

Each module in COMMAND_MODULES exposes `register(subparsers)`, which adds its parser and sets
`func` (called with the parsed namespace, returns an exit code). Heavy imports (jax, pulumi,
google-cloud-tpu) stay inside the command functions so `multislice --help` is instant.

Everything after the first `--` is handed to the command untouched (the trainer's arguments for
`local`, the remote command for `run`): a command that takes such arguments names where they go
with `set_defaults(passthrough="DEST")`.

Exit codes are one table (README, docs/CONTRACTS.md): 0 done, 1 the work failed, 2 bad arguments
or config, 3/4 command-specific outcomes, 130 interrupted, 141 stdout closed early (a pipe).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings
from collections.abc import Sequence
from importlib import metadata

# In the order a user meets them: make an experiment and its data, run it locally and look at
# the run, plan and review the stack, then operate the queued resource.
COMMAND_MODULES: tuple[str, ...] = (
    "scripts.new",
    "scripts.lock",
    "scripts.data",
    "scripts.local.command",
    "scripts.demo",
    "scripts.report.command",
    "scripts.plan.command",
    "scripts.render",
    "scripts.rehearse.command",
    "scripts.env_publish",
    "scripts.tpu.commands",
    "scripts.fanout.command",
    "scripts.logs",
    "scripts.gke.queue",
    "scripts.gke.token",
)
EXIT_USAGE = 2
PASSED_TO = {"trainer_args": "the trainer", "remote_command": "the remote command",
             "prepare_args": "trainer.prepare"}
EXIT_INTERRUPTED = 130
EXIT_PIPE_CLOSED = 141  # what a shell reports for a process ended by SIGPIPE


def version() -> str:
    try:
        return metadata.version("multislice-toolkit")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="multislice",
        description="Train JAX models on Cloud TPU Multislice: local emulation, planning, operations.",
    )
    parser.add_argument("--version", action="version", version=f"multislice {version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    for each in all_parsers(parser):
        each.allow_abbrev = False  # `--step` must not silently mean `--steps`
    return parser


def all_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The parser and every subcommand's parser under it."""
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                found += all_parsers(sub)
    return found


def _command_parser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The (sub)parser that the leading command words of argv select."""
    for word in argv:
        if word.startswith("-"):
            break
        subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subparsers or word not in subparsers[0].choices:
            break
        parser = subparsers[0].choices[word]
    return parser


def _split_passthrough(parser: argparse.ArgumentParser, argv: list[str]
                       ) -> tuple[list[str], list[str] | None]:
    """argv before the first `--`, and what follows it, for a command that takes passthrough
    arguments; other commands get `--` as argparse's usual end of options."""
    if "--" not in argv or _command_parser(parser, argv).get_default("passthrough") is None:
        return argv, None
    index = argv.index("--")
    return argv[:index], argv[index + 1:]


def _forgotten_separator(parser: argparse.ArgumentParser, argv: list[str]
                         ) -> tuple[str, str] | None:
    """(command, message) when a command that passes arguments on (after `--`) was given options
    it does not know and no `--`: they were meant for the trainer (or the remote command)."""
    command_parser = _command_parser(parser, argv)
    dest = command_parser.get_default("passthrough")
    if dest is None:
        return None
    try:
        _, unknown = parser.parse_known_args(argv)
    except SystemExit:
        return None  # argparse has already said what is wrong with the command's own options
    if not unknown:
        return None
    # Everything from the first unknown word on was meant for the command behind `--`.
    first = argv.index(unknown[0])
    passed = argv[first:]
    corrected = " ".join(["multislice", *argv[:first], "--", *passed])
    command = command_parser.prog.removeprefix("multislice ").strip()
    target = PASSED_TO.get(dest, dest.replace("_", " "))
    return command, (f"unrecognized arguments: {' '.join(passed)}; arguments for {target} go "
                     f"after `--`: {corrected}")


def main(argv: Sequence[str] | None = None) -> int:
    # Google client libraries warn about Python and library versions on import; that is noise
    # for someone running a command, not something they can act on here.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"google(\.|$)")
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    head, tail = _split_passthrough(parser, argv)
    forgot = _forgotten_separator(parser, head) if tail is None else None
    if forgot is not None:
        command, message = forgot
        print(f"multislice {command}: error: {message}", file=sys.stderr)
        return EXIT_USAGE
    args = parser.parse_args(head)
    if tail is not None:
        setattr(args, args.passthrough, tail)
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`multislice plan --json | head -1`): stop quietly, and keep
        # Python from complaining again when it flushes stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_PIPE_CLOSED
    return code


if __name__ == "__main__":
    sys.exit(main())
