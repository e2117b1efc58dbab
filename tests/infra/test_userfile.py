"""Files and directories a user names are read in bounded time and memory, and refused in one
line naming the path: FIFOs, devices, directories, loops, huge files, YAML alias bombs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra.stack_config.schema import StackConfigError
from infra.stack_config.stack_file import read_stack_file
from infra.stack_config.userfile import (
    MAX_CONFIG_BYTES,
    MAX_YAML_NODES,
    UserFileError,
    directory,
    load_yaml,
    quote,
    read_text,
    resolve,
)

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`multislice ARGS` from the repository root, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "scripts.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def alias_bomb(levels: int = 9, width: int = 10) -> str:
    """A few hundred bytes that stand for width**levels strings once expanded."""
    lines = ["config:", "  multislice:a0: &a0 [" + ", ".join(["lol"] * width) + "]"]
    for level in range(1, levels):
        lines.append(f"  multislice:a{level}: &a{level} ["
                     + ", ".join([f"*a{level - 1}"] * width) + "]")
    lines.append(f"  multislice:zones: [*a{levels - 1}]")
    return "\n".join(lines) + "\n"


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "Pulumi.dev.yaml"
    os.mkfifo(fifo)
    started = time.monotonic()
    with pytest.raises(UserFileError, match=r"is a FIFO \(named pipe\); the stack file must be"):
        read_text(fifo, "stack file")
    assert time.monotonic() - started < 1


def test_a_directory_a_device_and_a_missing_path_are_each_named(tmp_path):
    with pytest.raises(UserFileError, match="is a directory"):
        read_text(tmp_path, "stack file")
    with pytest.raises(UserFileError, match="is a character device"):
        read_text(Path("/dev/zero"), "stack file")
    with pytest.raises(UserFileError, match="cannot read the stack file"):
        read_text(tmp_path / "absent.yaml", "stack file")


def test_a_file_over_the_limit_is_refused_by_its_size_before_it_is_read(tmp_path):
    big = tmp_path / "Pulumi.big.yaml"
    with big.open("wb") as out:
        out.truncate(MAX_CONFIG_BYTES + 1)  # sparse: no megabyte is written or read
    with pytest.raises(UserFileError, match=rf"{MAX_CONFIG_BYTES + 1:,} bytes; a stack file is "
                                            rf"at most {MAX_CONFIG_BYTES:,} bytes"):
        read_text(big, "stack file")


def test_bytes_that_are_not_utf8_are_named_by_offset(tmp_path):
    binary = tmp_path / "Pulumi.bin.yaml"
    binary.write_bytes(b"config:\n  a: \xff\n")
    with pytest.raises(UserFileError, match="byte 13 is not UTF-8"):
        read_text(binary, "stack file")


def test_an_alias_bomb_is_refused_before_any_value_is_built():
    started = time.monotonic()
    with pytest.raises(UserFileError, match=rf"expand to over {MAX_YAML_NODES:,} values"):
        load_yaml(alias_bomb(), "Pulumi.bomb.yaml")
    assert time.monotonic() - started < 5


def test_aliases_within_the_bound_still_load():
    text = "base: &b {zone: us-central2-b}\na: *b\nb: [*b, *b]\n"
    assert load_yaml(text, "x") == {"base": {"zone": "us-central2-b"},
                                    "a": {"zone": "us-central2-b"},
                                    "b": [{"zone": "us-central2-b"}] * 2}


def test_a_stack_file_that_is_a_bomb_or_a_fifo_is_a_stack_config_error(tmp_path):
    bomb = tmp_path / "Pulumi.bomb.yaml"
    bomb.write_text(alias_bomb())
    with pytest.raises(StackConfigError, match="alias bomb"):
        read_stack_file(bomb)
    fifo = tmp_path / "Pulumi.fifo.yaml"
    os.mkfifo(fifo)
    with pytest.raises(StackConfigError, match="is a FIFO"):
        read_stack_file(fifo)


def test_status_of_a_fifo_stack_file_exits_2_in_one_line_at_once(tmp_path):
    fifo = tmp_path / "Pulumi.dev.yaml"
    os.mkfifo(fifo)
    done = cli("status", "--stack-config", str(fifo))
    assert done.returncode == 2, done.stderr
    assert "is a FIFO" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_symlink_loop_and_a_file_where_a_directory_is_wanted_are_one_line(tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(UserFileError, match=r"--workdir .*loop: cannot be resolved"):
        resolve(loop, "--workdir")
    with pytest.raises(UserFileError, match=r"--workdir .*loop/sub: cannot be resolved: a "
                                            "symlink loop"):
        directory(loop / "sub", "--workdir")
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(UserFileError, match="is a file; give a directory"):
        directory(file, "--workdir")
    assert directory(tmp_path / "new" / "dir", "--workdir").is_dir()


def test_local_stack_config_that_loops_exits_2_in_one_line(tmp_path):
    loop = tmp_path / "Pulumi.loop.yaml"
    loop.symlink_to(loop)
    done = cli("local", "--stack-config", str(loop))
    assert done.returncode == 2, done.stderr
    assert "cannot be resolved" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_quoted_value_is_cut_to_a_bounded_prefix():
    assert quote("abc") == "'abc'"
    long = "x" * 8_000_000
    quoted = quote(long)
    assert len(quoted) < 120 and quoted.endswith("(8000000 characters)")


def test_a_megabyte_value_in_a_stack_file_is_quoted_by_its_ends_only(tmp_path):
    from infra.stack_config.validation import load_stack_file

    stack = tmp_path / "Pulumi.big.yaml"
    stack.write_text("config:\n  multislice:project: my-proj\n  multislice:region: us-central2\n"
                     f"  multislice:zone: us-central2-b{'x' * 800_000}\n"
                     "  multislice:accelerator_type: v4-8\n  multislice:slices: 2\n"
                     "  multislice:experiment_dir: exp\n")
    with pytest.raises(StackConfigError) as caught:
        load_stack_file(stack, check_files=False)
    message = str(caught.value)
    assert len(message) < 3000, message[:3000]
    assert "zone: 'us-central2-bxxx" in message and "characters cut" in message


def test_a_hosts_file_that_is_a_fifo_is_one_line_exit_2(tmp_path):
    fifo = tmp_path / "hosts"
    os.mkfifo(fifo)
    done = cli("run", "--hosts", str(fifo), "--", "true")
    assert done.returncode == 2, done.stderr
    assert "is a FIFO" in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_a_uri_where_a_local_directory_is_required_is_refused_and_creates_nothing(
        tmp_path, monkeypatch):
    from infra.stack_config.userfile import directory

    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserFileError, match=r"^--workdir gs://b/runs: is a gs:// URI, but this "
                       r"takes a local directory"):
        directory(Path("gs://b/runs"), "--workdir")
    assert list(tmp_path.iterdir()) == []  # no directory named "gs:"


def test_new_refuses_a_uri_output_and_a_failed_render_leaves_nothing(tmp_path, monkeypatch):
    import cookiecutter.main

    from scripts.new import NewProjectError, render_template

    monkeypatch.chdir(tmp_path)
    with pytest.raises(NewProjectError, match="is a gs:// URI"):
        render_template("demo", "gs://b/experiments")

    def refuse(*args, **kwargs):
        raise RuntimeError("the template could not be rendered")

    monkeypatch.setattr(cookiecutter.main, "cookiecutter", refuse)
    with pytest.raises(RuntimeError):
        render_template("demo", tmp_path / "new" / "experiments")
    assert list(tmp_path.iterdir()) == []
