"""`multislice` as one tool: version, order, help written for users, shared validators, pipes."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.cli import build_parser
from scripts.cli import main as cli

ROOT = Path(__file__).resolve().parents[2]


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _help_texts(parser: argparse.ArgumentParser, path: str = "multislice"):
    for text in (parser.description, parser.epilog):
        if text:
            yield path, text
    for action in parser._actions:
        if action.help and action.help != argparse.SUPPRESS:
            yield path, action.help
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                yield path, choice.help or ""
            for name, sub in action.choices.items():
                yield from _help_texts(sub, f"{path} {name}")


def test_version_prints_the_installed_version(capsys):
    with pytest.raises(SystemExit) as done:
        cli(["--version"])
    assert done.value.code == 0
    assert re.fullmatch(r"multislice \d+\.\d+\.\d+\S*\n", capsys.readouterr().out)


def test_subcommands_come_in_the_order_a_user_meets_them():
    assert list(_subcommands(build_parser())) == [
        "new", "lock", "data", "local", "demo", "report", "plan", "render", "rehearse",
        "env-publish", "status", "watch", "babysit", "reset", "run", "logs", "queue", "gke-token",
    ]


def test_help_is_written_for_users_not_for_readers_of_the_source():
    for path, text in _help_texts(build_parser()):
        assert "`" not in text, f"{path}: {text!r}"
        assert not re.search(r"\bthe seed\b|\binfra\.|\.py\b", text), f"{path}: {text!r}"


def test_every_queued_resource_command_names_it_the_same_way():
    commands = _subcommands(build_parser())
    for name in ("status", "watch", "babysit", "reset", "run"):
        dests = {a.dest for a in commands[name]._actions}
        assert {"qr_id", "stack_config", "project", "zone", "request_timeout"} <= dests, name


def test_interval_and_timeout_mean_the_same_in_every_command():
    commands = _subcommands(build_parser())
    for name in ("watch", "babysit", "run"):
        by_flag = {s: a for a in commands[name]._actions for s in a.option_strings}
        assert by_flag["--interval"].type(str(2.5)) == 2.5, name  # seconds between polls
        assert by_flag["--timeout"].type("0") == 0.0, name  # 0: no limit


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--hosts", "h", "--max-concurrency", "0", "--", "true"], "whole number >= 1"),
        (["run", "--hosts", "h", "--ssh-port", "70000", "--", "true"], "from 1 to 65535"),
        (["run", "--hosts", "h", "--interval", "-1", "--", "true"], "seconds > 0"),
        (["demo", "--steps", "0"], "whole number >= 1"),
        (["plan", "--accelerator-type", "v4-8", "--slices", "1", "--params", "1e9",
          "--tokens-per-batch", "1e6"], "from 2 to 256"),
        (["plan", "--accelerator-type", "v4-8", "--slices", "2", "--params", "1e9",
          "--tokens-per-batch", "1e6", "--hbm-budget", "1.5"], "a number in (0, 1]"),
        (["plan", "--accelerator-type", "v4-8", "--slices", "2", "--params", "1e9",
          "--tokens-per-batch", "1e6", "--dcn-data", "0"], "positive whole number or -1"),
        (["data", "prepare", "--output", "x", "--eval-fraction", "1"], "a number in [0, 1)"),
    ],
)
def test_numeric_flags_are_checked_by_the_shared_validators(argv, message, capsys):
    with pytest.raises(SystemExit) as done:
        cli(argv)
    assert done.value.code == 2
    assert message in capsys.readouterr().err


def test_errors_share_one_prefix(tmp_path, capsys):
    assert cli(["run", "--hosts", str(tmp_path / "missing"), "--", "true"]) == 2
    assert capsys.readouterr().err.startswith("multislice run: error: --hosts")
    assert cli(["report", str(tmp_path / "nothing")]) != 0
    assert capsys.readouterr().err.startswith("multislice report: error: ")


def test_render_offers_json_like_every_other_command():
    render = _subcommands(build_parser())["render"]
    assert "--json" in {s for a in render._actions for s in a.option_strings}


def test_a_closed_pipe_ends_quietly():
    """`multislice plan --json | head -1`: no BrokenPipeError traceback, exit 141."""
    argv = [sys.executable, "-c", "from scripts.cli import main; raise SystemExit(main())",
            "plan", "--accelerator-type", "v4-8", "--slices", "2", "--params", "8e9",
            "--tokens-per-batch", "1048576", "--json"]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the command writes (it is still importing)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def _typed_flags():
    from scripts.cli import all_parsers

    for parser in all_parsers(build_parser()):
        for action in parser._actions:
            if callable(action.type) and action.option_strings:
                yield parser.prog, action


def test_no_number_flag_takes_nan_or_infinity():
    accepted = []
    for prog, action in _typed_flags():
        for text in ("nan", "inf", "-inf"):
            try:
                value = action.type(text)
            except (argparse.ArgumentTypeError, ValueError, TypeError):
                continue
            if isinstance(value, float | int):
                accepted.append(f"{prog} {action.option_strings[0]} {text} -> {value!r}")
    assert accepted == []


def test_every_parser_refuses_abbreviated_flags(capsys):
    from scripts.cli import all_parsers

    assert all(not p.allow_abbrev for p in all_parsers(build_parser()))
    with pytest.raises(SystemExit) as done:
        cli(["plan", "--accelerator", "v4-8", "--slices", "2", "--params", "1e9",
             "--tokens-per-batch", "1e6"])
    assert done.value.code == 2
    assert "error: unrecognized arguments: --accelerator v4-8" in capsys.readouterr().err


def test_trainer_arguments_without_the_separator_are_named_with_the_corrected_command(capsys):
    code = cli(["local", "--slices", "2", "--devices-per-slice", "1", "--config", "tiny",
                "--steps", "5"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("multislice local: error: unrecognized arguments: --config tiny "
                          "--steps 5; arguments for the trainer go after `--`: multislice local "
                          "--slices 2 --devices-per-slice 1 -- --config tiny --steps 5"), err
