"""The README's workflow commands, typed as the README has them, from a fresh project: the
experiment the example stacks name, then each example stack's trainer under `multislice local
--stack-config` (as shipped: an 85M-parameter model, 10,000 steps), each to its first training
step. The quick start's `make demo` is tests/scripts/test_local_real_trainer.py's demo drill; the
rehearsal of a shipped stack is tests/infra/test_startup_script.py's."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.examples import EXAMPLE_STACKS

ROOT = Path(__file__).resolve().parents[2]
MULTISLICE = str(ROOT / ".venv" / "bin" / "multislice")
# Every example that trains (a GKE capacity stack runs no experiment: local refuses it in one
# line, tests/scripts/test_rehearse.py).
STACKS = sorted(p.name for p in EXAMPLE_STACKS if "multislice:experiment_dir" in p.read_text())


def _first_step(cmd: str, cwd: Path, run_dir: Path, timeout_s: float = 400) -> float:
    """Run `cmd` as a shell would, until its run directory has a step row; then Ctrl-C.
    Returns the seconds from typing to that step."""
    started = time.time()
    proc = subprocess.Popen(cmd, shell=True, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={k: v for k, v in os.environ.items()
                                 if not k.startswith("MULTISLICE_")})
    metrics = run_dir / "metrics.jsonl"
    try:
        while time.time() - started < timeout_s:
            if metrics.is_file() and any(json.loads(line).get("event") == "step"
                                         for line in metrics.read_text().splitlines()
                                         if line.strip().startswith("{")):
                return time.time() - started
            if proc.poll() is not None:
                break
            time.sleep(0.5)
        out = proc.communicate(timeout=60)[0] if proc.poll() is not None else ""
        raise AssertionError(f"{cmd!r}: no training step (exit {proc.returncode}):\n{out[-4000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.slow  # one trainer start and compile for each example stack
def test_the_readmes_workflow_commands_train_every_example_stack_as_typed(tmp_path):
    readme = (ROOT / "README.md").read_text()
    new = "multislice new my-model"
    assert f"`{new}`" in readme
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(ROOT / "Pulumi.yaml", project)
    shutil.copytree(ROOT / "stacks", project / "stacks")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MULTISLICE_")}
    done = subprocess.run(f"{MULTISLICE} {new.removeprefix('multislice ')}", shell=True,
                          cwd=project, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    times = {}
    for stack in STACKS:
        typed = f"multislice local --stack-config stacks/{stack}"
        if stack == "Pulumi.seed-v5e.yaml":
            assert f"`{typed}`" in readme
        name = stack.removeprefix("Pulumi.").removesuffix(".yaml")
        run_dirs = project / "runs"
        before = set(run_dirs.iterdir()) if run_dirs.exists() else set()
        # the run directory the command names for itself: runs/local-stack-STACK-SxD
        cmd = f"{MULTISLICE} {typed.removeprefix('multislice ')}"
        slices = "1x4" if name == "single-v4" else "2x4"
        times[name] = _first_step(cmd, project, run_dirs / f"local-stack-{name}-{slices}")
        assert set(run_dirs.iterdir()) - before == {run_dirs / f"local-stack-{name}-{slices}"}
    print("\ntyping to the first step: " + ", ".join(f"{k} {v:.1f}s" for k, v in times.items()))
