"""No process outlives the suite: an interrupted `make test` (Ctrl-C) leaves nothing running.

Every pytest process of the suite (the controller and each xdist worker) becomes a child
subreaper (Linux prctl PR_SET_CHILD_SUBREAPER): a descendant whose parent exits, such as an
emulated TPU VM's processes or a server a killed fixture started, is re-parented to it instead of
to init, so it can still be found. When the session ends, each pytest process stops every
descendant it still has: SIGTERM, then SIGKILL after a grace. A worker always does (its fixtures
have been torn down, so what is left is a leak); the controller does only after an interrupt,
when its workers have been told to stop too. Elsewhere than Linux it does nothing.

Loaded by tests/conftest.py (`pytest_plugins`) and, as `-p tests.support.reaper`, by the test
that checks it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from pathlib import Path

import pytest

PR_SET_CHILD_SUBREAPER = 36
GRACE_S = 3.0


def _become_subreaper() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


ACTIVE = _become_subreaper()


def _parents() -> dict[int, int]:
    """{pid: parent pid} of every process this one can see."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (entry / "stat").read_text()
            out[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return out


def descendants(root: int | None = None) -> list[int]:
    """Every living descendant of `root` (default: this process), deepest last."""
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
    """Collect exited children (re-parented ones included) so they do not linger as zombies."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not ACTIVE:
        return
    worker = hasattr(session.config, "workerinput")
    if worker or exitstatus == pytest.ExitCode.INTERRUPTED:
        stop_descendants()
