"""Preemption notice (SIGTERM) -> finish the current step, save a checkpoint, exit with code 42.

Cloud TPU VMs get SIGTERM shortly before a maintenance event or a spot preemption. The handler
installed here only sets a flag; the train loop polls it at every step boundary, where the state
is consistent:

    guard = PreemptionGuard().install()
    for step in range(first, last + 1):
        state, metrics = train_step(state, batch)
        if guard.should_stop(step):
            ckpt.save(step, state, data_iterator, rng, force=True)
            ckpt.close()                       # wait for the async write to commit
            sys.exit(EXIT_PREEMPTED)           # 42: "preempted, checkpoint saved, restart me"
        ckpt.save(step, state, data_iterator, rng)

With several processes every one of them must stop at the same step, because saving is
collective, while the notice may reach only one VM. JAX's distributed runtime already solves this:
`jax.distributed.initialize()` starts a preemption sync manager (config
`jax_enable_preemption_service`, on by default) that catches SIGTERM in C++, tells every process
through the coordination service, and agrees on a step; each process learns it from
`jax.experimental.multihost_utils.reached_preemption_sync_point(step)`, which must be called at
every step on every process. So with more than one process `install()` leaves SIGTERM to JAX
(a Python handler would replace JAX's and the notice would stay local), and `should_stop(step)`
asks the sync point instead of the local flag. It must be the only caller: the protocol takes
each process's last asked step as its position, so the trainer's Checkpointer keeps Orbax from
asking it too (trainer/runtime/checkpoint.py), and the loop saves that step itself. With one
process the local flag is used.
Call `install()` after `jax.distributed.initialize()`, since it asks JAX for the process count.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any

EXIT_PREEMPTED = 42


class PreemptionGuard:
    """Turns a preemption notice into a flag that the train loop checks at step boundaries."""

    _WAIT_SLICE_S = 0.05

    def __init__(self) -> None:
        self._event = threading.Event()
        self._signum: int | None = None
        self._previous: dict[int, Any] = {}
        self._use_sync_point = False

    def install(self, signals: Sequence[int] = (signal.SIGTERM,)) -> PreemptionGuard:
        """Installs the flag-setting handler (main thread only); returns self."""
        if _process_count() > 1:
            self._use_sync_point = True
            return self
        for signum in signals:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def uninstall(self) -> None:
        """Puts back the handlers that were there before `install`."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._signum = signum
        self._event.set()

    @property
    def requested(self) -> bool:
        """True once a preemption signal reached this process."""
        return self._event.is_set()

    @property
    def signal_name(self) -> str | None:
        return signal.Signals(self._signum).name if self._signum is not None else None

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until a preemption signal arrives or `timeout` passes; returns `requested`.

        Waits in short slices: Python runs a signal handler only in the main thread, and a
        signal the kernel delivers to another thread (JAX, Grain and Orbax start many) does not
        interrupt a blocking wait there, so one long wait would sleep through the notice."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._event.wait(self._WAIT_SLICE_S):
            if deadline is not None and time.monotonic() >= deadline:
                break
        return self._event.is_set()

    def should_stop(self, step: int) -> bool:
        """Call once per step on every process, after the step: True means save and exit."""
        if self._use_sync_point:
            from jax.experimental import multihost_utils

            return bool(multihost_utils.reached_preemption_sync_point(step))
        return self._event.is_set()


def _process_count() -> int:
    import sys

    # Only ask JAX if the program already uses it; importing it here would be slow and pointless.
    if "jax" not in sys.modules:
        return 1
    import jax

    return jax.process_count()
