"""Supervise one emulated multislice run: S trainer processes, drills, restarts, watchdog.

`Supervisor(plan).run()` returns the launcher's exit code (see `scripts.local`). Everything the
launcher decides is also appended to `RUN_DIR/launcher.jsonl`, one JSON object per line with
`event` and `time` (unix seconds):

- `launch`: `attempt` (0 = first start), `coordinator`, `slices`, `devices_per_slice`, `pids`
- `kill`: a `--kill-at` drill fired: `slice`, `step` (the step it had reported), `at` ("STEP:SLICE")
- `failure`: `attempt`, `slice`, `returncode`, `exit` (words), `cause` (`kill-at`, `preempted`,
  `crashed`, `stalled`, `interrupted`), `last_step`
- `restart`: `attempt` (1..N), `reason`
- `end`: `status` (`succeeded`, `failed`, `stalled`, `interrupted`), `exit_code`, `restarts`,
  `duration_s`
"""

from __future__ import annotations

import collections
import contextlib
import json
import queue
import re
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from scripts.procs import Line, SliceProcess, describe_exit, free_loopback_port

STEP_LINE = re.compile(r"^MULTISLICE_STEP (\d+)\s*$")
PREEMPTED_EXIT_CODE = 42  # trainer: stopped by SIGTERM after saving a checkpoint

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_STALLED = 3
TAIL_LINES = 200  # kept per slice; enough to see past a native stack trace
SHOWN_LINES = 12
NATIVE_FRAME = re.compile(r"^\s*@\s+0x[0-9a-fA-F]+\s|^\*\*\* Check failure stack trace")
POLL_S = 0.1


@dataclass(frozen=True)
class KillAt:
    """A preemption drill: SIGKILL slice `slice` once it reports global step >= `step`."""

    step: int
    slice: int

    def __str__(self) -> str:
        return f"{self.step}:{self.slice}"


@dataclass(frozen=True)
class LaunchPlan:
    experiment_dir: Path
    run_dir: Path
    slices: int
    devices_per_slice: int
    trainer_args: tuple[str, ...]
    kill_at: tuple[KillAt, ...] = ()
    max_restarts: int = 0
    init_timeout_s: float = 120.0
    stall_timeout_s: float = 600.0
    stop_grace_s: float = 10.0
    python: str = sys.executable
    base_env: dict[str, str] = field(default_factory=dict)


@dataclass
class Failure:
    slice: int | None  # None: no single slice failed (stall, interrupt)
    returncode: int | None
    cause: str
    detail: str
    last_step: int | None = None


