"""Child processes for `multislice local`: spawn in their own process group, stream, stop.

Each child runs in a new session (so Ctrl-C on the terminal reaches only the launcher, which then
stops the children in order) and, on Linux, dies with its parent if the launcher is killed.
A reader thread per child puts `(slice_index, line)` tuples on a shared queue and
`(slice_index, None)` at end of output, so one loop in the launcher sees every line in order.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

Line = tuple[int, str | None]

_PR_SET_PDEATHSIG = 1


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def describe_exit(returncode: int) -> str:
    """'exit code 3' or 'killed by SIGKILL' for a Popen return code."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"killed by {name}"


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# Looked up here, in the parent: the child between fork and exec should not dlopen anything.
_PRCTL = _load_prctl()


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: ask the kernel to SIGKILL it if the launcher dies,
    # so a `kill -9` of the launcher cannot leave trainers holding ports and CPUs.
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)


class SliceProcess:
    """One emulated slice: a child process in its own process group, its output on `lines`."""

    def __init__(
        self,
        index: int,
        argv: Sequence[str],
        cwd: Path,
        env: Mapping[str, str],
        lines: queue.Queue[Line],
    ) -> None:
        self.index = index
        self.popen = subprocess.Popen(
            list(argv),
            cwd=cwd,
            # when it was launched: the trainer's process_start row carries it (multislice report)
            env={**env, "MULTISLICE_LAUNCHED_AT": f"{time.time():.6f}"},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        self.pid = self.popen.pid
        self.exited_at: float | None = None
        self.output_closed = threading.Event()
        self._reader = threading.Thread(
            target=self._read, args=(lines,), name=f"slice-{index}-reader", daemon=True
        )
        self._reader.start()

    def _read(self, lines: queue.Queue[Line]) -> None:
        stream = self.popen.stdout
        assert stream is not None
        try:
            for raw in iter(stream.readline, b""):
                lines.put((self.index, raw.decode("utf-8", errors="replace").rstrip("\r\n")))
        finally:
            stream.close()
            self.output_closed.set()
            lines.put((self.index, None))

    @property
    def returncode(self) -> int | None:
        code = self.popen.poll()
        if code is not None and self.exited_at is None:
            self.exited_at = time.monotonic()
        return code

    def done(self, output_wait_s: float = 2.0) -> bool:
        """Exited, and its output is drained (or a grandchild holds the pipe past output_wait_s)."""
        if self.returncode is None:
            return False
        assert self.exited_at is not None
        return self.output_closed.is_set() or time.monotonic() - self.exited_at > output_wait_s

    def signal_leader(self, sig: signal.Signals) -> None:
        """Send sig to the child itself, not to its own children."""
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(sig)

    def signal_group(self, sig: signal.Signals) -> None:
        """Send sig to the child's whole process group (it leads its own session)."""
        if self.returncode is not None and self.output_closed.is_set():
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)
