"""The small 2-slice run that the resume drills (tests/scripts/test_resume.py and
test_resume_gcs.py) launch under `multislice local`, and their one shared uninterrupted reference
(tests/scripts/conftest.py): both modules compare against the same run, made once."""

from __future__ import annotations

from pathlib import Path

from scripts.local.attempt import Drill
from scripts.local.command import run_local

STEPS = 16
INTERVAL = 4
# The tiny preset made smaller still, so each emulated run takes seconds.
SMALL = ("model.d_model=32", "model.n_heads=2", "model.d_ff=64", "model.n_layers=1",
         "model.seq_len=32", "train.global_batch_size=8", f"checkpoint.save_interval_steps={INTERVAL}",
         "checkpoint.max_to_keep=8", "metrics.log_every=4")


def launch(experiment: Path, run_dir: Path, data_dir: Path, *, slices: int = 2, devices: int = 2,
           kill_at: tuple[Drill, ...] = (), preempt_at: tuple[Drill, ...] = (),
           max_restarts: int = 0, stop_grace_s: float = 2, extra: tuple[str, ...] = ()) -> int:
    values = (*SMALL, f"data.path={data_dir}", "data.prepare_if_missing=true", *extra)
    sets = [arg for value in values for arg in ("--set", value)]
    return run_local(
        experiment=experiment, slices=slices, devices_per_slice=devices, run_dir=run_dir,
        trainer_args=["--config", "tiny", "--steps", str(STEPS), *sets], kill_at=kill_at,
        preempt_at=preempt_at, max_restarts=max_restarts, init_timeout_s=120,
        stall_timeout_s=240, stop_grace_s=stop_grace_s,
    )
