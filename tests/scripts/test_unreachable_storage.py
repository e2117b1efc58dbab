"""gs:// with storage that does not answer: one line per command, exit 2, in seconds."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from scripts.gcs import StorageUnreachable, check_reachable


@pytest.fixture
def closed_port(monkeypatch: pytest.MonkeyPatch) -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    return f"http://127.0.0.1:{port}"


def test_check_reachable_names_the_endpoint_and_the_reason(closed_port: str) -> None:
    with pytest.raises(StorageUnreachable, match=rf"gs://b/r: the storage endpoint "
                       rf"{closed_port} \(STORAGE_EMULATOR_HOST\) is not reachable "
                       r"\(Connection refused\)"):
        check_reachable("gs://b/r")


@pytest.mark.parametrize("argv", [
    ["report", "gs://bkt/runs/x"],
    ["data", "prepare", "--output", "gs://bkt/data", "--num-sentences", "100"],
    ["local", "--slices", "1", "--devices-per-slice", "1", "--run-dir", "gs://bkt/runs/x"],
], ids=["report", "data-prepare", "local"])
def test_every_gs_command_fails_in_one_line_within_seconds(closed_port: str, argv: list[str]
                                                           ) -> None:
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "scripts.cli", *argv], capture_output=True,
                          text=True, timeout=60)
    elapsed = time.monotonic() - start
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"multislice {argv[0]}") and "is not reachable" in lines[0]
    assert "Traceback" not in done.stdout + done.stderr
    assert elapsed < 30
