"""pytest plugin of benchmarks/suite_cpu.py: one JSON line per test, and per fixture that costs
CPU, to $SUITE_CPU_OUT.

Each pytest process that runs tests (an xdist worker, the fork's pytest) moves itself into a
cpuacct cgroup of its own at its first test, so every process it starts counts, however it ends:
an emulated host's whole process tree, a trainer a drill kills, a daemon nobody waits for. The
kernel's counter of that cgroup, read before and after each test, is the test's CPU. A fixture's
setup is charged to the fixture, not to the test that happened to need it first; processes its
setup leaves running (a GCS emulator, an sshd) are moved into a cgroup of the fixture's own, so
their CPU is the fixture's too, not that of whichever test ran beside them ("fixture" rows: the
fixture's name and the node that requested it).

Where cgroups cannot be written (not root, no cgroup v1 cpuacct) it falls back to getrusage: the
process and the children it waited for ("method": "rusage" on every row).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import resource
import time
from pathlib import Path

import pytest

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
OUT_ENV = "SUITE_CPU_OUT"
RUN_ENV = "SUITE_CPU_RUN"  # the cgroup (under CPUACCT) of one profiled run: benchmarks/suite_cpu.py
MIN_FIXTURE_ROW_S = 0.05  # fixtures cheaper than this (tmp_path, monkeypatch) get no row


class Counter:
    """The CPU seconds of this pytest process and everything it starts."""

    def __init__(self) -> None:
        self.root: Path | None = None
        self.method = "rusage"
        self._fixtures = itertools.count()
        run = os.environ.get(RUN_ENV)
        if not run or not (CPUACCT / run).is_dir():
            return
        try:
            root = CPUACCT / run / f"pytest-{os.getpid()}"
            (root / "tests").mkdir(parents=True)
            (root / "tests" / "cgroup.procs").write_text(str(os.getpid()))
        except OSError:
            return
        self.root, self.method = root, "cgroup"

    def tests_cpu_s(self) -> float:
        if self.root is None:
            return sum(_rusage_s(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
        return cgroup_cpu_s(self.root / "tests")

    def adopt(self, pids: set[int]) -> Path | None:
        """Moves `pids` (processes a fixture's setup left running) into a cgroup of their own."""
        if self.root is None or not pids:
            return None
        group = self.root / f"fixture-{next(self._fixtures)}"
        group.mkdir()
        for pid in pids:
            with contextlib.suppress(OSError):  # it exited meanwhile
                (group / "cgroup.procs").write_text(str(pid))
        return group


def _rusage_s(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def cgroup_cpu_s(group: Path) -> float:
    """CPU seconds of every process that ever ran in `group` or under it (cpuacct.usage)."""
    return int((group / "cpuacct.usage").read_text()) / 1e9


def _descendants(root: int) -> set[int]:
    """Every live process under `root` (the kernel's per-thread lists of children)."""
    found: set[int] = set()
    todo = [root]
    while todo:
        pid = todo.pop()
        for children in Path(f"/proc/{pid}/task").glob("*/children"):
            try:
                new = {int(child) for child in children.read_text().split()} - found
            except OSError:  # it exited meanwhile
                continue
            found |= new
            todo.extend(new)
    return found


_counter: list[Counter] = []  # made at this process's first test: an xdist controller runs none
_setup_s = [0.0]  # CPU the running test's fixture setups used: charged to those fixtures
_fixtures: dict[int, tuple[str, Path | None, float]] = {}


def counter() -> Counter | None:
    if not os.environ.get(OUT_ENV):
        return None
    if not _counter:
        _counter.append(Counter())
    return _counter[0]


def _write(row: dict) -> None:
    row["worker"] = os.environ.get("PYTEST_XDIST_WORKER", "")
    with open(os.environ[OUT_ENV], "a") as f:  # one short append a row: no interleaving
        f.write(json.dumps(row) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest):
    count = counter()
    if count is None:
        yield
        return
    before_pids, before_s = _descendants(os.getpid()), count.tests_cpu_s()
    yield
    setup_s = count.tests_cpu_s() - before_s
    _setup_s[0] += setup_s
    where = request.node.nodeid or fixturedef.baseid or "conftest.py"
    _fixtures[id(fixturedef)] = (f"{where}::[fixture {fixturedef.argname}]",
                                 count.adopt(_descendants(os.getpid()) - before_pids), setup_s)


def pytest_fixture_post_finalizer(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest):
    entry, count = _fixtures.pop(id(fixturedef), None), counter()
    if entry is None or count is None:
        return
    name, group, setup_s = entry
    cpu_s = setup_s + (cgroup_cpu_s(group) if group is not None else 0.0)
    if cpu_s >= MIN_FIXTURE_ROW_S:
        _write({"id": name, "kind": "fixture", "cpu_s": cpu_s, "wall_s": 0.0,
                "method": count.method})


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    count = counter()
    if count is None:
        yield
        return
    _setup_s[0] = 0.0
    cpu, start, started_at = count.tests_cpu_s(), time.monotonic(), time.time()
    yield
    _write({"id": item.nodeid, "kind": "test", "wall_s": time.monotonic() - start,
            "cpu_s": count.tests_cpu_s() - cpu - _setup_s[0], "method": count.method,
            # when it ran: which tests overlapped, and how long each worker was busy
            "start": round(started_at, 2)})
