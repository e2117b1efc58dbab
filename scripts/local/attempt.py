"""One start of an emulated multislice job: S slice processes watched until they all end.

An `Attempt` streams every slice's output (prefixed, and into RUN_DIR/logs/slice-i.log), consumes
`MULTISLICE_STEP n` lines to fire `--kill-at` drills, and ends the attempt on the first failure,
a stall (no output from any slice for --stall-timeout seconds) or an interrupt: it then stops every
slice (SIGTERM to its process group, SIGKILL after the grace period). It returns the `Failure`
that ended it, or None when every slice exited 0. Restarting is the supervisor's business.
"""

from __future__ import annotations

import collections
import json
import queue
import re
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from scripts.local.procs import Line, SliceProcess, describe_exit, free_loopback_port

STEP_LINE = re.compile(r"^MULTISLICE_STEP (\d+)\s*$")
# An elastic trainer's floor (trainer/runtime/elastic.py), printed once it has read its config.
ELASTIC_LINE = re.compile(r"^MULTISLICE_ELASTIC min_slices=(\d+) full_slices=(\d+) slices=(\d+)\s*$")
# jaxlib's bundled gloo writes this to stdout with std::cout whenever it connects a communicator
# (several times per run) and has no log-level switch. Only the all-connected form is dropped from
# the console and the failure tail; it still goes to the slice's log file. A partial connection
# ("connected to 1 ... is : 3") and the "is NOT connected to" line stay visible.
GLOO_CONNECTED = re.compile(
    r"^\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. "
    r"Expected number of connected peer ranks is : (\d+)\s*$"
)
# The notice is written piece by piece, and a process's devices connect from several threads at
# once, so a line can hold pieces of several notices ("... is : [Gloo] Rank 3 is connected to 33").
# Such a line is made of nothing but those pieces and digits.
GLOO_PIECES = re.compile(
    r"^(?:\[Gloo\] Rank | is connected to | peer ranks\. "
    r"|Expected number of connected peer ranks is : |\d)+\s*$"
)
NATIVE_FRAME = re.compile(r"^\s*@\s+0x[0-9a-fA-F]+\s|^\*\*\* Check failure stack trace")
PREEMPTED_EXIT_CODE = 42  # trainer: stopped by SIGTERM after saving a checkpoint
CONFIG_EXIT_CODE = 2  # trainer: bad config, topology or data, found before compiling
DIVERGED_EXIT_CODE = 3  # trainer: a non-finite loss or gradient; nothing of it was saved
TAIL_LINES = 200  # kept per slice; enough to see past a native stack trace
SHOWN_LINES = 12
POLL_S = 0.1
GROW_SAVE_S = 30.0  # a grow-back's save at the step boundary: the trainer's own term grace


@dataclass(frozen=True)
class Drill:
    """Once slice `slice` reports global step >= `step`: SIGKILL its process group (a crash or a
    hardware failure), or with `preempt` SIGTERM its trainer (a maintenance or spot notice, which
    the trainer answers by saving a checkpoint and exiting 42). `wipe`: the slice comes back as a
    recreated VM does, its own storage empty (its local checkpoint directory is deleted once it
    is gone). `step` 0: while an elastic job re-forms on fewer slices (once the slice's trainer
    has started, before its first step), written `reform:SLICE`."""

    step: int
    slice: int
    preempt: bool = False
    wipe: bool = False

    @property
    def flag(self) -> str:
        return "--preempt-at" if self.preempt else "--kill-at"

    def __str__(self) -> str:
        return (f"{self.step or 'reform'}:{self.slice}") + (":wipe" if self.wipe else "")


LOCAL_CHECKPOINT_ENV = "MULTISLICE_LOCAL_CHECKPOINT_DIR"


def local_checkpoint_dir(log_dir: Path, index: int) -> Path:
    """Slice `index`'s own storage for the trainer's local checkpoint tier (its VM's disk)."""
    return log_dir / "local" / f"slice-{index}"




