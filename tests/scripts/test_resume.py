"""Resume drills with the real template trainer under `multislice local` (2 slices x 2 devices).

One uninterrupted reference run; one run that is killed three times (before its first checkpoint,
while an async save is in flight, and after a committed checkpoint) and restarted each time; that
run's newest checkpoint corrupted and the run repeated; and elastic resumes of the reference's
step-8 checkpoint on 1 slice x 4 devices and 4 slices x 1 device. Resumed runs must continue
exactly where the reference was: same per-step losses (bit-for-bit on the same topology, within
float tolerance on another), the same global batches (`batch_digest`), the same final parameters.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from scripts.local.attempt import Drill
from tests.support.resume_runs import INTERVAL, STEPS, launch

# One worker runs this module and test_resume_gcs.py (pytest -n: fixtures are per worker): their
# shared reference (tests/scripts/conftest.py) and the drilled runs are made once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("resume")]

ELASTIC_FROM = 8
ELASTIC_LOSS_RTOL = 1e-4

def metrics(run_dir: Path) -> list[dict[str, Any]]:
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a line cut short by SIGKILL
            rows.append(json.loads(line))
    return rows


def attempts(rows: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The rows of each trainer start, split at `process_start`."""
    runs: list[list[dict[str, Any]]] = []
    for row in rows:
        if row["event"] == "process_start":
            runs.append([])
        runs[-1].append(row)
    return runs


def one(rows: list[dict[str, Any]], event: str) -> dict[str, Any]:
    found = [r for r in rows if r["event"] == event]
    assert len(found) == 1, f"expected one {event!r} row, got {found}"
    return found[0]


def step_rows(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {r["step"]: r for r in rows if r["event"] == "step"}


def summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def launcher_events(run_dir: Path, event: str) -> list[dict[str, Any]]:
    lines = (run_dir / "launcher.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, lines) if row["event"] == event]


@pytest.fixture(scope="module")
def experiment(resume_experiment: Path) -> Path:
    return resume_experiment


@pytest.fixture(scope="module")
def data_dir(resume_data_dir: Path) -> Path:
    return resume_data_dir


@pytest.fixture(scope="module")
def reference(resume_reference: Path) -> Path:
    return resume_reference


@contextlib.contextmanager
def holding_commits(experiment: Path, hold: Path, run_dir: Path, launcher_text: str, *,
                    occurrences: int = 1, delay_s: float = 0.0) -> Iterator[None]:
    """Trainers started inside hold their async commits (the fork's test-only hook,
    tests/hooks/sitecustomize.py) until RUN_DIR/launcher.jsonl contains `launcher_text`
    `occurrences` times (then `delay_s` more)."""
    stop = threading.Event()

    def release() -> None:
        log = run_dir / "launcher.jsonl"
        while not stop.is_set():
            if log.exists() and log.read_text().count(launcher_text) >= occurrences:
                stop.wait(delay_s)
                for k in range(1, 100):
                    (hold / f"commit-release-{k}").touch()
                return
            time.sleep(0.05)

    releaser = threading.Thread(target=release, daemon=True)
    releaser.start()
    mp = pytest.MonkeyPatch()
    mp.setenv("TRAINER_TEST_HOLD_COMMIT", str(hold))
    # the fork's test-only hook (tests/hooks/sitecustomize.py), first on the trainers' path
    hooks = str(experiment / "tests" / "hooks")
    mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [hooks, os.environ.get("PYTHONPATH")])))
    try:
        yield
    finally:
        mp.undo()
        stop.set()
        releaser.join(timeout=10)


