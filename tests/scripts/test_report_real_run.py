"""`multislice report` on what the real trainer and launcher write: a run killed and restarted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts.local.attempt import Drill
from scripts.local.command import run_local
from scripts.new import render_template
from scripts.report.command import build_report, report_to_json

pytestmark = pytest.mark.slow

STEPS = 14
KILL_AT = 12  # tiny saves every 10 steps, so the restart resumes at step 10 and redoes 11-12


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    experiment = render_template("reportcheck", tmp_path_factory.mktemp("exp"))
    run_dir = tmp_path_factory.mktemp("run")
    code = run_local(experiment=experiment, slices=1, devices_per_slice=2, run_dir=run_dir,
                     trainer_args=["--config", "tiny", "--steps", str(STEPS)],
                     kill_at=[Drill(step=KILL_AT, slice=0)], max_restarts=1,
                     stall_timeout_s=300)
    assert code == 0, f"multislice local exited {code}; see {run_dir / 'logs'}"
    return run_dir


def test_report_of_a_killed_run_agrees_with_the_trainers_own_restart_row(killed_run: Path) -> None:
    report = build_report(str(killed_run))
    timeline = report.timeline
    rows = [json.loads(line) for line in (killed_run / "metrics.jsonl").read_text().splitlines()]
    restart = next(r for r in rows if r["event"] == "restart")
    first, second = timeline.attempts
    assert first.crashed and not second.crashed
    assert second.restored_step == restart["restored_step"] == 10
    assert timeline.steps_recomputed == restart["steps_recomputed"] >= KILL_AT - 10
    assert (report.final_step, report.restarts) == (STEPS, 1)
    summary = json.loads((killed_run / "summary.json").read_text())
    assert report.final_loss == pytest.approx(summary["final_loss"])

    seconds = timeline.seconds
    assert sum(seconds.values()) == pytest.approx(timeline.wall_s)
    for category in ("productive", "startup", "compile", "restore", "checkpoint", "lost", "idle"):
        assert seconds[category] > 0, category
    assert 0 < report.goodput < 1
    # Productive time is exactly the kept steps' time less the saves that blocked inside them.
    kept = sum(s.step_time_s for s in timeline.steps if not s.lost)
    assert seconds["productive"] <= kept + 1e-6
    assert seconds["productive"] >= kept - seconds["checkpoint"] - 1e-6


def test_report_png_and_json_of_a_real_run(killed_run: Path) -> None:
    report = build_report(str(killed_run))
    data = (killed_run / "report.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    out = report_to_json(report)
    json.dumps(out)  # serialisable as is
    assert out["restarts"] == 1 and out["png"] == str(killed_run / "report.png")