@dataclass(frozen=True)
class LaunchPlan:
    experiment_dir: Path
    log_dir: Path  # logs/ and launcher.jsonl (the run dir itself when that is local)
    slices: int
    devices_per_slice: int
    trainer_args: tuple[str, ...]
    drills: tuple[Drill, ...] = ()
    max_restarts: int = 0
    init_timeout_s: int = 120  # the trainer reads whole seconds
    stall_timeout_s: float = 600.0
    stop_grace_s: float = 10.0
    slice_down_s: float = 0.0  # a slice that went away is back this long after (its repair)
    python: str = sys.executable
    base_env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Failure:
    """What ended an attempt. `slice` is None when no single slice failed (stall, interrupt,
    grow: the launcher stopped a job on fewer slices to start it again on more)."""

    cause: str  # kill-at | preempted | misconfigured | diverged | crashed | stalled | interrupted
    #             | grow
    detail: str
    slice: int | None = None
    returncode: int | None = None
    last_step: int | None = None

    def describe(self) -> str:
        return self.detail if self.slice is None else f"slice {self.slice} {self.detail}"


class Reporter:
    """The launcher's voice: `[multislice]` lines on stderr and rows in RUN_DIR/launcher.jsonl."""

    def __init__(self, events_path: Path) -> None:
        self.events_path = events_path

    def say(self, message: str) -> None:
        print(f"[multislice] {message}", file=sys.stderr, flush=True)

    def event(self, name: str, **fields: Any) -> None:
        row = {"event": name, "time": time.time(), **fields}
        with self.events_path.open("a", encoding="utf-8") as out:
            out.write(json.dumps(row, sort_keys=True) + "\n")


# What a trainer prints when SIGTERM reaches it: JAX's preemption notifier (a C++ warning), the
# trainer's own notice, and its exit line. When the launcher sent the SIGTERM (Ctrl-C, a stall,
# a failed peer), they read as a preemption that did not happen; the console gets one line saying
# what did (RUN_DIR/logs keeps the trainer's own lines).
_NOTIFIER_LINE = re.compile(r"preemption_notifier\.cc:\d+\] SIGTERM caught")
_NOTICE_LINE = re.compile(r"^preemption notice: saved step (\d+); exiting with code 42")
_EXIT_42_LINE = re.compile(r"^preempted: checkpoint of step \d+ saved; exit code 42$")


def _as_stopped_by_launcher(line: str, why: str) -> str | None:
    """The console's version of a trainer line once the launcher stopped the slices (None: not
    shown)."""
    if _NOTIFIER_LINE.search(line) or _EXIT_42_LINE.match(line):
        return None
    notice = _NOTICE_LINE.match(line)
    if notice:
        return (f"stopped by the launcher ({why}): step {notice.group(1)} saved; the same "
                "command resumes from it")
    return line


def slice_env(plan: LaunchPlan, index: int, coordinator: str,
              live: tuple[int, ...] | None = None) -> dict[str, str]:
    """The environment of slice `index`: CPU devices, its distributed identity, the rest inherited.
    `live`: the slices of this attempt (all by default); a slice's process id is its place
    among them, and its local storage stays its own whatever that place is."""
    live = tuple(range(plan.slices)) if live is None else live
    env = dict(plan.base_env)
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
            "MULTISLICE_STEP_MARKERS": "1",  # the trainer prints MULTISLICE_STEP lines for us
            "MULTISLICE_NUM_PROCESSES": str(len(live)),
            "MULTISLICE_PROCESS_ID": str(live.index(index)),
            "MULTISLICE_FULL_SLICES": str(plan.slices),
            "MULTISLICE_INIT_TIMEOUT_S": str(int(plan.init_timeout_s)),
            LOCAL_CHECKPOINT_ENV: str(local_checkpoint_dir(plan.log_dir, index)),
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def expecting(trainer_args: tuple[str, ...], slices: int) -> tuple[str, ...]:
    """The trainer's arguments with --expect-slices set to the slices of this attempt."""
    args = list(trainer_args)
    if "--expect-slices" in args[:-1]:
        args[args.index("--expect-slices") + 1] = str(slices)
    return tuple(args)


