"""No process outlives the suite: an interrupted `make test` (Ctrl-C) leaves nothing running.

A terminal's Ctrl-C reaches pytest and its xdist workers (one process group), but not what the
tests started in sessions of their own: emulated TPU VMs and pods, servers, trainers. When a
session ends, each pytest process powers off the emulated hosts it booted (the boot harness's
own stop, which also removes their network namespaces) and stops every process still below it
in the process tree: SIGTERM, then SIGKILL after a grace. A worker always does (its fixtures have
been torn down, so what is left is a leak); the controller does only after an interrupt, when
its workers have been told to stop too.

It does not make pytest a child subreaper: an emulated host waits for its own background jobs
with `kill -0`, which a zombie re-parented to pytest (and never reaped there) would answer
forever, as no real VM's init lets happen.

Loaded by tests/conftest.py (pytest_configure) and, as `-p tests.support.reaper`, by the test
that checks it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

import pytest

GRACE_S = 3.0
ACTIVE = sys.platform.startswith("linux")  # the process tree comes from /proc


def _parents() -> dict[int, int]:
    """{pid: parent pid} of every living process this one can see (zombies are dead: a signal
    cannot reach them, and only their parent can collect them)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            state, parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            if state != "Z":
                out[int(entry.name)] = int(parent)
    return out


def descendants(root: int | None = None) -> list[int]:
    """Every living descendant of `root` (default: this process)."""
    root = os.getpid() if root is None else root
    parents = _parents()
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def stop_descendants(grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM to every descendant, SIGKILL to those still there after `grace_s`; returns the
    pids it signalled."""
    pids = descendants()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and descendants():
        _reap()
        time.sleep(0.05)
    for pid in descendants():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    _reap()
    return pids


def _reap() -> None:
    """Collect this process's exited children so they do not linger as zombies."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def _power_off_emulated_hosts() -> None:
    harness = sys.modules.get("scripts.emulators.boot_harness")
    if harness is not None:
        with contextlib.suppress(Exception):  # best effort: the tree walk below still runs
            harness.Host.stop_all()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not ACTIVE:
        return
    worker = hasattr(session.config, "workerinput")
    if worker or exitstatus == pytest.ExitCode.INTERRUPTED:
        _power_off_emulated_hosts()
        stop_descendants()
