"""Each attempt's time to its first step, split into the phases a restart pays for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts.report.command import build_report, format_report, report_to_json
from scripts.report.goodput import build_timeline
from scripts.report.phases import PHASES, startup_phases

T0 = 5000.0


def pod_restart_rows() -> list[dict]:
    """A pod's attempt: boot 2 s, environment 6 s (3 of it after the setup), imports 1.5 s,
    distributed 0.5 s, data 0.25 s, a restore of 2 s with the compile (3 s) started with it,
    and a first step of 0.75 s."""
    return [
        {"event": "process_start", "time": T0 + 8.2, "boot_at": T0, "setup_at": T0 + 2,
         "setup_done_at": T0 + 7.5, "launched_at": T0 + 8},
        {"event": "imports", "time": T0 + 9.5, "duration_s": 1.5},
        {"event": "distributed_init", "time": T0 + 10, "duration_s": 0.5},
        {"event": "data_ready", "time": T0 + 10.25, "duration_s": 0.25},
        {"event": "restore", "time": T0 + 12.25, "duration_s": 2.0, "restored_step": 4},
        {"event": "compile", "time": T0 + 13.25, "duration_s": 3.0, "overlapped_restore": True},
        {"event": "step", "time": T0 + 14, "step": 5, "step_time_s": 0.75, "loss": 2.0},
    ]


def test_phases_of_a_pod_restart_add_up_to_its_time_to_first_step() -> None:
    phases = startup_phases(pod_restart_rows())
    assert phases is not None
    assert phases.start == T0 and phases.to_first_step_s == pytest.approx(14.0)
    assert phases.seconds == pytest.approx({
        "boot": 2.0, "environment": 6.0, "imports": 1.5, "distributed": 0.5, "restore": 2.0,
        # 3 s of compile from 10.25 to 13.25, of which 10.25-12.25 ran under the restore
        "compile": 1.0, "first_step": 0.75, "other": 0.25})
    assert phases.compile_overlapped_s == pytest.approx(2.0)
    assert sum(phases.seconds.values()) == pytest.approx(phases.to_first_step_s)
    assert list(phases.seconds) == list(PHASES)


def test_an_attempt_without_supervisor_instants_starts_at_process_start() -> None:
    rows = [{"event": "process_start", "time": T0},
            {"event": "distributed_init", "time": T0 + 1, "duration_s": 0.5},
            {"event": "fresh_start", "time": T0 + 2, "duration_s": 0.5},
            {"event": "compile", "time": T0 + 4, "duration_s": 2.0},
            {"event": "step", "time": T0 + 5, "step": 1, "step_time_s": 1.0}]
    phases = startup_phases(rows)
    assert phases.start == T0 and phases.to_first_step_s == 5.0
    assert phases.seconds["boot"] == phases.seconds["environment"] == 0.0
    # an older trainer's compile that followed its fresh start: nothing overlapped
    assert phases.seconds["compile"] == 2.0 and phases.compile_overlapped_s == 0.0
    assert phases.seconds["other"] == pytest.approx(1.0)  # imports and data, not timed here


def test_an_attempt_that_never_stepped_has_phases_but_no_total() -> None:
    phases = startup_phases(pod_restart_rows()[:3])
    assert phases.first_step_at is None and phases.to_first_step_s is None
    assert phases.seconds["imports"] == 1.5 and phases.seconds["other"] == 0.0
    assert startup_phases([{"event": "step", "time": T0, "step": 1}]) is None


@pytest.mark.parametrize("bad", [float("nan"), "soon", None, True, -4.0])
def test_a_malformed_instant_or_duration_is_left_out_not_fatal(bad) -> None:
    rows = pod_restart_rows()
    rows[0]["boot_at"] = bad
    rows[1]["duration_s"] = bad
    phases = startup_phases(rows)
    assert phases.seconds["boot"] == 0.0 and phases.seconds["imports"] == 0.0
    assert sum(phases.seconds.values()) == pytest.approx(phases.to_first_step_s)


def test_the_goodput_attempt_starts_when_the_process_was_launched() -> None:
    timeline = build_timeline(pod_restart_rows())
    (attempt,) = timeline.attempts
    assert attempt.start == T0 + 8  # launched_at: the interpreter and imports are the attempt's
    assert attempt.phases.to_first_step_s == pytest.approx(14.0)


def test_report_prints_and_exports_each_attempts_phases(tmp_path: Path) -> None:
    rows = pod_restart_rows()
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = build_report(str(tmp_path), write_png=False)
    text = format_report(report)
    assert ("    to first step 14.0 s: boot 2.0, environment 6.0, imports 1.5, distributed "
            "start-up 0.5, restore/init 2.0, compile 1.0, first step 0.8, other 0.2; 2.0 s of "
            "compile ran under the restore/init") in text.splitlines()
    exported = report_to_json(report)["attempts"][0]["to_first_step"]
    assert exported["seconds"] == pytest.approx(14.0)
    assert exported["phases"]["compile"] == pytest.approx(1.0)
    assert exported["compile_overlapped_s"] == pytest.approx(2.0)


def test_instants_that_contradict_each_other_are_not_split_into_negative_phases(
        tmp_path: Path) -> None:
    rows = pod_restart_rows()
    rows[-1] = {**rows[-1], "time": T0 - 5}  # a first step before its own boot: clocks disagree
    phases = startup_phases(rows)
    assert phases is not None and phases.inconsistent and phases.to_first_step_s is None
    assert all(v >= 0 for v in phases.seconds.values())
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = format_report(build_report(str(tmp_path), write_png=False))
    assert "to first step: not split" in text and "-" not in text.split("to first step")[1][:40]
