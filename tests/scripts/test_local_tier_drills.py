"""Exactness drills of the local checkpoint tier with the real trainer under `multislice local`.

Two slices (against the resume drills' shared uninterrupted reference) and three slices (against
a reference of their own). Kill points are drawn at random on every run (the seed is printed):
a slice killed between local saves or while one is written, killed while a bucket save is held
in flight (the fork's test hook), the slice that holds process 0, and slices that come back with
their storage wiped, as a recreated VM does. Every run must end with the reference's parameters,
restore every restart from the tier the rules name, and read nothing from the bucket when a
slice survived with the newest step.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from scripts.local.attempt import Drill
from tests.scripts.test_resume import (
    attempts,
    holding_commits,
    metrics,
    one,
    preempted_at_step_6,
    step_rows,
    summary,
)
from tests.support.resume_runs import INTERVAL, STEPS, launch

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("resume")]

LOCAL_EVERY = 2
LOCAL = (f"checkpoint.local_every={LOCAL_EVERY}", "checkpoint.local_max_to_keep=2")


def _restores(run_dir: Path) -> list[dict[str, Any]]:
    return [one(rows, "restore") for rows in attempts(metrics(run_dir))[1:]]


def _check_restore_rules(run_dir: Path, wiped: list[bool], slices: int) -> list[dict[str, Any]]:
    """Each restart: at least as new as the bucket's newest at that point, nothing read from
    the bucket when the local tier served it, no wiped slice restoring its own part, and no more
    steps lost than local_every plus the step a kill can land after."""
    restores = _restores(run_dir)
    assert len(restores) == len(wiped)
    for row, was_wiped in zip(restores, wiped, strict=True):
        if row["tier"] in ("local", "peer"):
            assert row["processes_bucket"] == 0 and row["bytes_bucket"] == 0, row
            assert row["processes_local"] + row["processes_peer"] == slices, row
        if was_wiped and row["tier"] != "bucket":
            assert row["processes_peer"] >= 1, row  # a wiped slice can only receive its state
    for rows in attempts(metrics(run_dir))[1:]:
        restart = one(rows, "restart")
        assert restart["steps_recomputed"] <= LOCAL_EVERY + 1, restart
    return restores


SEED_ENV = "LOCAL_TIER_DRILL_SEED"


def _drill_rng() -> random.Random:
    """Kill points drawn anew on every run; the seed is printed (shown with a failure), and
    LOCAL_TIER_DRILL_SEED=SEED draws a failed run's points again."""
    seed = int(os.environ.get(SEED_ENV) or random.randrange(2**32))
    print(f"drill seed {seed} (rerun with {SEED_ENV}={seed})")
    return random.Random(seed)


@pytest.fixture(scope="module")
def experiment(resume_experiment: Path) -> Path:
    return resume_experiment


def test_a_held_bucket_save_and_random_kills_with_a_wiped_slice_resume_exactly_from_local(
        experiment, resume_data_dir, resume_reference, tmp_path_factory):
    rng = _drill_rng()
    run_dir = tmp_path_factory.mktemp("local-drill")
    hold = tmp_path_factory.mktemp("hold")
    (hold / "commit-release-1").touch()  # the bucket save of step 4 commits; step 8's is held
    # Killed at 9 or 10 while the save of step 8 is held: the bucket's newest is 4, the local
    # tier's 8 (or 10); the killed slice comes back wiped (or not) and, later, a random slice at
    # a random step, possibly in the middle of a local save.
    first = Drill(step=rng.choice([9, 10]), slice=rng.randrange(2), wipe=rng.random() < 0.5)
    second = Drill(step=rng.randrange(first.step + 2, STEPS), slice=rng.randrange(2),
                   wipe=rng.random() < 0.5)
    print(f"drills {first} then {second}")
    with holding_commits(experiment, hold, run_dir, '"event": "restart"'):
        code = launch(experiment, run_dir, resume_data_dir, max_restarts=2,
                      kill_at=(first, second), extra=LOCAL)
    assert code == 0, (run_dir / "logs" / "slice-0.log").read_text()[-3000:]
    assert summary(run_dir)["params_digest"] == summary(resume_reference)["params_digest"]
    restores = _check_restore_rules(run_dir, [first.wipe, second.wipe], 2)
    # The first restart had the bucket at step 4 only: it restored from the local tier.
    assert restores[0]["tier"] in ("local", "peer") and restores[0]["restored_step"] >= 8, \
        restores[0]
    if first.wipe:
        assert restores[0]["tier"] == "peer", restores[0]
    want = step_rows(metrics(resume_reference))
    for rows in attempts(metrics(run_dir)):
        for step, row in step_rows(rows).items():
            assert row["loss"] == want[step]["loss"], step