def is_gloo_chatter(line: str) -> bool:
    """True for gloo's "every peer connected" notice, which says nothing worth showing."""
    match = GLOO_CONNECTED.match(line)
    if match:
        return match.group(1) == match.group(2)
    return bool(GLOO_PIECES.match(line)) and not line.strip().isdigit()


def meaningful_tail(tail: list[str], count: int = SHOWN_LINES) -> list[str]:
    """The last `count` lines that are not native stack frames (whose addresses explain nothing)."""
    return [line for line in tail if not NATIVE_FRAME.match(line)][-count:]


def looks_like_init_timeout(tail: list[str]) -> bool:
    text = "\n".join(tail)
    return "DEADLINE_EXCEEDED" in text and (
        "RegisterTask" in text or "coordinat" in text.lower() or "distributed" in text.lower()
    )


class Attempt:
    """Start the plan's slices once and watch them; `run()` returns what ended it, or None."""

    def __init__(
        self,
        plan: LaunchPlan,
        number: int,
        reporter: Reporter,
        fired: set[Drill],
        interrupts: list[int],
        live: tuple[int, ...] | None = None,
        grow_when: Callable[[], str | None] = lambda: None,
        learned: dict[str, int] | None = None,
    ) -> None:
        self.plan = plan
        self.live = tuple(range(plan.slices)) if live is None else live
        # Asked while the job runs on fewer slices: a reason to stop it at the next step
        # boundary (SIGTERM: the trainers save) and start it again on more.
        self.grow_when = grow_when
        self.learned = {} if learned is None else learned  # what the trainers said of the job
        self.number = number
        self.reporter = reporter
        self.fired = fired  # shared across attempts: each drill fires once per invocation
        self.interrupts = interrupts  # appended to by the supervisor's signal handler
        self.coordinator = f"127.0.0.1:{free_loopback_port()}"
        self.logs_dir = plan.log_dir / "logs"
        self.lines: queue.Queue[Line] = queue.Queue()
        self.procs: list[SliceProcess] = []
        self.log_files: dict[int, TextIO] = {}
        self.tails = [collections.deque[str](maxlen=TAIL_LINES) for _ in range(plan.slices)]
        # Lines of the other slices once one failed (a survivor's collective errors, tracebacks
        # of the peer it lost): kept in their logs, one line each on the console at the end.
        self.held_back = [0] * plan.slices
        self.steps: list[int | None] = [None] * plan.slices
        self.killed_by_drill: set[int] = set()
        self.preempted_by_drill: set[int] = set()
        self.failure: Failure | None = None
        self.stop_started: float | None = None
        self.escalated = False
        self.last_activity = time.monotonic()
        self.grace_s = plan.stop_grace_s
        self.first_step_at: float | None = None  # time.time() of the first step any slice made

    def run(self) -> Failure | None:
        try:
            self._start()
            while not all(p.done() for p in self.procs):
                self._drain(timeout_s=POLL_S)
                self._check()
            self._drain(timeout_s=0)  # lines written just before the exits go to the logs too
            for index, count in enumerate(self.held_back):
                if count:
                    gone = self.failure.slice if self.failure else sorted(self.killed_by_drill)
                    self.reporter.say(
                        f"slice {index} stopped with the attempt ({count} more line(s) after "
                        f"slice {gone} was lost: {self.logs_dir / f'slice-{index}.log'})")
            if self.failure is None:  # exited non-zero between the last check and the loop test
                self._check()
            elif self.failure.cause == "grow" and all(p.returncode == 0 for p in self.procs):
                self.failure = None  # the notice came at the last step: the job is done
            elif self.failure.cause == "crashed":
                # A peer that crashed first for want of a slice that then exited 2 or 3 (still in
                # JAX's shutdown barrier when its peer gave up): the deterministic failure is the
                # cause, and it is not restarted.
                deterministic = self._first_failed_slice()
                if deterministic is not None and deterministic.cause in ("misconfigured",
                                                                         "diverged"):
                    self.failure = deterministic
                    self._record(deterministic)
                    self._report_failure(deterministic)
            return self.failure
        finally:
            for p in self.procs:  # never leave a child behind, whatever went wrong above
                if p.returncode is None:
                    p.signal_group(signal.SIGKILL)
                    p.popen.wait()
            for f in self.log_files.values():
                f.close()

    # ---- start --------------------------------------------------------------------------------

    def _start(self) -> None:
        plan = self.plan
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        for i in self.live:
            log = (self.logs_dir / f"slice-{i}.log").open("a", encoding="utf-8", buffering=1)
            log.write(f"===== multislice local: attempt {self.number} at {stamp}, "
                      f"coordinator {self.coordinator} =====\n")
            self.log_files[i] = log
        argv = [plan.python, "-m", "trainer.main", *expecting(plan.trainer_args, len(self.live))]
        for i in self.live:
            env = slice_env(plan, i, self.coordinator, self.live)
            self.procs.append(SliceProcess(i, argv, plan.experiment_dir, env, self.lines))
        self.by_slice = {p.index: p for p in self.procs}
        pids = [p.pid for p in self.procs]
        partial = len(self.live) < plan.slices
        self.reporter.event("launch", attempt=self.number, coordinator=self.coordinator,
                            slices=len(self.live), devices_per_slice=plan.devices_per_slice,
                            pids=pids, **({"live": list(self.live)} if partial else {}))
        which = (f"{len(self.live)} of {plan.slices} slices ({' '.join(map(str, self.live))})"
                 if partial else f"{plan.slices} slices")
        self.reporter.say(
            f"attempt {self.number}: started {which} x {plan.devices_per_slice} CPU "
            f"devices, coordinator {self.coordinator}, pids {' '.join(map(str, pids))}"
        )

    # ---- output -------------------------------------------------------------------------------

    def _drain(self, timeout_s: float) -> None:
        """Handle every queued line, waiting up to timeout_s for the first one."""
        try:
            item = self.lines.get(timeout=timeout_s) if timeout_s > 0 else self.lines.get_nowait()
        except queue.Empty:
            return
        while True:
            index, line = item
            if line is not None:
                self.last_activity = time.monotonic()
                self._handle_line(index, line)
            try:
                item = self.lines.get_nowait()
            except queue.Empty:
                return

    def _handle_line(self, index: int, line: str) -> None:
        match = STEP_LINE.match(line)
        if match:
            step = int(match.group(1))
            self.steps[index] = step
            if self.first_step_at is None:
                self.first_step_at = time.time()
            self._fire_drills(index, step)
            return
        elastic = ELASTIC_LINE.match(line)
        if elastic:
            self.learned["min_slices"] = int(elastic.group(1))
            if len(self.live) < self.plan.slices:
                self._fire_drills(index, 0)  # `reform:SLICE` drills
            return
        self.log_files[index].write(line + "\n")
        if is_gloo_chatter(line):
            return
        self.tails[index].append(line)
        if self._stopped_by_launcher():
            line = _as_stopped_by_launcher(line, self.failure.describe())
            if line is None:
                return
        peer_gone = (bool(self.killed_by_drill) and index not in self.killed_by_drill) or (
            self.failure is not None and self.failure.cause in ("kill-at", "crashed")
            and index != self.failure.slice)
        if peer_gone:  # from the SIGKILL of a drill on, before its exit is even noticed
            self.held_back[index] += 1
            return
        print(f"[slice {index}] {line}", flush=True)

    def _stopped_by_launcher(self) -> bool:
        """The launcher sent the slices SIGTERM itself (Ctrl-C, a stall, another slice's
        failure), not a --preempt-at drill: what they print as a preemption is not one."""
        return (self.stop_started is not None and self.failure is not None
                and self.failure.cause not in ("preempted", "grow"))

    def _fire_drills(self, index: int, step: int) -> None:
        proc = self.by_slice[index]
        for drill in self.plan.drills:
            if drill.slice != index or step < drill.step or drill in self.fired:
                continue
            if (drill.step == 0) != (step == 0):  # a re-formation drill, at a re-formation only
                continue
            self.fired.add(drill)
            if proc.returncode is not None:
                continue
            if drill.preempt:
                # To the trainer alone: JAX's preemption notifier in it tells the other slices.
                proc.signal_leader(signal.SIGTERM)
                self.preempted_by_drill.add(index)
            else:
                proc.signal_group(signal.SIGKILL)
                self.killed_by_drill.add(index)
            if drill.wipe:
                proc.popen.wait()
                shutil.rmtree(local_checkpoint_dir(self.plan.log_dir, index), ignore_errors=True)
            sig = "SIGTERM" if drill.preempt else "SIGKILL"
            self.reporter.event("preempt" if drill.preempt else "kill", slice=index, step=step,
                                at=str(drill), pid=proc.pid, wiped=drill.wipe)
            self.reporter.say(
                f"{drill.flag} {drill}: sent {sig} to slice {index} (pid {proc.pid}) at step {step}"
                + (f"; its local storage {local_checkpoint_dir(self.plan.log_dir, index)} wiped, "
                   "as a recreated VM's" if drill.wipe else ""))

    # ---- decisions ----------------------------------------------------------------------------

    def _check(self) -> None:
        now = time.monotonic()
        if self.failure is None and self.interrupts:
            name = signal.Signals(self.interrupts[0]).name
            interrupted = Failure("interrupted", f"interrupted by {name}")
            self._record(interrupted)
            self._stop_all(interrupted)
        if self.failure is None:
            failed = self._first_failed_slice()
            if failed is not None:
                self._record(failed)
                self._report_failure(failed)
                self._stop_all(failed)
                if failed.cause == "kill-at" or (failed.returncode or 0) < 0:
                    # The others cannot save without it (every save is a collective over all
                    # slices): waiting --stop-grace for them would only delay the restart.
                    self._kill_remaining(f"its peer slice {failed.slice} is gone, so it cannot "
                                         "save a checkpoint")
        if self.failure is None and len(self.live) < self.plan.slices and all(
                self.steps[i] is not None for i in self.live):
            reason = self.grow_when()  # asked only once every slice has stepped: none is saving
            if reason is not None:
                grow = Failure("grow", reason)
                self.failure = grow
                self.stop_started = now
                self.grace_s = max(self.grace_s, GROW_SAVE_S)
                self.reporter.say(f"{reason}: stopping the {len(self.live)} slices at the next "
                                  "step boundary (they save) to start again on more")
                for p in self.procs:
                    if p.returncode is None:
                        p.signal_leader(signal.SIGTERM)
        if self.failure is None and now - self.last_activity > self.plan.stall_timeout_s:
            stalled = Failure("stalled", f"stalled: no output from any slice for "
                                         f"{self.plan.stall_timeout_s:g}s")
            self._record(stalled)
            self._report_stall()
            self._stop_all(stalled)
        if self.stop_started is not None and not self.escalated:
            if len(self.interrupts) > 1:
                self._kill_remaining("a second interrupt")
            elif now - self.stop_started > self.grace_s:
                self._kill_remaining(f"still running {self.grace_s:g}s after SIGTERM"
                                     + (" (--stop-grace)" if self.grace_s == self.plan.stop_grace_s
                                        else " (its save for the grow-back)"))

    def _stop_all(self, failure: Failure) -> None:
        self.failure = failure
        self.stop_started = time.monotonic()
        for p in self.procs:
            if p.returncode is None:
                p.signal_group(signal.SIGTERM)

    def _kill_remaining(self, why: str) -> None:
        self.escalated = True
        for p in self.procs:
            if p.returncode is None:
                self.reporter.say(f"slice {p.index}: {why}; sending SIGKILL")
                p.signal_group(signal.SIGKILL)

    def _first_failed_slice(self) -> Failure | None:
        failed = [p for p in self.procs if p.done() and p.returncode != 0]
        if not failed:
            return None
        # A drill's victim explains the others' crashes; then a deterministic failure (a rejected
        # config, a divergence) does, whenever it was noticed: its peers crash for want of it
        # (one poll may find them all gone), and a restart would fail the same way again.
        # Otherwise the earliest exit is the cause.
        victims = self.killed_by_drill | self.preempted_by_drill
        failed.sort(key=lambda p: (p.index not in victims,
                                   p.returncode not in (CONFIG_EXIT_CODE, DIVERGED_EXIT_CODE),
                                   p.exited_at or 0.0, p.index))
        proc = failed[0]
        code = proc.returncode
        assert code is not None
        words = describe_exit(code)
        if proc.index in self.killed_by_drill:
            cause, detail = "kill-at", f"was killed by the --kill-at drill ({words})"
        elif code == PREEMPTED_EXIT_CODE:
            notice = " after the --preempt-at notice" if proc.index in self.preempted_by_drill else ""
            cause = "preempted"
            detail = f"was preempted{notice} ({words}: stopped after saving a checkpoint)"
        elif code == CONFIG_EXIT_CODE:
            cause, detail = "misconfigured", f"rejected its config, topology or data ({words})"
            reason = next((line.strip() for line in reversed(self.tails[proc.index])
                           if line.strip().startswith("error:")), None)
            if reason:  # the trainer's own line says why: the log need not be opened
                detail += f": {reason.removeprefix('error:').strip()}"
        elif code == DIVERGED_EXIT_CODE:
            cause, detail = "diverged", f"stopped on a non-finite loss or gradient ({words})"
        else:
            cause, detail = "crashed", f"failed ({words})"
        return Failure(cause, detail, proc.index, code, self.steps[proc.index])

    # ---- reports ------------------------------------------------------------------------------

    def _record(self, failure: Failure) -> None:
        self.reporter.event(
            "failure",
            attempt=self.number,
            slice=failure.slice,
            returncode=failure.returncode,
            exit=None if failure.returncode is None else describe_exit(failure.returncode),
            cause=failure.cause,
            last_step=failure.last_step if failure.slice is not None else max(
                (s for s in self.steps if s is not None), default=None),
        )

    def _report_failure(self, failure: Failure) -> None:
        assert failure.slice is not None
        index = failure.slice
        others = "; stopping the other slices" if len(self.live) > 1 else ""
        when = ("before its first step" if failure.last_step is None
                else f"after step {failure.last_step}")
        self.reporter.say(f"slice {index} {failure.detail} {when}{others}")
        if failure.cause == "kill-at":
            return
        tail = list(self.tails[index])
        self.reporter.say(
            f"last lines of slice {index} (full log: {self.logs_dir / f'slice-{index}.log'}):"
        )
        for line in meaningful_tail(tail) or ["(no output)"]:
            print(f"    {line}", file=sys.stderr, flush=True)
        if looks_like_init_timeout(tail):
            self.reporter.say(
                f"slice {index} timed out in jax.distributed start-up: the coordinator "
                f"{self.coordinator} (slice 0) or another slice did not come up within "
                f"MULTISLICE_INIT_TIMEOUT_S={self.plan.init_timeout_s}s (--init-timeout); "
                "check the other slices' logs for an earlier error"
            )

    def _report_stall(self) -> None:
        progress = ", ".join(
            f"slice {i}: {'no step yet' if s is None else f'step {s}'}"
            for i, s in enumerate(self.steps) if i in self.live
        )
        self.reporter.say(
            f"no slice printed anything for {self.plan.stall_timeout_s:g}s (--stall-timeout); "
            f"stopping all slices. Progress: {progress}"
        )
        for i, tail in enumerate(self.tails):
            if i not in self.live:
                continue
            self.reporter.say(f"last line of slice {i}: {tail[-1] if tail else '(no output)'}")
