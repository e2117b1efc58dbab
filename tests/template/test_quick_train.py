"""The quick tier's share of the training template: config checks, every preset's size, one
train step, one save and one restore, with paths typed relative to the experiment directory."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.new import render_template


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return render_template("quick-model", tmp_path_factory.mktemp("quick"))


def fork_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MULTISLICE_", "XLA_"))}
    env["JAX_PLATFORMS"] = "cpu"
    return env


def run(project: Path, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=project, capture_output=True, text=True,
                          timeout=timeout, env=fork_env())


def test_config_rules_and_every_presets_parameter_count(project):
    done = run(project, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_config.py",
               "tests/test_model_contract.py::test_the_parameter_count_is_the_initialised_models")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_a_relative_run_dir_trains_saves_and_resumes(project):
    # The experiment README's first command, with the run directory as typed: relative.
    args = ["-m", "trainer.main", "--config", "tiny", "--run-dir", "runs/tiny",
            "--set", "checkpoint.save_interval_steps=1", "--set", "eval.num_batches=0"]
    first = run(project, *args, "--steps", "1")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "Traceback" not in first.stderr and "resuming" not in first.stdout + first.stderr
    run_dir = project / "runs" / "tiny"
    assert (run_dir / "checkpoints" / "1").is_dir(), sorted(run_dir.rglob("*"))[:20]

    second = run(project, *args, "--steps", "2")
    assert second.returncode == 0, second.stderr[-3000:]
    [line] = [x for x in second.stdout.splitlines() if x.startswith("resuming")]
    where = re.escape(str(project / "runs" / "tiny"))
    assert re.fullmatch(rf"resuming run {where} at checkpoint step 1 from the run directory on "
                        r"1 process\(es\), 1\.3 MiB in [0-9.]+s; to start fresh, give another "
                        r"--run-dir", line), line
    assert "restart" not in second.stdout  # a new invocation of a finished run
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["restored_step"] for r in rows if r.get("event") == "restore"] == [1]
    assert [r["step"] for r in rows if r.get("event") == "step"] == [1, 2]
