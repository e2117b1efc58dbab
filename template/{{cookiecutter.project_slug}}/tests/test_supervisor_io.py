"""What the trainer reads from and writes for its supervisor (start-up script, multislice local):
the instants it was launched at, and the last step it finished."""

from __future__ import annotations

import math

from trainer.runtime.launch_times import SUPERVISOR_TIMES, supervisor_times
from trainer.runtime.progress import ProgressFile

NOW = 1_800_000_000.0


def test_supervisor_instants_become_row_fields_and_bad_ones_are_left_out():
    environ = {"MULTISLICE_BOOT_AT": "1799999990.5", "MULTISLICE_SETUP_AT": "1799999992",
               "MULTISLICE_SETUP_DONE_AT": "soon", "MULTISLICE_LAUNCHED_AT": "nan",
               "UNRELATED": "1"}
    assert supervisor_times(NOW, environ) == {"boot_at": 1799999990.5, "setup_at": 1799999992.0}
    future = {"MULTISLICE_LAUNCHED_AT": str(NOW + 3600), "MULTISLICE_BOOT_AT": "-1"}
    assert supervisor_times(NOW, future) == {}
    assert set(SUPERVISOR_TIMES.values()) == {"MULTISLICE_BOOT_AT", "MULTISLICE_SETUP_AT",
                                              "MULTISLICE_SETUP_DONE_AT", "MULTISLICE_LAUNCHED_AT"}


def test_progress_file_holds_the_last_finished_step(tmp_path):
    path = tmp_path / "progress"
    progress = ProgressFile(str(path))
    progress.step(7, 0.25)
    progress.paused(3.5)  # an evaluation
    progress.paused(1.25)
    progress.step(8, 0.5)
    step, when, step_time, pause = path.read_text().split()
    assert int(step) == 8 and float(step_time) == 0.5 and math.isfinite(float(when))
    assert float(pause) == 3.5
    assert not (tmp_path / "progress.part").exists()


def test_progress_file_unset_or_unwritable_never_stops_training(tmp_path, monkeypatch):
    monkeypatch.delenv("MULTISLICE_PROGRESS_FILE", raising=False)
    ProgressFile().step(1, 0.1)  # nothing to write
    broken = ProgressFile(str(tmp_path / "missing-dir" / "progress"))
    broken.step(1, 0.1)
    assert broken.path is None  # gave up after the first failure
    broken.step(2, 0.1)
