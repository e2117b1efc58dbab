"""The suite's shared settings: how every trainer compiles, one persistent JAX compilation cache
for every process the suite starts, and how many workers run it."""

from __future__ import annotations

import math
import os
import sys

import pytest

from scripts.emulators.tpu_image import EMULATED_JAX_CACHE_ENV, emulated_xla_flags
from tests.support.compile_cache import suite_compile_cache

# Every trainer the suite starts (in this process, under `multislice local`, in the fork's suite)
# compiles as the emulated TPU hosts do: at XLA:CPU's optimization level 0, so that a reference
# run here and a run on emulated hosts agree bit for bit, at 1.7x less compile CPU. The device
# count is each launcher's own (`multislice local` and the fork's conftest replace it).
os.environ["XLA_FLAGS"] = " ".join(
    [flag for flag in os.environ.get("XLA_FLAGS", "").split()
     if not flag.startswith(("--xla_force_host_platform_device_count",
                             "--xla_backend_optimization_level"))]
    + emulated_xla_flags(1).split())

# One JAX compilation cache for every compile of the suite: this process and its xdist peers,
# every trainer it starts (the trainer honours JAX's own JAX_COMPILATION_CACHE_DIR), the fork's
# suite, and every emulated TPU VM and GKE pod (mounted into them as uv's cache is). It outlives
# the run (tests/support/compile_cache.py says where), so a second `make test` compiles almost
# nothing. Every program is written, however fast it compiled or small it is (JAX's defaults
# skip what compiles in under a second: most of the suite's tiny programs). Tests whose subject
# is RUN_DIR/compile_cache, or the gs:// one of a boot, unset or override it.
COMPILE_CACHE = suite_compile_cache()
os.environ["JAX_COMPILATION_CACHE_DIR"] = str(COMPILE_CACHE)
os.environ[EMULATED_JAX_CACHE_ENV] = str(COMPILE_CACHE)
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"
if "jax" in sys.modules:  # imported before this file: its options read the environment once
    import jax

    jax.config.update("jax_compilation_cache_dir", str(COMPILE_CACHE))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

# Workers a core: drills wait on hosts, polls and servers, so a worker a core leaves CPU idle
# (on 2 cores, the whole suite: -n 2 left 14% idle, 19:36 and 20:59 wall; -n 3 used 95%, 18:06
# and 18:12); memory bounds it on a machine with many cores (a worker's drills peak near 4 GiB).
WORKERS_PER_CORE = 1.5
GIB_PER_WORKER = 4


def suite_workers(cores: int, memory_gib: float) -> int:
    return max(1, min(math.ceil(cores * WORKERS_PER_CORE), int(memory_gib // GIB_PER_WORKER)))


def _memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` (pyproject's addopts): what `suite_workers` gives this machine."""
    return suite_workers(len(os.sched_getaffinity(0)), _memory_gib())


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--oracle", action="store_true",
                     help="also run the differential oracles (dev-only: they install the "
                     "reference tool, such as xpk, from PyPI into a venv of their own)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "oracle: a differential oracle, run with --oracle")
    # No process outlives the suite, Ctrl-C included (tests/support/reaper.py).
    config.pluginmanager.import_plugin("tests.support.reaper")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Oracles only with --oracle. Then longest first: the fork's suite, then the other slow tests, then the quick ones. Under
    pytest -n the workers then start on what takes minutes instead of meeting it last, alone
    (collection order put tests/template/ at the very end). The order within each kind, and so
    within a module, is kept."""
    def kind(item: pytest.Item) -> int:
        if item.nodeid.startswith("tests/template/test_render.py::test_generated_project_tests"):
            return 0
        return 1 if item.get_closest_marker("slow") else 2

    if not config.getoption("--oracle"):
        skip = pytest.mark.skip(reason="a dev-only differential oracle: run with --oracle")
        for item in items:
            if item.get_closest_marker("oracle"):
                item.add_marker(skip)
    items.sort(key=kind)
