"""`multislice local` and `multislice demo` with the real template trainer (2 slices x 4 devices).

The emulated multislice runs must compute what one device computes: same data order, same
initialisation, same updates, up to float reduction order.
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
from scripts.local import run_local
from scripts.new import render_template

pytestmark = pytest.mark.slow

STEPS = 3
LOSS_RTOL = 1e-5  # measured: <1e-6 relative over 10 steps (float reduction order only)


@pytest.fixture(scope="module")
def experiment(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return render_template("localcheck", tmp_path_factory.mktemp("experiments"))


def step_losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["event"] == "step"}


@pytest.fixture(scope="module")
def reference_losses(
    experiment: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[int, float]:
    """One process, one CPU device, no distributed runtime."""
    run_dir = tmp_path_factory.mktemp("reference")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MULTISLICE_")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.main",
            "--config",
            "tiny",
            "--steps",
            str(STEPS),
            "--run-dir",
            str(run_dir),
        ],
        cwd=experiment,
        env=env,
        check=True,
        timeout=300,
        capture_output=True,
    )
    losses = step_losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


@pytest.mark.parametrize("mesh", [["mesh.dcn_data=2"], ["mesh.dcn_fsdp=2", "mesh.dcn_data=1"]])
def test_two_emulated_slices_match_a_single_device_run(
    experiment, reference_losses, tmp_path, capsys, mesh
):
    run_dir = tmp_path / "run"
    sets = [arg for value in mesh for arg in ("--set", value)]
    code = run_local(
        experiment=experiment,
        slices=2,
        devices_per_slice=4,
        run_dir=run_dir,
        trainer_args=["--config", "tiny", "--steps", str(STEPS), *sets],
        init_timeout_s=120,
        stall_timeout_s=300,
    )
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    assert "on 2 slice(s) x 4 devices" in out
    losses = step_losses(run_dir)
    assert sorted(losses) == sorted(reference_losses)
    for step, loss in reference_losses.items():
        assert losses[step] == pytest.approx(loss, rel=LOSS_RTOL), f"step {step}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["num_slices"], summary["devices_per_slice"]) == (2, 4)


def test_demo_trains_two_slices_and_shows_falling_loss_and_summary(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    demo.register(parser.add_subparsers())
    args = parser.parse_args(["demo", "--steps", "8", "--run-dir", str(tmp_path / "demo")])
    assert args.func(args) == 0
    out, err = capsys.readouterr()
    assert "[slice 0]" in out and "[slice 1]" in out
    assert "summary: final step 8, final loss" in err
    assert "[demo] loss fell from" in out
