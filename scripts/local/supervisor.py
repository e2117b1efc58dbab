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
- `reform`: an elastic job (the trainer's `elastic.min_slices`) starts again at once on the
  slices that are up instead of waiting: `attempt`, `slices`, `live` (slice numbers), `down`,
  `decision` (`shrink` or `wait`) and `why`
- `grow`: a lost slice is back; the job on fewer slices was stopped at a step boundary (it
  saved) and starts again on `slices`: `attempt`, `returned`
- `end`: `status` (`succeeded`, `failed`, `stalled`, `interrupted`), `exit_code`, `restarts`,
  `duration_s`
"""

from __future__ import annotations

import contextlib
import signal
import statistics
import time
from collections.abc import Iterator

from scripts.local.attempt import Attempt, Drill, Failure, LaunchPlan, Reporter

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_MISCONFIGURED = 2  # the trainer rejected what it was given: bad arguments, as the launcher's
EXIT_STALLED = 3


def shrink_or_wait(slices: int, full: int, repairs: list[float], reforms: list[float]
                   ) -> tuple[str, str]:
    """("shrink" or "wait", why): training on `slices` of `full` until the repair and growing
    back loses less than waiting for it when the repair takes longer than a re-formation (with
    R the repair and C a restart: waiting loses R + C of the whole job; shrinking loses C, then
    (R - C)(full - slices)/full, then C to grow back). Estimates are the medians of what this
    run has seen; with none seen, a repair is taken to be long (Cloud TPU's take minutes)."""
    if not repairs:
        return "shrink", (f"no repair seen yet; training on {slices} of {full} slices meanwhile")
    repair = statistics.median(repairs)
    if not reforms:
        return "shrink", (f"a repair takes {repair:.0f} s (median of {len(repairs)}); no "
                          "re-formation measured yet")
    reform = statistics.median(reforms)
    lost_waiting = repair + reform
    lost_shrinking = reform + max(repair - reform, 0.0) * (full - slices) / full + reform
    if lost_shrinking < lost_waiting:
        return "shrink", (f"a repair takes {repair:.0f} s and a re-formation {reform:.0f} s "
                          f"(medians): shrinking loses {lost_shrinking:.0f} s of the whole job, "
                          f"waiting {lost_waiting:.0f} s")
    return "wait", (f"a repair takes {repair:.0f} s and a re-formation {reform:.0f} s (medians): "
                    f"waiting loses {lost_waiting:.0f} s of the whole job, shrinking "
                    f"{lost_shrinking:.0f} s")


class Supervisor:
    def __init__(self, plan: LaunchPlan) -> None:
        self.plan = plan
        self.reporter = Reporter(plan.log_dir / "launcher.jsonl")
        self.fired: set[Drill] = set()
        self.interrupts: list[int] = []
        self.restarts = 0
        self.outcome = "not started"
        self.learned: dict[str, int] = {}  # what the trainers said: min_slices when elastic
        self.down: dict[int, float] = {}  # slice -> when its repair ends (time.time())
        self.repairs: list[float] = []  # seconds each repair took
        self.reforms: list[float] = []  # seconds from a failure to the next first step
        self.live = tuple(range(plan.slices))

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

    def _take_down(self, failure: Failure) -> None:
        """Under --slice-down-for, the slice that went away (a drill's kill or preemption, a
        crash) stays away that long, as Cloud TPU's repair of its VMs would."""
        down_s = self.plan.slice_down_s
        if not down_s or failure.slice is None:
            return
        until = time.time() + down_s
        self.down[failure.slice] = until
        self.reporter.event("repair", slice=failure.slice, down_s=down_s, until=round(until, 3))
        elastic = self.learned.get("min_slices", 0)
        self.reporter.say(f"slice {failure.slice} is down for {down_s:g} s (--slice-down-for), "
                          "as a repair of its VMs would be" + (
                              "" if elastic else "; every slice waits for it"))

    def _returned(self) -> list[int]:
        """Slices whose repair is over (forgotten as down, their repair time recorded)."""
        now = time.time()
        back = sorted(s for s, until in self.down.items() if until <= now)
        for s in back:
            del self.down[s]
            self.repairs.append(self.plan.slice_down_s)
        return back

    def _next_live(self) -> tuple[int, ...] | None:
        """The slices the next attempt starts on: all of them once the repairs are over, or,
        for an elastic job whose floor the slices that are up reach, those (when shrinking
        loses less than waiting); None when an interrupt came while waiting."""
        self._returned()
        floor = self.learned.get("min_slices", 0)
        full = self.plan.slices
        up = tuple(s for s in range(full) if s not in self.down)
        if self.down and floor and len(up) >= floor:
            decision, why = shrink_or_wait(len(up), full, self.repairs, self.reforms)
            self.reporter.event("reform", attempt=self.attempt + 1, slices=len(up),
                                live=list(up), down=sorted(self.down), decision=decision,
                                why=why)
            self.reporter.say(f"elastic: {decision} ({why})" + (
                f": starting again at once on slices {' '.join(map(str, up))}"
                if decision == "shrink" else f": waiting for slice(s) "
                f"{' '.join(map(str, sorted(self.down)))}"))
            if decision == "shrink":
                return up
        while self.down:
            if self.interrupts:
                return None
            time.sleep(min(0.2, max(min(self.down.values()) - time.time(), 0.0)))
            self._returned()
        return None if self.interrupts else tuple(range(full))

    def _grow_when(self) -> str | None:
        back = [s for s, until in self.down.items() if until <= time.time()]
        if not back:
            return None
        return f"slice(s) {' '.join(map(str, sorted(back)))} back after repair"

    def _attempts(self) -> tuple[str, int]:
        say = self.reporter.say
        self.attempt = number = 0
        failed_at: float | None = None
        while True:
            attempt = Attempt(self.plan, number, self.reporter, self.fired, self.interrupts,
                              live=self.live, grow_when=self._grow_when, learned=self.learned)
            failure = attempt.run()
            if failed_at is not None and attempt.first_step_at is not None:
                # from the failure to the first step again: detect, re-form, restore, step
                self.reforms.append(attempt.first_step_at - failed_at)
            failed_at = time.time()
            if failure is not None and failure.cause == "grow":
                returned = self._returned()
                self.live = tuple(sorted({*self.live, *returned}))
                number += 1
                self.attempt = number
                self.reporter.event("grow", attempt=number, slices=len(self.live),
                                    returned=returned)
                say(f"growing back: starting again on {len(self.live)} of {self.plan.slices} "
                    f"slices (slice(s) {' '.join(map(str, returned))} back)")
                failed_at = None
                continue
            if failure is None:
                self.outcome = (f"all {len(self.live)} slices exited 0" if len(self.live) > 1
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
            self._take_down(failure)
            live = self._next_live()
            if live is None:
                signum = self.interrupts[0]
                say(f"stopped while waiting for slice {failure.slice}'s repair "
                    f"({signal.Signals(signum).name})")
                return "interrupted", 128 + signum
            self.live = live
            self.restarts += 1
            number += 1
            self.attempt = number
            reason = failure.describe()
            self.reporter.event("restart", attempt=number, reason=reason)
            which = (f"all {self.plan.slices} slices" if len(live) == self.plan.slices
                     else f"{len(live)} of {self.plan.slices} slices")
            say(f"restarting {which} (restart {self.restarts} of "
                f"{self.plan.max_restarts}) because {reason}")
