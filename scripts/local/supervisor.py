"""Run attempts of an emulated multislice job until success, a terminal failure, or no restarts.

`Supervisor(plan).run()` returns the launcher's exit code (documented in `scripts.local.command`). A
failed slice ends an attempt; with restarts left, every slice is started again on the same run
directory (new coordinator port), as Cloud TPU auto-repair restarts a whole multislice job.
Stalls, interrupts, a trainer that rejected its config (exit code 2) and one that stopped on a
non-finite loss (exit code 3) are never restarted: they would fail the same way again.

Everything the launcher decides is appended to RUN_DIR/launcher.jsonl, one JSON object per line
with `event` and `time` (unix seconds); the goodput report reads it:

- `launch`: `attempt` (0 = first start), `coordinator`, `slices`, `devices_per_slice`, `pids`
- `kill` / `preempt`: a `--kill-at` / `--preempt-at` drill fired: `slice`, `step` (the step it
  had reported), `at` ("STEP:SLICE"), `pid`
- `failure`: `attempt`, `slice` (null for a stall or interrupt), `returncode`, `exit` (words),
  `cause` (`kill-at`, `preempted`, `misconfigured`, `diverged`, `crashed`, `stalled`,
  `interrupted`), `last_step`
- `repair`: `slice`, `down_s`, `until` (unix seconds): under --slice-down-for, the failed slice
  is away that long, as a repair of its VMs would be, and the restart waits for it
- `restart`: `attempt` (1..N, the attempt about to start), `reason`
- `end`: `status` (`succeeded`, `failed`, `stalled`, `interrupted`), `exit_code`, `restarts`,
  `duration_s`
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator

from scripts.local.attempt import Attempt, Drill, Failure, LaunchPlan, Reporter

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_MISCONFIGURED = 2  # the trainer rejected what it was given: bad arguments, as the launcher's
EXIT_STALLED = 3


class Supervisor:
    def __init__(self, plan: LaunchPlan) -> None:
        self.plan = plan
        self.reporter = Reporter(plan.log_dir / "launcher.jsonl")
        self.fired: set[Drill] = set()
        self.interrupts: list[int] = []
        self.restarts = 0
        self.outcome = "not started"

    @contextlib.contextmanager
    def _signals_recorded(self) -> Iterator[None]:
        # Children run in their own sessions, so Ctrl-C reaches only us; the attempt then stops
        # them in order instead of the launcher dying with its children still running.
        def record(signum: int, _frame: object) -> None:
            self.interrupts.append(signum)

        previous = {sig: signal.signal(sig, record) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def run(self) -> int:
        self.plan.log_dir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with self._signals_recorded():
            status, code = self._attempts()
        self.reporter.event("end", status=status, exit_code=code, restarts=self.restarts,
                            duration_s=round(time.monotonic() - started, 3))
        return code

    def _wait_for_repair(self, failure: Failure) -> bool:
        """Under --slice-down-for, keep the slice that went away (a drill's kill or preemption,
        a crash) away that long before every slice starts again, as Cloud TPU's repair of its
        VMs would; False when an interrupt came while waiting."""
        down_s = self.plan.slice_down_s
        if not down_s or failure.slice is None:
            return True
        until = time.time() + down_s
        self.reporter.event("repair", slice=failure.slice, down_s=down_s, until=round(until, 3))
        self.reporter.say(f"slice {failure.slice} is down for {down_s:g} s (--slice-down-for), "
                          "as a repair of its VMs would be; every slice waits for it")
        while time.time() < until:
            if self.interrupts:
                return False
            time.sleep(min(0.2, max(until - time.time(), 0.0)))
        return not self.interrupts

    def _attempts(self) -> tuple[str, int]:
        say = self.reporter.say
        number = 0
        while True:
            failure = Attempt(self.plan, number, self.reporter, self.fired, self.interrupts).run()
            if failure is None:
                self.outcome = (f"all {self.plan.slices} slices exited 0" if self.plan.slices > 1
                                else "the slice exited 0")
                return "succeeded", EXIT_OK
            self.outcome = failure.describe()
            if self.interrupts:
                signum = self.interrupts[0]
                say(f"stopped all slices after {signal.Signals(signum).name}")
                return "interrupted", 128 + signum
            if failure.cause == "stalled":
                return "stalled", EXIT_STALLED
            if failure.cause == "misconfigured":
                if self.plan.max_restarts:
                    say("not restarting: the same config would be rejected again")
                return "failed", EXIT_MISCONFIGURED
            if failure.cause == "diverged":
                if self.plan.max_restarts:
                    say("not restarting: resuming from the last checkpoint would diverge again")
                return "failed", EXIT_FAILED
            if self.restarts >= self.plan.max_restarts:
                if self.plan.max_restarts:
                    say(f"giving up: restart budget spent (--max-restarts {self.plan.max_restarts})")
                return "failed", EXIT_FAILED
            if not self._wait_for_repair(failure):
                signum = self.interrupts[0]
                say(f"stopped while waiting for slice {failure.slice}'s repair "
                    f"({signal.Signals(signum).name})")
                return "interrupted", 128 + signum
            self.restarts += 1
            number += 1
            reason = failure.describe()
            self.reporter.event("restart", attempt=number, reason=reason)
            say(f"restarting all {self.plan.slices} slices (restart {self.restarts} of "
                f"{self.plan.max_restarts}) because {reason}")
