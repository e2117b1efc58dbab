"""Elastic drills with the real trainer under `multislice local` (issue 69): three slices, one
killed and kept down as a repair would keep it, the survivors re-forming at once on two, and the
job growing back to three when the slice returns.

Against one uninterrupted 3-slice run: with elastic.canonical_reduction the parameters are its
bits; without it a run equals a replay of the same failure schedule, and every step of every
attempt reads the same examples as the uninterrupted run's step (its batch digest).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from scripts.local import command
from scripts.local.attempt import Drill
from scripts.local.command import run_local
from scripts.report.command import build_report, format_report
from tests.scripts.test_resume import attempts, metrics, one, step_rows, summary
from tests.support.resume_runs import SMALL

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("resume")]

STEPS = 40
# Shorter than a re-formation here: the slice is back by the re-formed job's first step, and the
# launcher grows the job back once every slice of it has made one (never before: so at least one
# step runs on two slices, and the run is far from its end when it grows back).
DOWN_S = 2.0
# 12 rows: 2 micro-batches of 2 rows on each of 3 slices, 3 of 2 rows on each of 2.
ELASTIC = ("train.global_batch_size=12", "train.grad_accum_steps=2", "checkpoint.local_every=2",
           "checkpoint.local_max_to_keep=2", "elastic.min_slices=2")
CANONICAL = (*ELASTIC, "elastic.canonical_reduction=true")


def _launch(experiment: Path, run_dir: Path, data_dir: Path, settings: tuple[str, ...],
            kill_at: tuple[Drill, ...] = (), steps: int = STEPS, down_s: float = DOWN_S) -> int:
    values = (*SMALL, f"data.path={data_dir}", "data.prepare_if_missing=true", *settings)
    sets = [arg for value in values for arg in ("--set", value)]
    return run_local(
        experiment=experiment, slices=3, devices_per_slice=1, run_dir=run_dir,
        trainer_args=["--config", "tiny", "--steps", str(steps), *sets], kill_at=kill_at,
        max_restarts=3 if kill_at else 0, init_timeout_s=120, stall_timeout_s=240,
        stop_grace_s=2, slice_down_s=down_s if kill_at else 0.0)


def _events(run_dir: Path, *names: str) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run_dir / "launcher.jsonl").read_text().splitlines()]
    return [row for row in rows if row["event"] in names]


def _restores(run_dir: Path) -> list[dict[str, Any]]:
    return [one(rows, "restore") for rows in attempts(metrics(run_dir))[1:]]


def _same_examples_every_step(run_dir: Path, reference: Path) -> int:
    """Every step any attempt ran read the reference's examples; returns the steps run on
    fewer slices than the job's three."""
    want = step_rows(metrics(reference))
    degraded = 0
    for rows in attempts(metrics(run_dir)):
        for step, row in step_rows(rows).items():
            assert row["batch_digest"] == want[step]["batch_digest"], step
    for launch, rows in zip(_events(run_dir, "launch"), attempts(metrics(run_dir)), strict=True):
        if launch["slices"] < 3:
            degraded += len(step_rows(rows))
    return degraded


@pytest.fixture(scope="module")
def experiment(resume_experiment: Path) -> Path:
    return resume_experiment


@pytest.fixture(scope="module")
def reference(experiment, resume_data_dir, tmp_path_factory) -> Path:
    """Uninterrupted on 3 slices, canonical reduction (the examples of a step do not depend on
    the reduction, so the plain runs compare their batches with it too)."""
    run_dir = tmp_path_factory.mktemp("elastic-reference")
    assert _launch(experiment, run_dir, resume_data_dir, CANONICAL) == 0
    return run_dir


