"""`multislice local` and `multislice demo` with the real template trainer (2 slices x 2 devices;
the data-parallel run that the demo's drill is compared with, 2 x 4 as the demo runs).

The emulated multislice runs must compute what one device computes (same data order, same
initialisation, same updates, up to float reduction order), and a run whose slice is killed and
restarted must end with exactly the parameters of a run that was never interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import demo
from scripts.demo import DEMO_DEVICES_PER_SLICE
from scripts.emulators.tpu_image import emulated_xla_flags
from scripts.local.attempt import Drill
from scripts.local.command import run_local
from scripts.new import render_template
from tests.scripts.test_resume import rewound_copy

# One worker runs the whole module (pytest -n: module fixtures are per worker): its reference
# and drilled runs are made once, not once on each worker that meets one of its tests.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("local-real-trainer")]

STEPS = 12  # tiny checkpoints every 10 steps, so a kill after step 10 resumes from step 10
LOSS_RTOL = 1e-5  # measured: <1e-6 relative over 10 steps (float reduction order only)


def step_losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["event"] == "step"}


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


# Two devices a slice unless a test compares with the demo (4): every device is a Gloo rank, and
# a step of 2 slices costs about half the CPU at 2 devices a slice (measured: 0.14 vs 0.31 s).
DEVICES_PER_SLICE = 2


def run_two_slices(experiment: Path, run_dir: Path, *sets: str, steps: int = STEPS,
                   devices_per_slice: int = DEVICES_PER_SLICE, **drills) -> None:
    code = run_local(
        experiment=experiment, slices=2, devices_per_slice=devices_per_slice, run_dir=run_dir,
        trainer_args=["--config", "tiny", "--steps", str(steps),
                      *[arg for value in sets for arg in ("--set", value)]],
        stall_timeout_s=300, **drills,
    )
    assert code == 0, f"multislice local exited {code}; see {run_dir / 'logs'}"


# Two stages over DCN, one per slice (2 layers each), 4 micro-batches of 4 rows split over each
# slice's 2 devices (FSDP inside the stage); circular: 2 laps of 2 stages of 1 layer, so every
# micro-batch crosses DCN 4 times a pass and waits in stage 0's delay line between laps.
PIPELINE_OVER_DCN = ("mesh.dcn_pipeline=2", "mesh.dcn_data=1", "train.pipeline_microbatches=4")
CIRCULAR_OVER_DCN = (*PIPELINE_OVER_DCN, "train.pipeline_repeats=2")


def assert_matches_reference(losses: dict[int, float], reference: dict[int, float]) -> None:
    assert sorted(losses) == sorted(reference)
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, rel=LOSS_RTOL), f"step {step}"


@pytest.fixture(scope="module")
def experiment(tmp_path_factory: pytest.TempPathFactory) -> Path:
    project = render_template("localcheck", tmp_path_factory.mktemp("experiments"))
    # tiny with 4 layers, so that 2 stages can also run as a circular pipeline of 2 laps; every
    # run here (the demo's too) uses this experiment's tiny
    tiny = project / "configs" / "tiny.toml"
    text = tiny.read_text()
    assert "n_layers = 2\n" in text
    tiny.write_text(text.replace("n_layers = 2\n", "n_layers = 4\n"))
    return project


@pytest.fixture(scope="module")
def reference_losses(experiment: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """One process, one CPU device, no distributed runtime."""
    run_dir = tmp_path_factory.mktemp("reference")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MULTISLICE_")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=emulated_xla_flags(1))
    subprocess.run(
        [sys.executable, "-m", "trainer.main", "--config", "tiny", "--steps", str(STEPS),
         "--run-dir", str(run_dir)],
        cwd=experiment, env=env, check=True, timeout=300, capture_output=True,
    )
    losses = step_losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


@pytest.fixture(scope="module")
def data_parallel_run(experiment: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("dcn-data") / "run"
    run_two_slices(experiment, run_dir, "mesh.dcn_data=2", devices_per_slice=DEMO_DEVICES_PER_SLICE)
    return run_dir


def test_data_parallel_across_two_slices_matches_one_device(data_parallel_run, reference_losses):
    assert_matches_reference(step_losses(data_parallel_run), reference_losses)
    result = summary(data_parallel_run)
    assert (result["num_slices"], result["devices_per_slice"], result["final_step"]) == \
        (2, DEMO_DEVICES_PER_SLICE, STEPS)


def test_fsdp_across_two_slices_matches_one_device(experiment, reference_losses, tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_two_slices(experiment, run_dir, "mesh.dcn_fsdp=2", "mesh.dcn_data=1")
    assert "dcn (1, 1, 2, 1)" in capsys.readouterr().out  # (pipeline, data, fsdp, tensor)
    assert_matches_reference(step_losses(run_dir), reference_losses)


@pytest.fixture(scope="module")
def pipeline_run(experiment: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("dcn-pipeline") / "run"
    run_two_slices(experiment, run_dir, *PIPELINE_OVER_DCN)
    return run_dir


@pytest.fixture(scope="module")
def circular_run(experiment: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("dcn-circular") / "run"
    run_two_slices(experiment, run_dir, *CIRCULAR_OVER_DCN)
    return run_dir


@pytest.mark.parametrize(("run", "schedule"), [
    ("pipeline_run", "GPipe, 2 layers a stage"),
    ("circular_run", "circular, 2 blocks of 1 layer a stage"),
])
def test_a_pipeline_across_two_slices_matches_one_device(request, reference_losses, run,
                                                         schedule):
    run_dir = request.getfixturevalue(run)
    log = (run_dir / "logs" / "slice-0.log").read_text()
    assert "dcn (2, 1, 1, 1)" in log and schedule in log
    assert_matches_reference(step_losses(run_dir), reference_losses)


@pytest.mark.parametrize(("run", "sets"), [("pipeline_run", PIPELINE_OVER_DCN),
                                           ("circular_run", CIRCULAR_OVER_DCN)],
                         ids=["gpipe", "circular"])
def test_a_killed_stage_resumes_to_the_uninterrupted_pipelines_parameters(
    experiment, request, tmp_path, run, sets
):
    run_dir = tmp_path / "run"
    run_two_slices(experiment, run_dir, *sets,
                   kill_at=[Drill(step=STEPS - 1, slice=1)], max_restarts=1)
    launches = [json.loads(line) for line in (run_dir / "launcher.jsonl").read_text().splitlines()]
    assert [e["event"] for e in launches].count("launch") == 2
    uninterrupted = request.getfixturevalue(run)
    assert summary(run_dir)["params_digest"] == summary(uninterrupted)["params_digest"]
    assert step_losses(run_dir) == step_losses(uninterrupted)


# The first mesh's run to step 10 is the module's uninterrupted run of that mesh, rewound to its
# step-10 checkpoint (tiny saves every 10 steps): the same bytes a 10-step run would have left.
@pytest.mark.parametrize(("first_run", "then"), [
    ("data_parallel_run", CIRCULAR_OVER_DCN),
    ("circular_run", PIPELINE_OVER_DCN),
    ("pipeline_run", ("mesh.dcn_data=2",)),
], ids=["dcn_data-to-circular", "circular-to-gpipe", "gpipe-to-dcn_data"])
def test_a_checkpoint_reshards_between_data_and_pipeline_parallelism_over_dcn(
    experiment, reference_losses, tmp_path, request, first_run, then
):
    run_dir = rewound_copy(request.getfixturevalue(first_run), tmp_path / "run", 10)
    assert sorted(step_losses(run_dir)) == list(range(1, 11))
    run_two_slices(experiment, run_dir, *then)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["restored_step"] for r in rows if r["event"] == "restore"] == [10]
    assert [r["step"] for r in rows if r["event"] == "step"] == list(range(1, STEPS + 1))
    assert_matches_reference(step_losses(run_dir), reference_losses)


def test_demo_drill_restarts_all_slices_and_resumes_exactly(
    experiment, data_parallel_run, tmp_path, capsys
):
    run_dir = tmp_path / "demo"
    parser = argparse.ArgumentParser()
    demo.register(parser.add_subparsers())
    args = parser.parse_args(["demo", "--experiment", str(experiment), "--steps", str(STEPS),
                              "--kill-at", f"{STEPS - 1}:1:wipe", "--run-dir", str(run_dir)])
    assert args.func(args) == 0
    out, err = capsys.readouterr()
    assert f"--kill-at {STEPS - 1}:1:wipe: sent SIGKILL to slice 1" in err
    assert "its local storage" in err and "wiped, as a recreated VM's" in err
    # The demo's local tier (every 5 steps): slice 0 restored its own copy, slice 1 (wiped)
    # slice 0's, and the report says so.
    assert "from its own local copy on 1 process(es)" in out
    assert "a peer slice's local copy on 1 process(es)" in out
    assert "restored from own local copy on 1 process(es)" in out
    assert "restarting all 2 slices (restart 1 of 1)" in err
    assert f"summary: final step {STEPS}, final loss" in err and "restarts 1" in err
    assert "[demo] loss fell from" in out
    # The survivor's collective errors after its peer was killed stay in its log: no traceback
    # flood on the console, one line that says where they are.
    assert "Traceback" not in out + err, (out + err)[-4000:]
    events = [json.loads(line) for line in (run_dir / "launcher.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events].count("launch") == 2
    # The restarted run resumed from the local tier and ended bit-identical to the
    # uninterrupted run with the same mesh (tiny's dcn_data=-1 resolves to 2 slices).
    assert summary(run_dir)["params_digest"] == summary(data_parallel_run)["params_digest"]
    assert step_losses(run_dir) == step_losses(data_parallel_run)