def slice_env(base: dict[str, str], plan: LaunchPlan, index: int, coordinator: str) -> dict[str, str]:
    """The environment of slice `index`: CPU devices, its distributed identity, the rest inherited."""
    env = dict(base)
    kept = [
        flag
        for flag in env.get("XLA_FLAGS", "").split()
        if not flag.startswith("--xla_force_host_platform_device_count")
    ]
    kept.append(f"--xla_force_host_platform_device_count={plan.devices_per_slice}")
    env.update(
        {
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": " ".join(kept),
            "MULTISLICE_COORDINATOR": coordinator,
            "MULTISLICE_NUM_PROCESSES": str(plan.slices),
            "MULTISLICE_PROCESS_ID": str(index),
            "MULTISLICE_INIT_TIMEOUT_S": f"{plan.init_timeout_s:g}",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def meaningful_tail(tail: list[str], count: int = SHOWN_LINES) -> list[str]:
    """The last `count` lines that are not native stack frames (whose addresses explain nothing)."""
    return [line for line in tail if not NATIVE_FRAME.match(line)][-count:]


def _looks_like_init_timeout(tail: list[str]) -> bool:
    text = "\n".join(tail)
    return "DEADLINE_EXCEEDED" in text and (
        "RegisterTask" in text or "coordinat" in text.lower() or "distributed" in text.lower()
    )


class Supervisor:
    """Runs the plan's attempts until success, a terminal failure, or the restart budget is spent."""

    def __init__(self, plan: LaunchPlan) -> None:
        self.plan = plan
        self.fired: set[KillAt] = set()
        self.interrupts: list[int] = []
        self.restarts = 0
        self.outcome = "not started"
        self.logs_dir = plan.run_dir / "logs"
        self.events_path = plan.run_dir / "launcher.jsonl"

    # ---- output -------------------------------------------------------------------------------

    def say(self, message: str) -> None:
        print(f"[multislice] {message}", file=sys.stderr, flush=True)

    def event(self, name: str, **fields: Any) -> None:
        row = {"event": name, "time": time.time(), **fields}
        with self.events_path.open("a", encoding="utf-8") as out:
            out.write(json.dumps(row, sort_keys=True) + "\n")

    # ---- signals ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _signals_recorded(self) -> Iterator[None]:
        def record(signum: int, _frame: object) -> None:
            self.interrupts.append(signum)

        previous = {sig: signal.signal(sig, record) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    # ---- the run ------------------------------------------------------------------------------

    def run(self) -> int:
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with self._signals_recorded():
            attempt = 0
            while True:
                failure = self._run_attempt(attempt)
                if failure is None:
                    status, code = "succeeded", EXIT_OK
                    self.outcome = f"all {self.plan.slices} slices exited 0"
                    break
                self.outcome = (
                    f"slice {failure.slice} {failure.detail}" if failure.slice is not None
                    else failure.detail
                )
                if failure.cause == "interrupted":
                    signum = self.interrupts[0]
                    status, code = "interrupted", 128 + signum
                    self.say(f"stopped all slices after {signal.Signals(signum).name}")
                    break
                if failure.cause == "stalled":
                    status, code = "stalled", EXIT_STALLED
                    break
                if self.restarts >= self.plan.max_restarts:
                    status, code = "failed", EXIT_FAILED
                    if self.plan.max_restarts:
                        self.say(f"giving up: restart budget spent (--max-restarts {self.plan.max_restarts})")
                    break
                self.restarts += 1
                attempt += 1
                reason = f"slice {failure.slice} {failure.detail}"
                self.event("restart", attempt=attempt, reason=reason)
                self.say(
                    f"restarting all {self.plan.slices} slices (restart {self.restarts} of "
                    f"{self.plan.max_restarts}) because {reason}"
                )
        self.event(
            "end",
            status=status,
            exit_code=code,
            restarts=self.restarts,
            duration_s=round(time.monotonic() - started, 3),
        )
        return code

    def _run_attempt(self, attempt: int) -> Failure | None:
        plan = self.plan
        coordinator = f"127.0.0.1:{free_loopback_port()}"
        lines: queue.Queue[Line] = queue.Queue()
        argv = [plan.python, "-m", "trainer.main", *plan.trainer_args]
        log_files = [self._open_log(i, attempt, coordinator) for i in range(plan.slices)]
        tails = [collections.deque[str](maxlen=TAIL_LINES) for _ in range(plan.slices)]
        steps: list[int | None] = [None] * plan.slices
        procs: list[SliceProcess] = []
        try:
            for i in range(plan.slices):
                env = slice_env(plan.base_env, plan, i, coordinator)
                procs.append(SliceProcess(i, argv, plan.experiment_dir, env, lines))
            self.event(
                "launch",
                attempt=attempt,
                coordinator=coordinator,
                slices=plan.slices,
                devices_per_slice=plan.devices_per_slice,
                pids=[p.pid for p in procs],
            )
            self.say(
                f"attempt {attempt}: started {plan.slices} slices x {plan.devices_per_slice} CPU "
                f"devices, coordinator {coordinator}, pids {' '.join(str(p.pid) for p in procs)}"
            )
            return self._supervise(attempt, coordinator, procs, lines, log_files, tails, steps)
        finally:
            for p in procs:  # never leave a child behind, whatever went wrong above
                if p.returncode is None:
                    p.signal_group(signal.SIGKILL)
                    p.popen.wait()
            for f in log_files:
                f.close()

    def _open_log(self, index: int, attempt: int, coordinator: str) -> TextIO:
        log = (self.logs_dir / f"slice-{index}.log").open("a", encoding="utf-8", buffering=1)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        log.write(f"===== multislice local: attempt {attempt} at {stamp}, coordinator {coordinator} =====\n")
        return log

    def _supervise(
        self,
        attempt: int,
        coordinator: str,
        procs: list[SliceProcess],
        lines: queue.Queue[Line],
        log_files: list[TextIO],
        tails: list[collections.deque[str]],
        steps: list[int | None],
    ) -> Failure | None:
        plan = self.plan
        failure: Failure | None = None
        killed_by_drill: set[int] = set()
        stop_started: float | None = None
        escalated = False
        last_activity = time.monotonic()

        def begin_stop(reason_failure: Failure) -> None:
            nonlocal failure, stop_started
            failure = reason_failure
            stop_started = time.monotonic()
            for p in procs:
                if p.returncode is None:
                    p.signal_group(signal.SIGTERM)

        while True:
            try:
                index, line = lines.get(timeout=POLL_S)
            except queue.Empty:
                pass
            else:
                while True:
                    if line is not None:
                        last_activity = time.monotonic()
                        step = self._handle_line(index, line, log_files, tails)
                        if step is not None:
                            steps[index] = step
                            self._fire_drills(index, step, procs[index], killed_by_drill)
                    try:
                        index, line = lines.get_nowait()
                    except queue.Empty:
                        break

            now = time.monotonic()
            if failure is None and self.interrupts:
                name = signal.Signals(self.interrupts[0]).name
                begin_stop(Failure(None, None, "interrupted", f"interrupted by {name}"))
            if failure is None:
                crashed = self._first_failure(procs, killed_by_drill, steps)
                if crashed is not None:
                    self.event(
                        "failure",
                        attempt=attempt,
                        slice=crashed.slice,
                        returncode=crashed.returncode,
                        exit=describe_exit(crashed.returncode or 0),
                        cause=crashed.cause,
                        last_step=crashed.last_step,
                    )
                    self._report_failure(crashed, coordinator, tails)
                    begin_stop(crashed)
            if failure is None and now - last_activity > plan.stall_timeout_s:
                stalled = Failure(
                    None, None, "stalled",
                    f"stalled: no output from any slice for {plan.stall_timeout_s:g}s",
                )
                self.event("failure", attempt=attempt, slice=None, returncode=None, exit=None,
                           cause="stalled", last_step=max((s or 0) for s in steps))
                self._report_stall(steps, tails)
                begin_stop(stalled)
            if stop_started is not None and not escalated and (
                now - stop_started > plan.stop_grace_s or len(self.interrupts) > 1
            ):
                escalated = True
                for p in procs:
                    if p.returncode is None:
                        self.say(f"slice {p.index} did not stop within {plan.stop_grace_s:g}s of SIGTERM; sending SIGKILL")
                        p.signal_group(signal.SIGKILL)
            if all(p.done() for p in procs):
                break
        # Lines still queued (e.g. a grandchild wrote after the exit) go to the logs, not lost.
        while True:
            try:
                index, line = lines.get_nowait()
            except queue.Empty:
                break
            if line is not None:
                self._handle_line(index, line, log_files, tails)
        if failure is None:
            bad = [p for p in procs if p.returncode != 0]
            if bad:  # exited non-zero after all reported done in the same poll
                p = bad[0]
                failure = self._classify(p, killed_by_drill, steps)
        return failure

    def _handle_line(
        self,
        index: int,
        line: str,
        log_files: list[TextIO],
        tails: list[collections.deque[str]],
    ) -> int | None:
        match = STEP_LINE.match(line)
        if match:
            return int(match.group(1))
        print(f"[slice {index}] {line}", flush=True)
        log_files[index].write(line + "\n")
        tails[index].append(line)
        return None

    def _fire_drills(
        self, index: int, step: int, proc: SliceProcess, killed_by_drill: set[int]
    ) -> None:
        for drill in self.plan.kill_at:
            if drill.slice != index or step < drill.step or drill in self.fired:
                continue
            self.fired.add(drill)
            if proc.returncode is not None:
                continue
            proc.signal_group(signal.SIGKILL)
            killed_by_drill.add(index)
            self.event("kill", slice=index, step=step, at=str(drill), pid=proc.pid)
            self.say(f"--kill-at {drill}: sent SIGKILL to slice {index} (pid {proc.pid}) at step {step}")

    def _classify(
        self, proc: SliceProcess, killed_by_drill: set[int], steps: list[int | None]
    ) -> Failure:
        code = proc.returncode
        assert code is not None
        words = describe_exit(code)
        if proc.index in killed_by_drill:
            cause, detail = "kill-at", f"was killed by the --kill-at drill ({words})"
        elif code == PREEMPTED_EXIT_CODE:
            cause, detail = "preempted", f"was preempted ({words}: stopped after saving a checkpoint)"
        else:
            cause, detail = "crashed", f"failed ({words})"
        return Failure(proc.index, code, cause, detail, steps[proc.index])

    def _first_failure(
        self, procs: list[SliceProcess], killed_by_drill: set[int], steps: list[int | None]
    ) -> Failure | None:
        failed = [p for p in procs if p.done() and p.returncode != 0]
        if not failed:
            return None
        # A drill's victim explains the others' crashes; otherwise the earliest exit is the cause.
        failed.sort(key=lambda p: (p.index not in killed_by_drill, p.exited_at or 0.0, p.index))
        return self._classify(failed[0], killed_by_drill, steps)

    def _report_failure(
        self, failure: Failure, coordinator: str, tails: list[collections.deque[str]]
    ) -> None:
        assert failure.slice is not None
        index = failure.slice
        others = "; stopping the other slices" if self.plan.slices > 1 else ""
        step = "before its first step" if failure.last_step is None else f"after step {failure.last_step}"
        self.say(f"slice {index} {failure.detail} {step}{others}")
        if failure.cause != "kill-at":
            tail = list(tails[index])
            self.say(f"last lines of slice {index} (full log: {self.logs_dir / f'slice-{index}.log'}):")
            for line in meaningful_tail(tail) or ["(no output)"]:
                print(f"    {line}", file=sys.stderr, flush=True)
            if _looks_like_init_timeout(tail):
                self.say(
                    f"slice {index} timed out in jax.distributed start-up: the coordinator "
                    f"{coordinator} (slice 0) or another slice did not come up within "
                    f"MULTISLICE_INIT_TIMEOUT_S={self.plan.init_timeout_s:g}s (--init-timeout); "
                    "check the other slices' logs for an earlier error"
                )

    def _report_stall(self, steps: list[int | None], tails: list[collections.deque[str]]) -> None:
        progress = ", ".join(
            f"slice {i}: {'no step yet' if s is None else f'step {s}'}" for i, s in enumerate(steps)
        )
        self.say(
            f"no slice printed anything for {self.plan.stall_timeout_s:g}s (--stall-timeout); "
            f"stopping all slices. Progress: {progress}"
        )
        for i, tail in enumerate(tails):
            last = tail[-1] if tail else "(no output)"
            self.say(f"last line of slice {i}: {last}")
