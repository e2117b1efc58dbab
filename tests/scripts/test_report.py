"""`multislice report`: goodput arithmetic on synthetic timelines, errors, the PNG, the CLI."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from scripts.cli import main as cli_main
from scripts.report import command as report_cmd
from scripts.report.command import ReportError, build_report, format_report, report_to_json
from scripts.report.goodput import CATEGORIES, build_timeline

T0 = 1000.0


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def step(t: float, n: int, seconds: float = 1.0, loss: float | None = None) -> dict:
    return {"event": "step", "time": t, "step": n, "step_time_s": seconds,
            "loss": 5.0 - 0.1 * n if loss is None else loss, "tokens_per_s": 1.0}


def restart_run() -> tuple[list[dict], list[dict]]:
    """Two attempts; the first is killed after step 6 and the second resumes from step 4.

    Attempt 0 (t=1000..1016.25): start-up 1000-1003.5 (distributed init, data, fresh state),
    compile 1003.5-1010, steps 1-6 of 1 s each ending 1011..1016, a save blocking 1014-1014.5
    (inside step 5), killed at 1016.25. Idle until attempt 1 starts at 1020: start-up 1020-1021.5,
    restore of step 4 1021.5-1022.5, compile 1022.5-1024, steps 5-8 ending 1025..1028, the last
    save blocking 1028-1028.25 and its commit wait 1028.25-1028.75, the launcher's end at 1029.
    """
    metrics = [
        {"event": "process_start", "time": T0},
        {"event": "distributed_init", "time": T0 + 2, "duration_s": 1.5, "mode": "single"},
        {"event": "data_ready", "time": T0 + 3, "duration_s": 1.0, "prepared": True},
        {"event": "fresh_start", "time": T0 + 3.5, "duration_s": 0.5},
        {"event": "compile", "time": T0 + 10, "duration_s": 6.5},
        *[step(T0 + 10 + n, n) for n in range(1, 5)],
        {"event": "checkpoint", "time": T0 + 14.5, "step": 4, "blocking_s": 0.5,
         "duration_s": 0.5},
        step(T0 + 15, 5), step(T0 + 16, 6),
        {"event": "process_start", "time": T0 + 20},
        {"event": "distributed_init", "time": T0 + 21, "duration_s": 0.8},
        {"event": "data_ready", "time": T0 + 21.5, "duration_s": 0.5, "prepared": False},
        {"event": "restore", "time": T0 + 22.5, "duration_s": 1.0, "restored_step": 4},
        {"event": "restart", "time": T0 + 22.5, "last_step": 6, "restored_step": 4,
         "steps_recomputed": 2},
        {"event": "compile", "time": T0 + 24, "duration_s": 1.5},
        *[step(T0 + 20 + n, n, loss=1.0 + n) for n in range(5, 9)],
        {"event": "checkpoint", "time": T0 + 28.25, "step": 8, "blocking_s": 0.25},
        {"event": "checkpoint_wait", "time": T0 + 28.75, "duration_s": 0.5},
        {"event": "end", "time": T0 + 28.8, "final_step": 8, "duration_s": 8.8},
    ]
    launcher = [
        {"event": "launch", "time": T0 - 0.5, "attempt": 0},
        {"event": "kill", "time": T0 + 16.25, "slice": 0, "step": 6},
        {"event": "failure", "time": T0 + 16.5, "attempt": 0, "cause": "kill-at"},
        {"event": "restart", "time": T0 + 18, "attempt": 1},
        {"event": "launch", "time": T0 + 18.5, "attempt": 1},
        {"event": "end", "time": T0 + 29, "status": "succeeded"},
    ]
    return metrics, launcher


def test_restart_run_goodput_matches_the_hand_computed_breakdown() -> None:
    timeline = build_timeline(*restart_run())
    assert timeline.wall_s == pytest.approx(29.0)
    expected = {
        "productive": 8.0,   # steps 1-4 of attempt 0, steps 5-8 of attempt 1
        "startup": 5.0,      # 3.5 + 1.5
        "compile": 8.0,      # 6.5 + 1.5
        "restore": 1.0,
        "checkpoint": 1.25,  # 0.5, then 0.25 + the 0.5 s commit wait at the end
        "lost": 1.75,        # steps 5-6 of attempt 0 (2 s less the 0.5 s save) + 0.25 s to the kill
        "idle": 3.75,        # the kill at 1016.25 to the restart's process start at 1020
        "repair": 0.0,       # no --slice-down-for wait
        "other": 0.25,       # after the commit wait until the launcher's end
    }
    assert timeline.seconds == pytest.approx(expected)
    assert sum(timeline.seconds.values()) == pytest.approx(timeline.wall_s)
    assert timeline.goodput == pytest.approx(8.0 / 29.0)
    assert timeline.steps_recomputed == 2
    assert [(s.attempt, s.step) for s in timeline.steps if s.lost] == [(0, 5), (0, 6)]


def test_a_repair_wait_is_its_own_part_of_the_gap_between_attempts() -> None:
    # `multislice local --slice-down-for 3` after the kill at 1016.25: the launcher waited
    # 1016.5-1019.5 for the slice to come back; the rest of the gap to 1020 stays idle.
    metrics, launcher = restart_run()
    launcher.insert(3, {"event": "repair", "time": T0 + 16.5, "slice": 0, "down_s": 3.0,
                        "until": T0 + 19.5})
    timeline = build_timeline(metrics, launcher)
    assert timeline.seconds["repair"] == pytest.approx(3.0)
    assert timeline.seconds["idle"] == pytest.approx(0.75)
    assert sum(timeline.seconds.values()) == pytest.approx(timeline.wall_s)
    assert [s.category for s in timeline.idle_segments] == ["idle", "repair", "idle"]
    assert "waiting for a slice's repair" in format_report(build_report_from(metrics, launcher))


def build_report_from(metrics: list[dict], launcher: list[dict]):
    import tempfile

    with tempfile.TemporaryDirectory() as run:
        write_jsonl(Path(run) / "metrics.jsonl", metrics)
        write_jsonl(Path(run) / "launcher.jsonl", launcher)
        return build_report(run)


def test_attempts_record_where_they_started_and_how_they_ended() -> None:
    first, second = build_timeline(*restart_run()).attempts
    assert (first.restored_step, first.first_step, first.last_step, first.crashed) == (0, 1, 6, True)
    assert first.end == pytest.approx(T0 + 16.25)
    assert (second.restored_step, second.first_step, second.last_step) == (4, 5, 8)
    assert not second.crashed
    assert second.seconds["productive"] == pytest.approx(4.0)
    assert second.seconds["idle"] == 0.0
    covered = sum(s.seconds for a in (first, second) for s in a.segments)
    idle = sum(s.seconds for s in build_timeline(*restart_run()).idle_segments)
    assert covered + idle == pytest.approx(29.0)


def test_checkpoint_blocking_inside_a_step_is_not_counted_twice() -> None:
    metrics = [
        {"event": "process_start", "time": T0},
        step(T0 + 2, 1, seconds=2.0),  # 1000-1002, with a save blocking 1001.0-1001.5 inside it
        {"event": "checkpoint", "time": T0 + 1.5, "step": 1, "blocking_s": 0.5},
    ]
    seconds = build_timeline(metrics).seconds
    assert seconds["checkpoint"] == pytest.approx(0.5)
    assert seconds["productive"] == pytest.approx(1.5)
    assert sum(seconds.values()) == pytest.approx(2.0)


def test_without_launcher_the_gap_runs_from_the_last_row_to_the_next_start() -> None:
    metrics, _ = restart_run()
    timeline = build_timeline(metrics)
    assert timeline.seconds["idle"] == pytest.approx(4.0)  # last row 1016 to restart 1020
    assert timeline.seconds["lost"] == pytest.approx(1.5)  # no crash tail known
    assert timeline.wall_s == pytest.approx(28.8)           # ends with the trainer's end row


def test_a_restart_without_a_checkpoint_loses_every_earlier_step() -> None:
    metrics = [
        {"event": "process_start", "time": T0},
        *[step(T0 + n, n) for n in range(1, 4)],
        {"event": "process_start", "time": T0 + 5},
        *[step(T0 + 5 + n, n) for n in range(1, 4)],
    ]
    timeline = build_timeline(metrics)
    assert timeline.steps_recomputed == 3
    assert timeline.seconds["lost"] == pytest.approx(3.0)
    assert timeline.seconds["productive"] == pytest.approx(3.0)
    assert timeline.attempts[1].restored_step == 0  # inferred from its first step row


def test_a_later_rollback_below_an_intermediate_restore_loses_the_middle_attempt_too() -> None:
    metrics = [
        {"event": "process_start", "time": T0}, *[step(T0 + n, n) for n in range(1, 6)],
        {"event": "process_start", "time": T0 + 10},
        {"event": "restore", "time": T0 + 11, "duration_s": 1.0, "restored_step": 4},
        step(T0 + 12, 5), step(T0 + 13, 6),
        {"event": "process_start", "time": T0 + 20},
        {"event": "restore", "time": T0 + 21, "duration_s": 1.0, "restored_step": 2},
        *[step(T0 + 19 + n, n) for n in range(3, 7)],
    ]
    timeline = build_timeline(metrics)
    lost = sorted((s.attempt, s.step) for s in timeline.steps if s.lost)
    assert lost == [(0, 3), (0, 4), (0, 5), (1, 5), (1, 6)]


def test_rows_of_a_trainer_without_process_start_still_add_up() -> None:
    metrics = [
        {"event": "compile", "time": T0 + 2, "duration_s": 2.0},
        {"event": "restore", "time": T0 + 3, "duration_s": 1.0, "restored_step": 10},
        step(T0 + 4, 11), step(T0 + 5, 12),
    ]
    timeline = build_timeline(metrics)
    assert timeline.start == T0  # the compile row's start
    assert timeline.seconds["compile"] == pytest.approx(2.0)
    assert timeline.seconds["restore"] == pytest.approx(1.0)  # restored step 10
    assert timeline.seconds["productive"] == pytest.approx(2.0)
    assert timeline.attempts[0].restored_step == 10


def test_every_category_is_reported_even_when_zero() -> None:
    timeline = build_timeline([{"event": "process_start", "time": T0}, step(T0 + 1, 1)])
    assert set(timeline.seconds) == set(CATEGORIES)
    assert timeline.goodput == pytest.approx(1.0)


def test_report_reads_both_files_and_takes_the_final_loss_from_the_kept_lineage(
    tmp_path: Path,
) -> None:
    metrics, launcher = restart_run()
    write_jsonl(tmp_path / "metrics.jsonl", metrics)
    write_jsonl(tmp_path / "launcher.jsonl", launcher)
    report = build_report(str(tmp_path), write_png=False)
    assert report.goodput == pytest.approx(8.0 / 29.0)
    assert report.restarts == 1
    assert (report.final_step, report.final_loss) == (8, 9.0)
    text = format_report(report)
    assert "goodput 27.6%" in text
    assert "work lost to restarts (2 steps recomputed)" in text
    # the launcher's kill-at drill stands for a node going away
    assert "attempt 1 after a disruption: from step 4, steps 5-8" in text


def test_the_values_a_model_reports_are_shown_beside_the_final_loss(tmp_path: Path) -> None:
    # A variant's auxiliary losses and metrics (trainer/model/aux.py) ride on its step rows
    # under their own names; the report shows the kept lineage's last, with no list to keep.
    metrics, launcher = restart_run()
    for row in metrics:
        if row["event"] == "step":
            row.update(load_balance=2.0 + row["step"], cross_entropy=row["loss"] - 0.5,
                       grad_norm=1.0, mfu=None)
    write_jsonl(tmp_path / "metrics.jsonl", metrics)
    write_jsonl(tmp_path / "launcher.jsonl", launcher)
    report = build_report(str(tmp_path), write_png=False)
    assert report.final_values == {"cross_entropy": 8.5, "load_balance": 10.0}
    assert "final step 8, final loss 9.0000 (cross_entropy 8.5, load_balance 10)" in \
        format_report(report)
    assert report_to_json(report)["final_values"] == report.final_values


def test_a_row_cut_short_by_a_kill_is_skipped_and_counted(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "metrics.jsonl", [{"event": "process_start", "time": T0},
                                             step(T0 + 1, 1)])
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"event": "step", "time": 1002.0, "st')
    report = build_report(str(tmp_path), write_png=False)
    assert report.skipped_lines == 1
    assert report.final_step == 1


def test_a_file_as_run_dir_is_named_as_not_a_directory(tmp_path: Path) -> None:
    afile = tmp_path / "metrics.jsonl"
    afile.write_text("{}\n")
    with pytest.raises(ReportError, match=rf"^{afile} is a file, not a directory; pass the run "):
        build_report(str(afile))


@pytest.mark.parametrize(("content", "message"), [
    (b'{"event": "step", "time": 1}\nnot json at all\n{"time": "x"}\n',
     None),  # one good row: the report is made and names the first bad line
    (b"garbage\n[1, 2]\n", r"no JSON rows with a numeric time \(2 unreadable lines; line 1 is "
                            r"not a JSON object with a numeric time: 'garbage'\)"),
    (b'{"time": 1}\n\xff\xfe\n', r"metrics.jsonl is not UTF-8 text \(line 2, byte 12\)"),
])
def test_unreadable_metrics_name_the_line(tmp_path: Path, content: bytes, message) -> None:
    (tmp_path / "metrics.jsonl").write_bytes(content)
    if message is None:
        report = build_report(str(tmp_path), write_png=False)
        assert report.skipped_lines == 2
        assert "line 2 is not a JSON object with a numeric time: 'not json at all'" in \
            format_report(report)
        return
    with pytest.raises(ReportError, match=message):
        build_report(str(tmp_path), write_png=False)


def test_missing_metrics_error_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ReportError, match=rf"{tmp_path}/metrics.jsonl does not exist"):
        build_report(str(tmp_path))


def test_missing_run_dir_error_names_the_directory(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ReportError, match=rf"run directory {missing} does not exist"):
        build_report(str(missing))


def test_empty_metrics_error_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ReportError, match=rf"{tmp_path}/metrics.jsonl is empty"):
        build_report(str(tmp_path))


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_report_png_is_a_valid_png_of_reasonable_size(tmp_path: Path) -> None:
    metrics, launcher = restart_run()
    write_jsonl(tmp_path / "metrics.jsonl", metrics)
    write_jsonl(tmp_path / "launcher.jsonl", launcher)
    report = build_report(str(tmp_path))
    assert report.png_path == f"{tmp_path}/report.png"
    data = (tmp_path / "report.png").read_bytes()
    width, height = png_size(data)
    assert 600 <= width <= 2000 and 600 <= height <= 2000
    assert 10_000 < len(data) < 2_000_000
    assert data.endswith(b"IEND\xaeB`\x82")


def test_cli_json_output_and_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    metrics, launcher = restart_run()
    write_jsonl(tmp_path / "metrics.jsonl", metrics)
    write_jsonl(tmp_path / "launcher.jsonl", launcher)
    assert cli_main(["report", str(tmp_path), "--json", "--no-png"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["goodput"] == pytest.approx(8.0 / 29.0)
    assert out["badput_s"]["idle"] == pytest.approx(3.75)
    assert out["steps_recomputed"] == 2 and out["restarts"] == 1
    assert out["png"] is None and not (tmp_path / "report.png").exists()

    assert cli_main(["report", str(tmp_path / "absent")]) == report_cmd.EXIT_ERROR
    assert "absent does not exist" in capsys.readouterr().err


def test_a_completed_run_started_again_later_is_not_idle_and_restarts_are_told_by_cause():
    metrics, launcher = restart_run()
    assert build_timeline(metrics, launcher).attempts[1].cause == "disruption"  # kill-at drill
    launcher = [{**e, "cause": "crashed"} if e["event"] == "failure" else e for e in launcher]
    finished = metrics[-1]["time"]
    later = finished + 3600  # an hour after it completed, an edit adds steps
    spec = {"event": "distributed_init", "duration_s": 0.5, "mode": "tpu",
            "spec_generation": "2"}
    more = [
        {"event": "process_start", "time": later},
        {**spec, "time": later + 1},
        {"event": "restore", "time": later + 2, "duration_s": 0.5, "restored_step": 8},
        step(later + 3, 9), step(later + 4, 10),
        {"event": "preempted", "time": later + 4.5, "step": 10},   # a spot preemption
        {"event": "process_start", "time": later + 10},
        {**spec, "time": later + 11},
        {"event": "restore", "time": later + 12, "duration_s": 0.5, "restored_step": 10},
        step(later + 13, 11),
        {"event": "preempted", "time": later + 13.5, "step": 11},  # an edit stops it ...
        {"event": "process_start", "time": later + 20},
        {**spec, "time": later + 21, "spec_generation": "3"},       # ... on a new spec
        step(later + 23, 12),
        {"event": "end", "time": later + 24, "final_step": 12, "duration_s": 4},
    ]
    tl = build_timeline(metrics + more, launcher)
    assert [a.cause for a in tl.attempts] == [None, "crash", "new run", "disruption", "edit"]
    assert tl.restarts_by_cause() == {"disruption": 1, "crash": 1, "edit": 1}
    # the hour after the completed run is outside the wall time, and no badput
    assert tl.between_runs_s == pytest.approx(later - finished)
    assert tl.wall_s == pytest.approx(later + 24 - T0 - (later - finished))
    assert tl.seconds["idle"] < 20 and sum(tl.seconds.values()) == pytest.approx(tl.wall_s)


def test_a_figure_path_that_cannot_be_written_is_one_line(tmp_path: Path, capsys) -> None:
    metrics, launcher = restart_run()
    write_jsonl(tmp_path / "metrics.jsonl", metrics)
    (tmp_path / "a-file").write_text("")
    assert cli_main(["report", str(tmp_path), "--png", str(tmp_path / "a-file" / "r.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("multislice report: error: --png ") and "Not a directory" in err
    assert "\n" not in err


def test_each_attempt_says_where_its_state_came_from_and_what_it_lost() -> None:
    rows, launcher = restart_run()
    rows = [dict(r) for r in rows]
    restore = next(r for r in rows if r["event"] == "restore")
    restore.update(tier="peer", processes_local=1, bytes_local=3 * 2**20, processes_peer=1,
                   bytes_peer=3 * 2**20, processes_bucket=0, bytes_bucket=0)
    first, second = build_timeline(rows, launcher).attempts
    assert first.restore is None  # a fresh start
    assert second.restore is not None and second.restore.tier == "peer"
    assert second.restore.describe() == (
        "restored from own local copy on 1 process(es), 3.0 MiB; a peer slice's local copy on "
        "1 process(es), 3.0 MiB in 1.0 s; 2 step(s) of work lost")
    # A trainer from before the local tier recorded no tier: its checkpoints, nothing more.
    restore.pop("tier")
    for key in [k for k in restore if k.startswith(("processes_", "bytes_"))]:
        restore.pop(key)
    older = build_timeline(rows, launcher).attempts[1].restore
    assert older.tier == "bucket"
    assert older.describe() == ("restored from its checkpoints (tiers not recorded) in 1.0 s; 2 "
                                "step(s) of work lost")