def test_a_slice_kept_down_the_job_re_forms_on_two_grows_back_and_ends_with_the_same_bits(
        experiment, resume_data_dir, reference, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("elastic-canonical")
    code = _launch(experiment, run_dir, resume_data_dir, CANONICAL, (Drill(step=6, slice=1),))
    assert code == 0, (run_dir / "logs" / "slice-0.log").read_text()[-3000:]
    assert summary(run_dir)["params_digest"] == summary(reference)["params_digest"]
    launches = _events(run_dir, "launch")
    assert [row["slices"] for row in launches] == [3, 2, 3]
    assert launches[1]["live"] == [0, 2]
    (reform,) = _events(run_dir, "reform")
    assert reform["decision"] == "shrink" and reform["down"] == [1]
    (grow,) = _events(run_dir, "grow")
    assert grow["returned"] == [1] and grow["slices"] == 3
    shrunk, grown = _restores(run_dir)
    # The survivors restored their own parts; the returning slice received a survivor's.
    assert (shrunk["tier"], shrunk["processes_local"], shrunk["bytes_bucket"]) == ("local", 2, 0)
    assert (grown["processes_peer"], grown["processes_local"], grown["bytes_bucket"]) == (1, 2, 0)
    degraded = _same_examples_every_step(run_dir, reference)
    assert degraded >= 1
    # `report` shows the phases: the attempt on two slices, the grow-back, the degraded steps
    report = build_report(str(run_dir))
    attempts_ = report.timeline.attempts
    assert [(a.slices, a.cause) for a in attempts_] == [(3, None), (2, "disruption"),
                                                         (3, "grow-back")]
    assert report.restarts == 1 and report.timeline.degraded_steps == degraded
    text = format_report(report)
    assert "elastic: 1 re-formation(s) on fewer slices, 1 grow-back(s)" in text
    assert "attempt 1 after a disruption on 2 of 3 slices" in text
    assert (run_dir / "report.png").stat().st_size > 0


def test_without_canonical_reduction_a_run_equals_its_replay_and_reads_the_same_examples(
        experiment, resume_data_dir, reference, tmp_path_factory, monkeypatch):
    # The coordinator's slice (process 0) is the one lost: slice 1 coordinates the two.
    run_dir = tmp_path_factory.mktemp("elastic-plain")
    code = _launch(experiment, run_dir, resume_data_dir, ELASTIC, (Drill(step=6, slice=0),))
    assert code == 0, (run_dir / "logs" / "slice-1.log").read_text()[-3000:]
    assert _events(run_dir, "launch")[1]["live"] == [1, 2]
    assert _same_examples_every_step(run_dir, reference) >= 1
    shrunk, grown = (row["restored_step"] for row in _restores(run_dir))
    # The replay: the same schedule in steps, each part a launch of its own: 3 slices to the
    # step the job shrank at, slices 1 and 2 of the 3 to the step it grew back at, then 3.
    replay = tmp_path_factory.mktemp("elastic-plain-replay")
    assert _launch(experiment, replay, resume_data_dir, ELASTIC, steps=shrunk) == 0

    class OnSlicesOneAndTwo(command.Supervisor):
        def __init__(self, plan):
            super().__init__(plan)
            self.live = (1, 2)

    with monkeypatch.context() as patch:
        patch.setattr(command, "Supervisor", OnSlicesOneAndTwo)
        assert _launch(experiment, replay, resume_data_dir, ELASTIC, steps=grown) == 0
    assert _launch(experiment, replay, resume_data_dir, ELASTIC) == 0
    assert [row["slices"] for row in _events(replay, "launch")] == [3, 2, 3]
    assert summary(replay)["params_digest"] == summary(run_dir)["params_digest"]


def test_a_slice_lost_while_the_job_re_forms_leaves_too_few_so_it_waits_and_ends_exactly(
        experiment, resume_data_dir, reference, tmp_path_factory, capsys):
    run_dir = tmp_path_factory.mktemp("elastic-reform-kill")
    drills = (Drill(step=6, slice=1), Drill(step=0, slice=2))
    # Down long enough that slice 1 is still away when slice 2 is lost (idle time, not CPU).
    code = _launch(experiment, run_dir, resume_data_dir, CANONICAL, drills, down_s=15.0)
    assert code == 0, (run_dir / "logs" / "slice-0.log").read_text()[-3000:]
    assert summary(run_dir)["params_digest"] == summary(reference)["params_digest"]
    kills = _events(run_dir, "kill")
    assert [(row["slice"], row["at"]) for row in kills] == [(1, "6:1"), (2, "reform:2")]
    # One survivor is below the floor of 2: no second re-formation, the job waits for both.
    assert len(_events(run_dir, "reform")) == 1
    assert [row["slices"] for row in _events(run_dir, "launch")] == [3, 2, 3]
    assert "restarting all 3 slices" in capsys.readouterr().err
