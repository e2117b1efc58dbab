"""Where the test suite's time goes: CPU seconds per test and per file, subprocesses included.

    .venv/bin/python benchmarks/suite_cpu.py [--out suite-cpu.jsonl] [PYTEST ARGS...]
    .venv/bin/python benchmarks/suite_cpu.py --report suite-cpu.jsonl

On a 2-core machine `make test` is CPU-bound (user + sys is about 1.8 x the wall time), so wall
durations (`--durations`) mostly say which tests ran next to which. This runs pytest (the
project's own options: -n 2, the suite's order) with a plugin that records, for every test, its
wall time and the CPU time of its worker process plus every child process it waited for (the
trainers, emulated hosts and servers a test starts: RUSAGE_CHILDREN). The fork's suite, which
tests/template/test_render.py runs in a pytest of its own, inherits the plugin through
PYTEST_ADDOPTS and adds its tests under their own ids (tests/test_*.py). Servers a module fixture
keeps are charged to the test during which they exit.

The last line printed is one JSON object: total CPU seconds, the sum of wall times, and the
15 costliest files and tests.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = Path(__file__).resolve().parent / "pytest_plugins"
OUT_ENV = "SUITE_CPU_OUT"


def report(path: Path, top: int = 15) -> dict:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_file: collections.Counter[str] = collections.Counter()
    for row in rows:
        by_file[row["id"].split("::")[0]] += row["cpu_s"]
    costly = sorted(rows, key=lambda r: -r["cpu_s"])[:top]
    return {
        "tests": len(rows),
        "cpu_s": round(sum(r["cpu_s"] for r in rows), 1),
        "wall_s_summed": round(sum(r["wall_s"] for r in rows), 1),
        "files": [{"file": f, "cpu_s": round(c, 1)} for f, c in by_file.most_common(top)],
        "tests_by_cpu": [{"id": r["id"], "cpu_s": round(r["cpu_s"], 1),
                          "wall_s": round(r["wall_s"], 1)} for r in costly],
    }


def main(argv: list[str]) -> int:
    if argv[:1] == ["--report"]:
        print(json.dumps(report(Path(argv[1]))))
        return 0
    out = Path("suite-cpu.jsonl")
    if argv[:1] == ["--out"]:
        out, argv = Path(argv[1]), argv[2:]
    out = out.resolve()
    out.unlink(missing_ok=True)
    env = dict(os.environ, **{OUT_ENV: str(out)})
    # Only the plugin's own directory: every process of the run inherits this path.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PLUGINS), env.get("PYTHONPATH")]))
    env["PYTEST_ADDOPTS"] = " ".join(filter(None, [env.get("PYTEST_ADDOPTS"),
                                                   "-p suite_cpu_plugin"]))
    started = time.monotonic()
    code = subprocess.call([sys.executable, "-m", "pytest", *argv], cwd=ROOT, env=env)
    result = report(out)
    result["wall_s"] = round(time.monotonic() - started, 1)
    result["pytest_exit"] = code
    print(json.dumps(result))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
