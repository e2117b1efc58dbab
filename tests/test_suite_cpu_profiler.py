"""benchmarks/suite_cpu.py counts what a test's processes used, whoever waited for them, and
charges a fixture's servers to the fixture."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Burns `s` CPU seconds, then touches the file named by its first argument and sleeps: the test
# waits for that file, so a loaded machine only makes it wait longer.
BURN = ("import pathlib, sys, time\nend = time.process_time() + {s}\n"
        "while time.process_time() < end: pass\n"
        "pathlib.Path(sys.argv[1]).touch()\ntime.sleep(600)\n")

# A project of two tests: one starts a process that burns 1 s of CPU in a grandchild and is
# killed (never waited for: getrusage misses all of it); the other runs while a module fixture's
# server burns 1 s in the background.
PROJECT = {
    "test_burn.py": f'''
import os, signal, subprocess, sys, time
from pathlib import Path
import pytest

BURN = {BURN.format(s=1.0)!r}

def wait_for(path):
    deadline = time.monotonic() + 60
    while not path.exists():
        assert time.monotonic() < deadline, path
        time.sleep(0.05)

def test_a_killed_process_tree_is_counted(tmp_path):
    # a shell whose child burns, then the whole group killed: nobody waits for the grandchild
    done = tmp_path / "burnt"
    proc = subprocess.Popen(["bash", "-c", f"{{sys.executable}} -c '{{BURN}}' {{done}} & wait"],
                            start_new_session=True)
    wait_for(done)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    done = tmp_path_factory.mktemp("server") / "burnt"
    proc = subprocess.Popen([sys.executable, "-c", BURN, str(done)])
    yield done
    wait_for(done)
    proc.kill()
    proc.wait()

def test_beside_a_busy_server(server):
    time.sleep(0.5)
''',
}


@pytest.mark.skipif(os.geteuid() != 0 or not Path("/sys/fs/cgroup/cpuacct").is_dir(),
                    reason="counts through cgroup v1 cpuacct, which needs root")
def test_killed_trees_are_counted_and_servers_are_charged_to_their_fixture(tmp_path):
    for name, text in PROJECT.items():
        (tmp_path / name).write_text(text)
    out = tmp_path / "rows.jsonl"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "suite_cpu.py"), "--out", str(out),
         "-p", "no:cacheprovider", "-p", "no:xdist", "-q", "--rootdir", str(tmp_path),
         "-c", os.devnull, str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {row["id"].split("::")[-1]: row for row in map(json.loads, out.read_text().splitlines())}
    assert {r["method"] for r in rows.values()} == {"cgroup"}
    assert rows["test_a_killed_process_tree_is_counted"]["cpu_s"] > 0.9
    assert rows["[fixture server]"]["cpu_s"] > 0.9
    assert rows["test_beside_a_busy_server"]["cpu_s"] < 0.5
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["cpu_s"] >= summary["cpu_s_rows"] > 1.8
