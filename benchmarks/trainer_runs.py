"""Shared by the benchmarks that run the real trainer: render, launch, read the timeline.

Each trainer run is a subprocess of the rendered template (`python -m trainer.main ...`, or
`multislice local` for several emulated slices); everything measured comes from the run
directory's metrics.jsonl (and launcher.jsonl), so the benchmarks time what the report reads.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from scripts.report.goodput import parse_jsonl, split_attempts  # noqa: E402

RUN_TIMEOUT_S = 900


class BenchmarkError(RuntimeError):
    """A trainer run failed or its timeline lacks what the benchmark measures."""


def render_experiment(parent: Path) -> Path:
    from scripts.new import render_template

    return render_template("bench", parent)


def prepare_data(experiment: Path, output: Path, config: str) -> Path:
    """A prepared dataset for `config` (the synthetic corpus), via `multislice data prepare`."""
    cmd = [sys.executable, "-m", "scripts.cli", "data", "prepare", "--experiment",
           str(experiment), "--config", config, "--output", str(output)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise BenchmarkError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return output


def cpu_env(devices: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MULTISLICE_")}
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    env["MULTISLICE_STEP_MARKERS"] = "1"  # first_step_seen reads them
    return env


@dataclass(frozen=True)
class RunResult:
    launched: float  # unix time the launch began (Popen, or the launcher's command)
    first_step_seen: float | None  # unix time the first MULTISLICE_STEP line arrived (1 process)
    wall_s: float


def run_trainer(experiment: Path, run_dir: Path, trainer_args: Sequence[str], *,
                slices: int = 1, devices_per_slice: int = 1) -> RunResult:
    """One trainer invocation to completion; raises BenchmarkError with the output tail."""
    if slices == 1:
        cmd = [sys.executable, "-m", "trainer.main", *trainer_args, "--run-dir", str(run_dir)]
        cwd, env = experiment, cpu_env(devices_per_slice)
    else:
        cmd = [sys.executable, "-m", "scripts.cli", "local", "--experiment", str(experiment),
               "--slices", str(slices), "--devices-per-slice", str(devices_per_slice),
               "--run-dir", str(run_dir), "--", *trainer_args]
        cwd, env = REPO, {k: v for k, v in os.environ.items() if not k.startswith("MULTISLICE_")}
    tail: deque[str] = deque(maxlen=40)
    launched = time.time()
    first_step: float | None = None
    with subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if first_step is None and line.startswith("MULTISLICE_STEP "):
                first_step = time.time()
            tail.append(line.rstrip())
        try:
            code = proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise BenchmarkError(f"timed out after {RUN_TIMEOUT_S} s: {' '.join(cmd)}") from None
    if code != 0:
        raise BenchmarkError(f"exit code {code}: {' '.join(cmd)}\n" + "\n".join(tail))
    return RunResult(launched=launched, first_step_seen=first_step, wall_s=time.time() - launched)


def read_rows(run_dir: Path, name: str = "metrics.jsonl") -> list[dict[str, Any]]:
    path = run_dir / name
    if not path.is_file():
        return []
    return parse_jsonl(path.read_text(encoding="utf-8"))[0]


def attempts(run_dir: Path) -> list[list[dict[str, Any]]]:
    """metrics.jsonl rows per trainer process start (one list per attempt)."""
    rows = read_rows(run_dir)
    if not rows:
        raise BenchmarkError(f"{run_dir / 'metrics.jsonl'} is missing or empty")
    return split_attempts(rows)


def first(rows: Sequence[dict[str, Any]], event: str) -> dict[str, Any] | None:
    return next((r for r in rows if r.get("event") == event), None)


def median(values: Sequence[float]) -> float:
    import statistics

    return statistics.median(values)
