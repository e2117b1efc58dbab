"""`multislice local` hides gloo's "all peers connected" notices but keeps them in the slice logs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from scripts.local.attempt import is_gloo_chatter
from scripts.local.command import run_local

FAKE_TRAINER = Path(__file__).with_name("fake_trainer.py")
CONNECTED = ("[Gloo] Rank {pid} is connected to 1 peer ranks. Expected number of connected peer "
             "ranks is : 1")
PARTIAL = ("[Gloo] Rank {pid} is connected to 0 peer ranks. Expected number of connected peer "
           "ranks is : 1")
MISSING = "[Gloo] Rank {pid} is NOT connected to: [9]"

_MAIN = f"""
import os, runpy
pid = os.environ["MULTISLICE_PROCESS_ID"]
for template in {[CONNECTED, PARTIAL, MISSING, CONNECTED]!r}:
    print(template.format(pid=pid), flush=True)
runpy.run_path(os.path.join(os.path.dirname(__file__), "fake.py"), run_name="__main__")
"""


@pytest.mark.parametrize(("line", "hidden"), [
    (CONNECTED.format(pid=3), True),
    ("[Gloo] Rank 12 is connected to 15 peer ranks. Expected number of connected peer ranks "
     "is : 15", True),
    (PARTIAL.format(pid=0), False),
    (MISSING.format(pid=0), False),
    # Two threads printing at once: the real interleaving seen with 2 devices per process.
    ("[Gloo] Rank 2 is connected to 3 peer ranks. Expected number of connected peer ranks is : "
     "[Gloo] Rank 3 is connected to 33", True),
    (" peer ranks. Expected number of connected peer ranks is : 3", True),
    ("33", False),
    ("step 3 loss 6.8890", False),
    ("[slice 0] " + CONNECTED.format(pid=0), False),
    ("error: " + CONNECTED.format(pid=0), False),
])
def test_only_the_exact_all_connected_notice_counts_as_chatter(line, hidden):
    assert is_gloo_chatter(line) is hidden


def test_gloo_connection_notices_are_kept_out_of_the_console_but_logged(tmp_path, capsys):
    experiment = tmp_path / "exp"
    (experiment / "trainer").mkdir(parents=True)
    (experiment / "trainer" / "__init__.py").write_text("")
    shutil.copy(FAKE_TRAINER, experiment / "trainer" / "fake.py")
    (experiment / "trainer" / "main.py").write_text(_MAIN)
    run_dir = tmp_path / "run"

    code = run_local(experiment=experiment, slices=2, devices_per_slice=1,
                     trainer_args=["--steps", "2"], run_dir=run_dir)
    out, _ = capsys.readouterr()
    assert code == 0, out
    for pid in (0, 1):
        assert f"[slice {pid}] {CONNECTED.format(pid=pid)}" not in out
        assert f"[slice {pid}] {PARTIAL.format(pid=pid)}" in out
        assert f"[slice {pid}] {MISSING.format(pid=pid)}" in out
        assert f"[slice {pid}] process {pid}: done" in out
        log = (run_dir / "logs" / f"slice-{pid}.log").read_text().splitlines()
        assert log.count(CONNECTED.format(pid=pid)) == 2