@pytest.fixture(scope="module")
def drilled(experiment: Path, data_dir: Path, reference: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Killed at step 2 (no checkpoint yet), at 10 while save 8 is held in flight, at 14."""
    run_dir = tmp_path_factory.mktemp("drilled")
    hold = tmp_path_factory.mktemp("hold")
    # Each trainer process counts its saves from 1. In attempt 1 (after the kill at step 2) save 1
    # (step 4) may commit and save 2 (step 8) is held, so the kill at step 10 lands mid-save.
    (hold / "commit-release-1").touch()
    with holding_commits(experiment, hold, run_dir, '"event": "restart"', occurrences=2):
        code = launch(experiment, run_dir, data_dir, max_restarts=3,
                      kill_at=(Drill(step=2, slice=1), Drill(step=10, slice=0),
                               Drill(step=14, slice=1)))
    assert code == 0
    assert (hold / "commit-waiting-2").exists(), "save 2 never reached its commit"
    return run_dir


def assert_same_steps(got: dict[int, dict[str, Any]], want: dict[int, dict[str, Any]],
                      steps: range, *, exact: bool) -> None:
    assert sorted(got) == list(steps)
    for step in steps:
        assert got[step]["batch_digest"] == want[step]["batch_digest"], f"step {step}"
        if exact:
            assert got[step]["loss"] == want[step]["loss"], f"step {step}"
        else:
            assert got[step]["loss"] == pytest.approx(want[step]["loss"],
                                                      rel=ELASTIC_LOSS_RTOL), f"step {step}"


def test_reference_run_is_one_fresh_attempt_with_periodic_checkpoints(reference):
    rows = metrics(reference)
    [only] = attempts(rows)
    one(only, "fresh_start")
    assert [r["step"] for r in only if r["event"] == "checkpoint"] == [4, 8, 12, 16]
    assert all(r["blocking_s"] >= 0 for r in only if r["event"] == "checkpoint")
    assert sorted(step_rows(rows)) == list(range(1, STEPS + 1))
    assert summary(reference)["final_step"] == STEPS
    assert list((reference).glob("events.out.tfevents.*")), "no TensorBoard event file"


def test_killed_runs_resume_exactly_where_the_reference_was(drilled, reference):
    want = step_rows(metrics(reference))
    runs = attempts(metrics(drilled))
    assert len(runs) == 4
    assert len(launcher_events(drilled, "restart")) == 3
    # Fresh; fresh again (killed before step 4); step 4 (save 8 was held in flight); step 12, or
    # 8 if the save of 12 had not committed yet when step 14 was reached.
    expected_restores: list[set[int] | None] = [None, None, {4}, {8, 12}]
    for attempt, (rows, restored) in enumerate(zip(runs, expected_restores, strict=True)):
        if restored is None:
            one(rows, "fresh_start")
            start = 0
        else:
            start = one(rows, "restore")["restored_step"]
            assert start in restored, f"attempt {attempt}"
        got = step_rows(rows)
        # Every step an attempt ran, before or after its kill, is the reference's step.
        assert_same_steps(got, want, range(start + 1, max(got) + 1), exact=True)
        if attempt:
            restart = one(rows, "restart")
            # How far the attempt got: its step rows, or a checkpoint it started after them
            # (a step's row is written one step late).
            last = max([*step_rows(runs[attempt - 1]), *(
                r["step"] for r in runs[attempt - 1] if r["event"] == "checkpoint")])
            assert restart["last_step"] == last
            assert restart["steps_recomputed"] == last - start
    assert max(step_rows(runs[-1])) == STEPS
    assert summary(drilled)["params_digest"] == summary(reference)["params_digest"]
    assert summary(drilled)["final_step"] == STEPS
    assert not list((drilled / "checkpoints").glob("*.orbax-checkpoint-tmp*"))


def test_a_truncated_newest_checkpoint_falls_back_to_the_previous(
        drilled, reference, experiment, data_dir, tmp_path):
    run_dir = tmp_path / "corrupt"
    shutil.copytree(drilled, run_dir)
    (run_dir / "summary.json").unlink()
    newest = run_dir / "checkpoints" / str(STEPS)
    victim = max((p for p in (newest / "state").rglob("*") if p.is_file()),
                 key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 3])

    assert launch(experiment, run_dir, data_dir) == 0
    last = attempts(metrics(run_dir))[-1]
    restore = one(last, "restore")
    assert (restore["restored_step"], restore["skipped_steps"]) == (STEPS - INTERVAL, [STEPS])
    log = (run_dir / "logs" / "slice-0.log").read_text()
    assert f"checkpoint step {STEPS} in" in log and f"falling back to step {STEPS - INTERVAL}" in log
    assert_same_steps(step_rows(last), step_rows(metrics(reference)),
                      range(STEPS - INTERVAL + 1, STEPS + 1), exact=True)
    assert summary(run_dir)["params_digest"] == summary(reference)["params_digest"]


def preempted_at_step_6(experiment: Path, data_dir: Path, tmp_path: Path,
                        extra: tuple[str, ...] = ()) -> Path:
    """A run whose slice 1 gets SIGTERM at step 6, restarted once; its run directory.

    Steps take milliseconds here, faster than JAX's processes agree on a stop step. Holding the
    commit of save 1 (step 4) parks the loop in save 8 (it waits for save 4) until 3 s after the
    notice, so the agreement is reached while steps remain."""
    run_dir = tmp_path / "preempted"
    hold = tmp_path / "hold"
    hold.mkdir()
    with holding_commits(experiment, hold, run_dir, '"event": "preempt"', delay_s=3.0):
        code = launch(experiment, run_dir, data_dir, preempt_at=(Drill(step=6, slice=1),),
                      max_restarts=1, stop_grace_s=60, extra=extra)
    assert code == 0
    return run_dir


def test_sigterm_to_one_slice_stops_every_slice_at_one_step_saves_and_resumes(
        reference, experiment, data_dir, tmp_path):
    run_dir = preempted_at_step_6(experiment, data_dir, tmp_path)
    [failure] = launcher_events(run_dir, "failure")
    assert (failure["returncode"], failure["cause"]) == (42, "preempted")
    first, second = attempts(metrics(run_dir))
    stopped = one(first, "preempted")["step"]
    assert stopped >= 6 and max(step_rows(first)) == stopped
    assert stopped in [r["step"] for r in first if r["event"] == "checkpoint"]
    assert one(second, "restore")["restored_step"] == stopped
    assert one(second, "restart")["steps_recomputed"] == 0  # nothing lost: it saved first
    for index in (0, 1):  # JAX's preemption service stopped the slice that got no SIGTERM too
        log = (run_dir / "logs" / f"slice-{index}.log").read_text()
        assert f"preempted: checkpoint of step {stopped} saved; exit code 42" in log
    want = step_rows(metrics(reference))
    assert_same_steps(step_rows(second), want, range(stopped + 1, STEPS + 1), exact=True)
    assert summary(run_dir)["params_digest"] == summary(reference)["params_digest"]


def rewound_copy(run_dir: Path, to: Path, step: int = ELASTIC_FROM) -> Path:
    """The run directory as it was right after its step-`step` checkpoint committed: later
    checkpoints, later step rows and the summary removed."""
    shutil.copytree(run_dir, to)
    (to / "summary.json").unlink()
    for step_dir in (to / "checkpoints").iterdir():
        if step_dir.name.isdigit() and int(step_dir.name) > step:
            shutil.rmtree(step_dir)
    kept = [row for row in metrics(to) if row.get("step", 0) <= step]
    (to / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in kept))
    return to


# The 1-slice resume also reads through a Grain worker process: the same batches either way.
@pytest.mark.parametrize(("slices", "devices", "workers"), [(1, 4, 1), (4, 1, 0)])
def test_elastic_resume_reshards_and_continues_the_global_data_order(
        reference, experiment, data_dir, tmp_path, slices, devices, workers):
    run_dir = rewound_copy(reference, tmp_path / "elastic")
    assert launch(experiment, run_dir, data_dir, slices=slices, devices=devices,
                  extra=(f"data.worker_count={workers}",)) == 0
    last = attempts(metrics(run_dir))[-1]
    assert one(last, "restore")["restored_step"] == ELASTIC_FROM
    assert_same_steps(step_rows(last), step_rows(metrics(reference)),
                      range(ELASTIC_FROM + 1, STEPS + 1), exact=False)
    result = summary(run_dir)
    assert (result["num_slices"], result["devices_per_slice"]) == (slices, devices)
    assert result["final_step"] == STEPS
    assert result["final_loss"] == pytest.approx(summary(reference)["final_loss"],
                                                 rel=ELASTIC_LOSS_RTOL)


def test_elastic_resume_that_cannot_split_the_batch_fails_before_compiling(
        reference, experiment, data_dir, tmp_path):
    run_dir = rewound_copy(reference, tmp_path / "bad")
    assert launch(experiment, run_dir, data_dir, slices=3, devices=1) == 2
    log = (run_dir / "logs" / "slice-0.log").read_text()
    assert f"cannot resume checkpoint step {ELASTIC_FROM} in" in log
    assert "on 3 slice(s) x 1 devices (3 processes)" in log
    assert "train.global_batch_size = 8 is not divisible by the 3 batch shards" in log
    last = attempts(metrics(run_dir))[-1]
    assert "compile" not in {r["event"] for r in last}
