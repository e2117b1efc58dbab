"""`multislice local` against a fake trainer: streaming, failures, drills, restarts, watchdog."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripts.local.attempt import Drill, LaunchPlan, expecting, slice_env
from scripts.local.command import parse_kill_at, parse_preempt_at, run_local
from scripts.local.supervisor import shrink_or_wait

REPO = Path(__file__).resolve().parents[2]
FAKE_TRAINER = Path(__file__).with_name("fake_trainer.py")


@pytest.fixture
def experiment(tmp_path: Path) -> Path:
    root = tmp_path / "exp"
    (root / "trainer").mkdir(parents=True)
    (root / "trainer" / "__init__.py").write_text("")
    shutil.copy(FAKE_TRAINER, root / "trainer" / "main.py")
    return root


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


def launch(experiment: Path, run_dir: Path, *trainer_args: str, slices: int = 2, **kwargs) -> int:
    return run_local(
        experiment=experiment,
        slices=slices,
        devices_per_slice=kwargs.pop("devices_per_slice", 4),
        trainer_args=list(trainer_args),
        run_dir=run_dir,
        **kwargs,
    )


def events(run_dir: Path, name: str | None = None) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "launcher.jsonl").read_text().splitlines()]
    return [r for r in rows if name is None or r["event"] == name]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purposes.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


def test_output_is_prefixed_by_slice_streamed_and_saved_per_slice(experiment, run_dir, capsys):
    code = launch(experiment, run_dir, "--steps", "5")
    out, err = capsys.readouterr()
    assert code == 0
    assert "[slice 0] step 5 loss 1.0000" in out
    assert "[slice 1] process 1 to stderr" in out  # stderr is merged into the slice's stream
    assert "MULTISLICE_STEP" not in out
    log1 = (run_dir / "logs" / "slice-1.log").read_text()
    assert "process 1: done" in log1 and "[slice" not in log1 and "MULTISLICE_STEP" not in log1
    assert "process 0: done" not in log1
    assert "summary: final step 5, final loss 1.0000, 1,234 tokens/s, MFU 1.23%, restarts 0" in err
    assert [e["status"] for e in events(run_dir, "end")] == ["succeeded"]


def test_each_slice_gets_its_identity_cpu_devices_and_keeps_user_xla_flags(
    experiment, run_dir, capsys, monkeypatch
):
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=9")
    code = launch(experiment, run_dir, "--steps", "1", "--fake-dump-env", slices=3,
                  devices_per_slice=2, init_timeout_s=7)
    out = capsys.readouterr().out
    assert code == 0
    coordinators = set()
    for i in range(3):
        lines = [ln.removeprefix(f"[slice {i}] ") for ln in out.splitlines()
                 if ln.startswith(f"[slice {i}] env ")]
        env = dict(ln.removeprefix("env ").split("=", 1) for ln in lines)
        assert env["MULTISLICE_PROCESS_ID"] == str(i)
        assert env["MULTISLICE_NUM_PROCESSES"] == "3"
        assert env["MULTISLICE_INIT_TIMEOUT_S"] == "7"
        assert env["JAX_PLATFORMS"] == "cpu"
        assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=2"
        coordinators.add(env["MULTISLICE_COORDINATOR"])
    assert len(coordinators) == 1 and coordinators.pop().startswith("127.0.0.1:")
    assert f"--run-dir {run_dir} --expect-slices 3 --expect-devices-per-slice 2" in out


def test_failing_slice_stops_the_others_and_is_named_with_its_last_lines(
    experiment, run_dir, capsys
):
    run_dir.mkdir()
    stale = run_dir / "summary.json"
    stale.write_text(json.dumps({"final_step": 999}))
    os.utime(stale, (1, 1))
    started = time.monotonic()
    # Slice 1 fails 2 s in: the others have started (and can save) even on a loaded machine,
    # where a failure 0.15 s in met a slice 2 that had not yet installed its SIGTERM handler.
    code = launch(experiment, run_dir, "--steps", "10000", "--fake-step-time", "0.05",
                  "--fake-fail", "1:40:7", slices=3)
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    assert code == 1
    assert elapsed < 17, f"took {elapsed:.1f}s to stop"
    assert "slice 1 failed (exit code 7) after step 39" in err
    assert "    process 1: failing at step 40 with code 7" in err
    assert "FAILED: slice 1 failed (exit code 7)" in err
    assert "no summary.json was written by this run" in err  # the stale one is not reported
    for i in (0, 2):  # the others were asked to stop, and did
        assert "SIGTERM, checkpoint saved" in (run_dir / "logs" / f"slice-{i}.log").read_text()
    [failure] = events(run_dir, "failure")
    assert (failure["slice"], failure["returncode"], failure["cause"]) == (1, 7, "crashed")
    assert not any(pid_alive(p) for p in events(run_dir, "launch")[0]["pids"])


def test_slice_that_ignores_sigterm_is_killed_after_the_grace_period(experiment, run_dir, capsys):
    started = time.monotonic()
    code = launch(experiment, run_dir, "--steps", "10000", "--fake-fail", "1:3:5",
                  "--fake-ignore-sigterm", stop_grace_s=1)
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    assert code == 1
    assert elapsed < 10
    assert "slice 0: still running 1s after SIGTERM (--stop-grace); sending SIGKILL" in err


def test_watchdog_stops_a_run_where_no_slice_prints(experiment, run_dir, capsys):
    started = time.monotonic()
    code = launch(experiment, run_dir, "--steps", "100", "--fake-hang=-1:3",
                  stall_timeout_s=1.5, stop_grace_s=1)
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    assert code == 3
    assert elapsed < 10
    assert "no slice printed anything for 1.5s (--stall-timeout)" in err
    assert "slice 0: step 2, slice 1: step 2" in err
    assert [e["status"] for e in events(run_dir, "end")] == ["stalled"]
    assert not any(pid_alive(p) for p in events(run_dir, "launch")[0]["pids"])


def test_kill_at_kills_the_named_slice_once_it_reports_the_step(experiment, run_dir, capsys):
    code = launch(experiment, run_dir, "--steps", "200", "--fake-step-time", "0.02",
                  kill_at=[Drill(step=4, slice=1)])
    err = capsys.readouterr().err
    assert code == 1
    [kill] = events(run_dir, "kill")
    assert (kill["slice"], kill["step"], kill["at"]) == (1, 4, "4:1")
    [failure] = events(run_dir, "failure")
    assert (failure["slice"], failure["returncode"], failure["cause"]) == (1, -9, "kill-at")
    assert "--kill-at 4:1: sent SIGKILL to slice 1" in err
    assert not (run_dir / "summary.json").exists()


def test_a_kill_drill_does_not_wait_the_grace_period_for_survivors_that_cannot_save(
        experiment, run_dir, capsys):
    # The survivor ignores SIGTERM (a real one would block in a save that needs its dead peer).
    started = time.monotonic()
    code = launch(experiment, run_dir, "--steps", "10000", "--fake-step-time", "0.02",
                  "--fake-ignore-sigterm", kill_at=[Drill(step=3, slice=1)], stop_grace_s=60)
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    assert code == 1
    assert elapsed < 20, f"waited {elapsed:.0f}s for a survivor that cannot save"
    assert "slice 0: its peer slice 1 is gone, so it cannot save a checkpoint; sending SIGKILL" \
        in err
    assert not any(pid_alive(p) for p in events(run_dir, "launch")[0]["pids"])


def test_preempt_at_sends_a_notice_and_the_preempted_run_restarts(experiment, run_dir, capsys):
    code = launch(experiment, run_dir, "--steps", "12", "--fake-ckpt-every", "2",
                  preempt_at=[Drill(step=4, slice=1)], max_restarts=1)
    err = capsys.readouterr().err
    assert code == 0
    [notice] = events(run_dir, "preempt")
    assert (notice["slice"], notice["step"], notice["at"]) == (1, 4, "4:1")
    assert "--preempt-at 4:1: sent SIGTERM to slice 1" in err
    [failure] = events(run_dir, "failure")
    assert (failure["slice"], failure["returncode"], failure["cause"]) == (1, 42, "preempted")
    [restart] = events(run_dir, "restart")
    assert "slice 1 was preempted after the --preempt-at notice (exit code 42" in restart["reason"]
    first_attempt = (run_dir / "logs" / "slice-1.log").read_text().split("attempt 1 at")[0]
    assert "process 1: SIGTERM, checkpoint saved" in first_attempt


def test_kill_at_defaults_to_slice_zero_and_rejects_malformed_values():
    assert parse_kill_at("7") == Drill(step=7, slice=0)
    assert parse_kill_at("12:3") == Drill(step=12, slice=3)
    for bad in ("x", "0", "3:-1", "3:a", "", "reform", "reform:x"):
        with pytest.raises(Exception, match="--kill-at"):
            parse_kill_at(bad)
    assert parse_preempt_at("5:1") == Drill(step=5, slice=1, preempt=True)
    assert parse_kill_at("reform:2") == Drill(step=0, slice=2)
    assert str(parse_kill_at("reform:2")) == "reform:2"
    with pytest.raises(Exception, match="--preempt-at"):
        parse_preempt_at("reform:1")


def test_a_re_formed_attempts_slices_keep_their_storage_and_number_processes_in_order(tmp_path):
    plan = LaunchPlan(experiment_dir=tmp_path, log_dir=tmp_path, slices=3, devices_per_slice=2,
                      trainer_args=("--steps", "9", "--expect-slices", "3"))
    env = slice_env(plan, 2, "127.0.0.1:1", live=(0, 2))
    assert (env["MULTISLICE_PROCESS_ID"], env["MULTISLICE_NUM_PROCESSES"],
            env["MULTISLICE_FULL_SLICES"]) == ("1", "2", "3")
    assert env["MULTISLICE_LOCAL_CHECKPOINT_DIR"] == str(tmp_path / "local" / "slice-2")
    assert expecting(plan.trainer_args, 2) == ("--steps", "9", "--expect-slices", "2")


@pytest.mark.parametrize("repairs, reforms, decision, words", [
    ([], [], "shrink", "no repair seen yet"),
    ([60.0], [], "shrink", "no re-formation measured yet"),
    # 60 s repairs, 8 s re-formations: waiting loses 68 s, shrinking 8 + 52/3 + 8 = 33 s
    ([60.0, 60.0], [8.0], "shrink", "shrinking loses 33 s of the whole job, waiting 68 s"),
    # a repair as quick as a re-formation: growing back would cost more than it saves
    ([5.0], [8.0, 8.0], "wait", "waiting loses 13 s of the whole job, shrinking 16 s"),
])
def test_the_job_shrinks_only_when_waiting_for_the_repair_would_lose_more(repairs, reforms,
                                                                          decision, words):
    got, why = shrink_or_wait(2, 3, repairs, reforms)
    assert got == decision and words in why


def test_max_restarts_restarts_every_slice_which_resume_and_finish(experiment, run_dir, capsys):
    # Slice 0 writes the fake's checkpoints, so when it reports step 5 the one of step 4 exists.
    # --slice-down-for 2: the killed slice is away 2 s, as a repair would be, and every slice
    # waits for it before the restart.
    code = launch(experiment, run_dir, "--steps", "12", "--fake-ckpt-every", "2",
                  kill_at=[Drill(step=5, slice=0)], max_restarts=2, slice_down_s=2.0)
    err = capsys.readouterr().err
    assert code == 0
    launches = events(run_dir, "launch")
    assert [e["attempt"] for e in launches] == [0, 1]  # the drill fires once per invocation
    assert launches[0]["coordinator"] != launches[1]["coordinator"]
    [repair] = events(run_dir, "repair")
    assert (repair["slice"], repair["down_s"]) == (0, 2.0)
    assert launches[1]["time"] >= repair["until"] >= repair["time"] + 2.0 - 1e-3
    assert "slice 0 is down for 2 s (--slice-down-for)" in err
    [restart] = events(run_dir, "restart")
    assert restart["attempt"] == 1 and "slice 0 was killed by the --kill-at drill" in restart["reason"]
    resumed_at = set()
    for i in (0, 1):
        log = (run_dir / "logs" / f"slice-{i}.log").read_text()
        assert log.count("===== multislice local: attempt") == 2
        second = log.split("attempt 1 at")[1]
        resumed_at.add(int(second.split("starting at step ")[1].split()[0]))
    # Every slice resumed from a checkpoint (the fake's slices do not agree on which one: they
    # read it without a barrier) instead of starting over.
    assert min(resumed_at) >= 4
    assert "restarting all 2 slices (restart 1 of 2)" in err
    assert "final step 12" in err and "restarts 1" in err


def test_max_restarts_gives_up_after_n_restarts(experiment, run_dir, capsys):
    code = launch(experiment, run_dir, "--steps", "50", "--fake-fail", "1:3:7", max_restarts=2)
    err = capsys.readouterr().err
    assert code == 1
    assert [e["attempt"] for e in events(run_dir, "launch")] == [0, 1, 2]
    assert len(events(run_dir, "restart")) == 2
    assert "giving up: restart budget spent (--max-restarts 2)" in err
    assert [e["restarts"] for e in events(run_dir, "end")] == [2]


def test_a_rejected_config_is_not_restarted(experiment, run_dir, capsys):
    code = launch(experiment, run_dir, "--steps", "6", "--fake-fail", "0:1:2", max_restarts=3)
    err = capsys.readouterr().err
    assert code == 2  # what the user gave is wrong: the launcher's bad-arguments code
    assert [e["attempt"] for e in events(run_dir, "launch")] == [0]
    assert events(run_dir, "restart") == []
    assert [e["cause"] for e in events(run_dir, "failure")] == ["misconfigured"]
    assert "not restarting: the same config would be rejected again" in err


def test_a_slice_rejecting_its_config_is_the_cause_even_when_its_peer_died_first(
        experiment, run_dir, capsys):
    # Slice 1 rejects its config but is slow to exit (a real trainer waits in JAX's shutdown
    # barrier), and slice 0 crashes first for want of it: the deterministic failure decides, so
    # nothing restarts (the same config would be rejected again).
    # Slice 0 crashes only once slice 1 ignores SIGTERM: on a loaded machine slice 1 could
    # otherwise still be starting when the supervisor stops it, and die of the signal.
    (experiment / "trainer" / "main.py").write_text(
        (experiment / "trainer" / "main.py").read_text().replace(
            "    ckpt = args.run_dir", "    if os.environ.get('FAKE_LATE_REJECT'):\n"
            "        ready = args.run_dir / 'late-reject-ready'\n"
            "        if pid == 1:\n"
            "            signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "            ready.touch()\n"
            "            time.sleep(0.5)\n"
            "            return 2\n"
            "        while not ready.exists():\n"
            "            time.sleep(0.05)\n"
            "    ckpt = args.run_dir", 1))
    os.environ["FAKE_LATE_REJECT"] = "1"
    try:
        code = launch(experiment, run_dir, "--steps", "50", "--fake-fail", "0:2:1",
                      max_restarts=3)
    finally:
        del os.environ["FAKE_LATE_REJECT"]
    err = capsys.readouterr().err
    assert code == 2
    assert events(run_dir, "restart") == [], err
    *_, failure = events(run_dir, "failure")  # the crash seen first, then the real cause
    assert (failure["cause"], failure["slice"]) == ("misconfigured", 1), failure
    assert "not restarting: the same config would be rejected again" in err


def test_a_diverged_trainer_is_not_restarted(experiment, run_dir, capsys):
    code = launch(experiment, run_dir, "--steps", "6", "--fake-fail", "1:2:3", max_restarts=3)
    err = capsys.readouterr().err
    assert code == 1
    assert [e["attempt"] for e in events(run_dir, "launch")] == [0]
    assert [e["cause"] for e in events(run_dir, "failure")] == ["diverged"]
    assert "not restarting: resuming from the last checkpoint would diverge again" in err


def test_preempted_exit_code_is_a_restartable_failure(experiment, run_dir, capsys):
    args = ("--steps", "6", "--fake-fail", "0:3:42", "--fake-fail-once")
    assert launch(experiment, run_dir, *args) == 1
    assert "slice 0 was preempted (exit code 42" in capsys.readouterr().err
    shutil.rmtree(run_dir)
    assert launch(experiment, run_dir, *args, max_restarts=1) == 0
    [restart] = events(run_dir, "restart")
    assert "slice 0 was preempted" in restart["reason"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kill_at": [Drill(3, 2)]}, "--kill-at 3:2: slice 2 does not exist; with --slices 2"),
        ({"kill_at": [Drill(30, 1)], "trainer_args": ["--steps", "20"]},
         "--kill-at 30:1: step 30 is beyond the trainer's --steps 20, so the drill would never "
         "fire; use a step from 1 to 20"),
        ({"preempt_at": [Drill(21, 0, preempt=True)], "trainer_args": ["--steps=20"]},
         "--preempt-at 21:0: step 21 is beyond the trainer's --steps 20"),
        ({"trainer_args": ["--run-dir", "x"]}, "trainer argument '--run-dir' is set by the launcher"),
        ({"run_dir": "gs://bucket"}, "--run-dir gs://bucket: expected gs://BUCKET/PATH"),
        ({"experiment": Path("/nonexistent")}, "/nonexistent has no trainer/main.py"),
        ({"slice_down_s": 30.0}, "--slice-down-for 30: without --max-restarts N the job ends "
                                 "at the first failure"),
    ],
)
def test_invalid_arguments_exit_2_with_the_value_and_what_is_allowed(
    experiment, run_dir, capsys, kwargs, message
):
    logs = run_dir.parent / "logs"
    options = {"experiment": experiment, "slices": 2, "devices_per_slice": 1,
               "trainer_args": ["--steps", "1"], "run_dir": run_dir, "log_dir": logs, **kwargs}
    assert run_local(**options) == 2
    assert message in capsys.readouterr().err
    assert not run_dir.exists() and not logs.exists()  # refused before anything is created


def start_cli(experiment: Path, run_dir: Path, *trainer_args: str) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "scripts.cli", "local", "--experiment", str(experiment),
            "--slices", "2", "--devices-per-slice", "1", "--run-dir", str(run_dir),
            "--stop-grace", "2", "--", *trainer_args]
    return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def wait_for_line(proc: subprocess.Popen[str], needle: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if needle in line:
            return
        assert line, f"launcher ended before printing {needle!r}"
    pytest.fail(f"no {needle!r} within {timeout_s}s")


def survivors(pids: list[int], timeout_s: float = 10) -> list[int]:
    """The pids still alive after timeout_s; they are killed so a failing test leaves none."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.05)
    alive = [p for p in pids if pid_alive(p)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    return alive


def test_ctrl_c_stops_every_slice_and_exits_130(experiment, run_dir):
    proc = start_cli(experiment, run_dir, "--steps", "100000", "--fake-step-time", "0.05")
    try:
        wait_for_line(proc, "[slice 0] step 2 ")
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 130, out
    assert "stopped all slices after SIGINT" in out
    assert survivors(events(run_dir, "launch")[0]["pids"]) == []
    assert [e["status"] for e in events(run_dir, "end")] == ["interrupted"]
    assert [e["cause"] for e in events(run_dir, "failure")] == ["interrupted"]
    assert "stopped: interrupted by SIGINT" in out


def test_slices_die_when_the_launcher_is_killed(experiment, run_dir):
    # The slices go silent at step 3, so no broken pipe can end them: only the kernel's
    # parent-death signal does.
    proc = start_cli(experiment, run_dir, "--steps", "100", "--fake-hang=-1:3")
    try:
        wait_for_line(proc, "[slice 0] step 2 ")
        time.sleep(1)  # both slices are in their silent step 3 by now
        pids = events(run_dir, "launch")[0]["pids"]
        assert all(pid_alive(p) for p in pids)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        proc.kill()
    assert survivors(pids) == []


@pytest.mark.slow
def test_unreachable_coordinator_fails_within_the_init_timeout(experiment, run_dir, capsys):
    # Slice 0 never starts the coordinator; slice 1 runs the real jax.distributed.initialize.
    started = time.monotonic()
    code = launch(experiment, run_dir, "--steps", "3", "--fake-jax-init", "--fake-no-coordinator",
                  devices_per_slice=1, init_timeout_s=3, stop_grace_s=2)
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    assert code == 1
    assert elapsed < 60, f"took {elapsed:.0f}s"
    assert "slice 1 failed (killed by SIGABRT) before its first step" in err
    assert "    RPC: /xla.coordination.CoordinationService/RegisterTask" in err  # not stack frames
    assert "slice 1 timed out in jax.distributed start-up" in err
    assert "MULTISLICE_INIT_TIMEOUT_S=3s" in err


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_the_summary_line_is_only_for_a_summary_this_run_wrote(where, tmp_path, monkeypatch,
                                                                capsys):
    # An earlier run's summary.json, seconds old, must not pass for this run's result: a slice
    # that rejected its config writes none (the GCS check compared clocks with 5 s of slack).
    from scripts.emulators.gcs_emulator import GcsEmulator
    from scripts.local.command import print_summary, summary_version

    def check(run_dir, write) -> None:
        write('{"final_step": 10, "final_loss": 4.4}')
        before = summary_version(run_dir)
        assert before is not None
        print_summary(run_dir, before, restarts=0)
        assert "no summary.json was written by this run" in capsys.readouterr().err
        write('{"final_step": 20, "final_loss": 3.1}')
        print_summary(run_dir, before, restarts=1)
        assert "summary: final step 20, final loss 3.1000" in capsys.readouterr().err
        print_summary(run_dir, None, restarts=0)  # none before, one now: this run's
        assert "summary: final step 20" in capsys.readouterr().err

    if where == "local":
        check(tmp_path, lambda text: (tmp_path / "summary.json").write_text(text))
        return
    with GcsEmulator() as gcs:
        gcs.create_bucket("bkt")
        for key, value in gcs.env.items():
            monkeypatch.setenv(key, value)
        assert summary_version("gs://bkt/runs/a") is None
        check("gs://bkt/runs/a",
              lambda text: gcs.put("bkt", "runs/a/summary.json", text.encode()))


def test_a_stop_the_launcher_sent_is_not_reported_as_a_preemption():
    from scripts.local.attempt import _as_stopped_by_launcher

    why = "interrupted by SIGINT"
    notifier = ("W1206 06:30:59.119323   31688 preemption_notifier.cc:90] SIGTERM caught at "
                "2026-12-06T06:30:59.119322104+00:00")
    assert _as_stopped_by_launcher(notifier, why) is None
    assert _as_stopped_by_launcher("preempted: checkpoint of step 20 saved; exit code 42",
                                   why) is None
    assert _as_stopped_by_launcher(
        "preemption notice: saved step 20; exiting with code 42 so the job is restarted", why) \
        == "stopped by the launcher (interrupted by SIGINT): step 20 saved; the same command " \
           "resumes from it"
    assert _as_stopped_by_launcher("step 20/200 loss 2.1", why) == "step 20/200 loss 2.1"
