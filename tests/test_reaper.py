"""An interrupted suite leaves no process behind (tests/support/reaper.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

ORPHANING_TEST = '''
import subprocess, time
from pathlib import Path

def test_starts_a_server_and_waits():
    # A session of its own, as the boot harness gives an emulated host or a fixture a server:
    # a terminal's Ctrl-C does not reach it.
    server = subprocess.Popen(["sleep", "600"], start_new_session=True)
    Path("orphan.pid").write_text(str(server.pid))
    Path("started").touch()
    time.sleep(600)
'''


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.parametrize("workers", ["0", "1"], ids=["in-process", "xdist-worker"])
def test_ctrl_c_on_the_suite_stops_what_its_tests_started_in_their_own_sessions(tmp_path, workers):
    if not sys.platform.startswith("linux"):
        pytest.skip("the reaper is Linux's child subreaper")
    (tmp_path / "test_orphan.py").write_text(ORPHANING_TEST)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # Ctrl-C as a terminal's shell gives it: SIGINT handled, whatever this process inherited (an
    # xdist worker's children start with SIGINT ignored). Output to a file: the server holds
    # a pipe open until it is stopped.
    start = ("import signal, sys, pytest; signal.signal(signal.SIGINT, "
             "signal.default_int_handler); sys.exit(pytest.main(sys.argv[1:]))")
    log = tmp_path / "suite.log"
    with log.open("w") as out_file:
        suite = subprocess.Popen(
            [sys.executable, "-c", start, "-q", "-p", "no:cacheprovider", "-p",
             "tests.support.reaper", "-n", workers, "--timeout=0", "-o", "addopts=", "."],
            cwd=tmp_path, env=env, stdout=out_file, stderr=subprocess.STDOUT,
            start_new_session=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "started").exists():
        assert suite.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    orphan = int((tmp_path / "orphan.pid").read_text())
    assert _alive(orphan)
    os.killpg(suite.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends: the whole group
    suite.wait(timeout=60)
    out = log.read_text()
    try:
        assert not _alive(orphan), out
    finally:
        if _alive(orphan):
            os.kill(orphan, signal.SIGKILL)
