"""Two OS processes, each playing one slice of two CPU devices, train data parallel over DCN."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import xla_flags

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(num: int, devices: int, args: list[str], module: str = "trainer.main",
           shared_cache: bool = True):
    port = free_port()
    procs = []
    base = {k: v for k, v in os.environ.items()
            if shared_cache or k != "JAX_COMPILATION_CACHE_DIR"}
    for pid in range(num):
        env = dict(base, JAX_PLATFORMS="cpu",
                   XLA_FLAGS=xla_flags(devices),
                   MULTISLICE_COORDINATOR=f"127.0.0.1:{port}",
                   MULTISLICE_NUM_PROCESSES=str(num), MULTISLICE_PROCESS_ID=str(pid),
                   MULTISLICE_INIT_TIMEOUT_S="60", MULTISLICE_STEP_MARKERS="1")
        procs.append(subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outputs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=240)
        outputs.append((proc.returncode, out))
    return outputs


@pytest.mark.slow
def test_two_emulated_slices_train_with_identical_parameters(tmp_path):
    outputs = launch(2, 2, ["--config", "tiny", "--steps", "6", "--run-dir", str(tmp_path),
                            "--set", "mesh.dcn_data=2", "--expect-slices", "2",
                            "--expect-devices-per-slice", "2"], shared_cache=False)
    for code, out in outputs:
        assert code == 0, out
        assert "MULTISLICE_STEP 6" in out.splitlines()
    digests = [re.search(r"params_digest (\w+)", out).group(1) for _, out in outputs]
    assert digests[0] == digests[1]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["num_slices"], summary["devices_per_slice"]) == (2, 2)
    assert summary["params_digest"] == digests[0]
    # On CPU each process's cache key hashes its own topology: both processes wrote their own
    # entry for the step (JAX alone writes process 0's only, so process 1 recompiled every start).
    steps = sorted((tmp_path / "compile_cache").glob("jit_train_step-*"))
    assert len(steps) == 2, steps


@pytest.mark.slow
def test_expect_flags_name_the_missing_slice(tmp_path):
    outputs = launch(2, 2, ["--config", "tiny", "--steps", "1", "--run-dir", str(tmp_path),
                            "--expect-slices", "3", "--expect-devices-per-slice", "2"])
    for code, out in outputs:
        assert code == 2, out
        assert "missing slices [2]" in out
