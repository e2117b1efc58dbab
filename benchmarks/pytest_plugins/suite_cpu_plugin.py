"""pytest plugin of benchmarks/suite_cpu.py: one JSON line per test to $SUITE_CPU_OUT."""

from __future__ import annotations

import json
import os
import resource
import time

import pytest


def _cpu_s(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    out = os.environ.get("SUITE_CPU_OUT")
    own, children, start = _cpu_s(resource.RUSAGE_SELF), _cpu_s(resource.RUSAGE_CHILDREN), \
        time.monotonic()
    started_at = time.time()
    yield
    if not out:
        return
    row = {"id": item.nodeid, "wall_s": time.monotonic() - start,
           "cpu_s": (_cpu_s(resource.RUSAGE_SELF) - own)
           + (_cpu_s(resource.RUSAGE_CHILDREN) - children),
           # when and where it ran: which tests overlapped, and how long each worker was busy
           "start": round(started_at, 2), "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}
    with open(out, "a") as f:  # one short append per test: workers' lines do not interleave
        f.write(json.dumps(row) + "\n")