@pytest.fixture(scope="module")
def three_slice_reference(experiment, resume_data_dir, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("reference-3")
    assert launch(experiment, run_dir, resume_data_dir, slices=3, devices=1,
                  extra=("train.global_batch_size=12",)) == 0
    return run_dir


def test_three_slices_lose_the_slice_of_process_0_wiped_and_another_and_resume_exactly(
        experiment, resume_data_dir, three_slice_reference, tmp_path_factory):
    rng = _drill_rng()
    run_dir = tmp_path_factory.mktemp("local-drill-3")
    first = Drill(step=rng.randrange(INTERVAL + 1, 2 * INTERVAL + 2), slice=0, wipe=True)
    second = Drill(step=rng.randrange(first.step + 2, STEPS), slice=rng.randrange(1, 3),
                   wipe=rng.random() < 0.5)
    print(f"drills {first} then {second}")
    code = launch(experiment, run_dir, resume_data_dir, slices=3, devices=1, max_restarts=2,
                  kill_at=(first, second), extra=("train.global_batch_size=12", *LOCAL))
    assert code == 0, (run_dir / "logs" / "slice-0.log").read_text()[-3000:]
    assert summary(run_dir)["params_digest"] == summary(three_slice_reference)["params_digest"]
    restores = _check_restore_rules(run_dir, [True, second.wipe], 3)
    # Slice 0 (process 0) came back wiped: it received its state from a surviving slice.
    assert restores[0]["tier"] == "peer" and restores[0]["processes_peer"] == 1, restores[0]
    launcher = [json.loads(line) for line in (run_dir / "launcher.jsonl").read_text().splitlines()]
    assert [e["wiped"] for e in launcher if e["event"] == "kill"] == [True, second.wipe]


def test_sigterm_saves_to_the_local_tier_when_a_bucket_save_would_not_fit_the_grace(
        experiment, resume_data_dir, resume_reference, tmp_path):
    # The commit of bucket save 1 (step 4) is held until 3 s after the notice (so that the
    # slices agree on a stop step while steps remain): by the stop step either no bucket save
    # of this attempt finished, or the one that did took about 3 s, over half the 2 s grace
    # given here. Either way the stop step goes to the local tier.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MULTISLICE_TERM_GRACE_S", "2")
        run_dir = preempted_at_step_6(experiment, resume_data_dir, tmp_path, extra=LOCAL)
    first, second = attempts(metrics(run_dir))
    preempted = one(first, "preempted")
    stopped = preempted["step"]
    assert preempted["tier"] == "local" and stopped >= 6
    log = (run_dir / "logs" / "slice-0.log").read_text()
    assert f"preemption notice: saved step {stopped} to the local tier in " in log, log
    assert ("(no bucket save has finished in this attempt to time; grace 2s)" in log
            or re.search(r"\(a bucket save took [0-9.]+s, over half the 2s grace\)", log)), log
    restore = one(second, "restore")
    assert (restore["restored_step"], restore["tier"], restore["processes_local"]) == \
        (stopped, "local", 2)
    assert one(second, "restart")["steps_recomputed"] == 0
    assert summary(run_dir)["params_digest"] == summary(resume_reference)["params_digest"]


def _launches(run_dir: Path) -> dict[int, list[int]]:
    """attempt -> pids of the launcher's `launch` rows so far (a line it is still writing is
    skipped)."""
    path = run_dir / "launcher.jsonl"
    found = {}
    for line in path.read_text().splitlines() if path.exists() else ():
        with contextlib.suppress(json.JSONDecodeError):
            row = json.loads(line)
            if row.get("event") == "launch":
                found[row["attempt"]] = row["pids"]
    return found


def _launch_pids(run_dir: Path, attempt: int) -> list[int]:
    pids = _launches(run_dir).get(attempt)
    assert pids is not None, f"no launch of attempt {attempt} in {run_dir / 'launcher.jsonl'}"
    return pids


def _kill_slice(run_dir: Path, attempt: int, index: int, wipe: bool) -> None:
    """SIGKILL slice `index` of `attempt` (its process group), as a failed host; with `wipe`,
    once it is gone, its local storage too (a recreated VM)."""
    pid = _launch_pids(run_dir, attempt)[index]
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status = Path(f"/proc/{pid}/status")
        if not status.exists() or "State:\tZ" in status.read_text():
            break
        time.sleep(0.05)
    if wipe:
        shutil.rmtree(run_dir / "local" / f"slice-{index}")


def test_kills_during_a_local_save_and_during_a_restore_of_the_slice_of_process_0(
        experiment, resume_data_dir, resume_reference, tmp_path):
    # Bucket saves at 12 and 16 only, local parts every 2 steps. Attempt 0: the commits of the
    # parts of steps 2, 4, 6 go through, step 8's are held written but not renamed, the loop
    # stalls at step 10 (it waits for them) and slice 1 is killed there: mid local save.
    # Attempt 1: the processes agree on step 6 (own parts; the bucket has none); slice 0, which
    # holds process 0, is killed while it reads its part and comes back wiped. Attempt 2: slice
    # 0 receives step 6 from slice 1, and the run finishes as the reference did.
    run_dir = tmp_path / "held"
    hold = tmp_path / "hold"
    hold.mkdir()
    for k in (1, 2, 3):
        (hold / f"local-write-release-{k}").touch()
    stop = threading.Event()

    def waiting(kind: str, k: int) -> int:
        return len(list(hold.glob(f"local-{kind}-waiting-{k}-*")))

    def drive() -> None:
        def until(condition: Callable[[], bool]) -> bool:
            while not condition():
                if stop.wait(0.05):
                    return False
            return True

        if not until(lambda: waiting("write", 4) == 2):
            return
        _kill_slice(run_dir, 0, 1, wipe=False)
        # Released once attempt 1 started: slice 0's held part of step 8 must not commit before
        # the launcher stops it (with it committed, slice 0 alone would hold a whole step 8, a
        # complete step of the tier that slice 1 would receive: another drill's subject).
        if not until(lambda: 1 in _launches(run_dir)):
            return
        for k in range(4, 100):
            (hold / f"local-write-release-{k}").touch()
        # Attempt 1's processes each read their own part once (read 1 of each process).
        if not until(lambda: waiting("read", 1) >= 2):
            return
        _kill_slice(run_dir, 1, 0, wipe=True)
        for k in range(1, 100):
            (hold / f"local-read-release-{k}").touch()

    errors: list[BaseException] = []

    def drive_or_release() -> None:
        try:
            drive()
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test below
            errors.append(exc)
            for kind in ("write", "read"):  # let the run go on: the test fails on `errors`
                for k in range(1, 100):
                    (hold / f"local-{kind}-release-{k}").touch()

    driver = threading.Thread(target=drive_or_release, daemon=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRAINER_TEST_HOLD_LOCAL", str(hold))
        hooks = str(experiment / "tests" / "hooks")
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [hooks,
                                                                 os.environ.get("PYTHONPATH")])))
        driver.start()
        try:
            code = launch(experiment, run_dir, resume_data_dir, max_restarts=2,
                          extra=(*LOCAL, "checkpoint.save_interval_steps=12"))
        finally:
            stop.set()
            driver.join(timeout=10)
    assert not errors, errors
    assert code == 0, (run_dir / "logs" / "slice-0.log").read_text()[-3000:]
    runs = attempts(metrics(run_dir))
    assert len(runs) == 3
    held, during_restore, last = runs
    assert max(step_rows(held)) >= 8
    assert [r["step"] for r in held if r["event"] == "local_checkpoint"][:4] == [2, 4, 6, 8]
    assert not any(r["event"] == "restore" for r in during_restore)  # killed inside it
    restore = one(last, "restore")
    assert (restore["restored_step"], restore["tier"]) == (6, "peer"), restore
    assert (restore["processes_local"], restore["processes_peer"], restore["bytes_bucket"]) == \
        (1, 1, 0)
    assert summary(run_dir)["params_digest"] == summary(resume_reference)["params_digest"]
    want = step_rows(metrics(resume_reference))
    for rows in runs:
        for step, row in step_rows(rows).items():
            assert row["loss"] == want[step]["loss"], step
    assert not list((run_dir / "local").glob("*/*/tmp-*"))  # the held parts were cleaned


