"""Where the test suite's time goes: CPU seconds per test and per file, subprocesses included.

    .venv/bin/python benchmarks/suite_cpu.py [--out suite-cpu.jsonl] [PYTEST ARGS...]
    .venv/bin/python benchmarks/suite_cpu.py --report suite-cpu.jsonl

On a 2-core machine `make test` is CPU-bound (user + sys is about 1.8 x the wall time), so wall
durations (`--durations`) mostly say which tests ran next to which. This runs pytest (the
project's own options and order) in a cpuacct cgroup of its own, with a plugin
(pytest_plugins/suite_cpu_plugin.py) that gives every pytest process its own cgroup and records
each test's CPU from the kernel's counter: every process the test started, the ones a drill
killed or nobody waited for included. A fixture's setup, and the servers it leaves running, are
charged to the fixture ("fixture" rows), not to the test beside them. The fork's suite, which
tests/template/test_render.py runs in a pytest of its own, inherits the plugin through
PYTEST_ADDOPTS and adds its tests under their own ids (tests/test_*.py), and its CPU is no longer
counted twice (once there, once in the toolkit's test that ran it). Without root (or cgroup v1
cpuacct) it falls back to getrusage, which misses processes a kill leaves unwaited.

The last line printed is one JSON object: total CPU seconds (the run's cgroup: everything), what
the rows account for, and the 15 costliest files (tests and their fixtures) and tests.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = Path(__file__).resolve().parent / "pytest_plugins"
sys.path.insert(0, str(PLUGINS))
from suite_cpu_plugin import CPUACCT, OUT_ENV, RUN_ENV, cgroup_cpu_s  # noqa: E402


def report(path: Path, top: int = 15) -> dict:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_file: collections.Counter[str] = collections.Counter()
    for row in rows:
        by_file[row["id"].split("::")[0]] += row["cpu_s"]
    tests = [r for r in rows if r.get("kind", "test") == "test"]
    costly = sorted(rows, key=lambda r: -r["cpu_s"])[:top]
    return {
        "tests": len(tests),
        "method": sorted({r.get("method", "rusage") for r in rows}),
        "cpu_s_rows": round(sum(r["cpu_s"] for r in rows), 1),
        "cpu_s_fixtures": round(sum(r["cpu_s"] for r in rows if r not in tests), 1),
        "wall_s_summed": round(sum(r["wall_s"] for r in tests), 1),
        "files": [{"file": f, "cpu_s": round(c, 1)} for f, c in by_file.most_common(top)],
        "tests_by_cpu": [{"id": r["id"], "cpu_s": round(r["cpu_s"], 1),
                          "wall_s": round(r["wall_s"], 1)} for r in costly],
    }


def _remove(group: Path) -> None:
    """The run's cgroups, deepest first (each is empty once its processes have ended)."""
    (CPUACCT / "cgroup.procs").write_text(str(os.getpid()))  # leave it first
    for path in sorted(group.rglob("*"), key=lambda p: -len(p.parts)) + [group]:
        if path.is_dir():
            with contextlib.suppress(OSError):
                path.rmdir()


def main(argv: list[str]) -> int:
    if argv[:1] == ["--report"]:
        print(json.dumps(report(Path(argv[1]))))
        return 0
    out = Path("suite-cpu.jsonl")
    if argv[:1] == ["--out"]:
        out, argv = Path(argv[1]), argv[2:]
    out = out.resolve()
    out.unlink(missing_ok=True)
    run = f"suite-cpu-{os.getpid()}"
    env = dict(os.environ, **{OUT_ENV: str(out), RUN_ENV: run})
    group = CPUACCT / run
    try:  # this process, so pytest and all it starts, in the run's cgroup
        group.mkdir(parents=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as err:
        print(f"no cgroup ({err}): CPU from getrusage, processes a kill leaves unwaited missed",
              file=sys.stderr)
        group = None
    # Only the plugin's own directory: every process of the run inherits this path.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PLUGINS), env.get("PYTHONPATH")]))
    env["PYTEST_ADDOPTS"] = " ".join(filter(None, [env.get("PYTEST_ADDOPTS"),
                                                   "-p suite_cpu_plugin"]))
    started = time.monotonic()
    code = subprocess.call([sys.executable, "-m", "pytest", *argv], cwd=ROOT, env=env)
    result = report(out)
    result["wall_s"] = round(time.monotonic() - started, 1)
    if group is not None:
        result["cpu_s"] = round(cgroup_cpu_s(group), 1)  # all of it: collection, xdist, tests
        _remove(group)
    result["pytest_exit"] = code
    print(json.dumps(result))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
