"""One JAX compilation cache for every trainer the suite starts (drills, resumes, boots on the
toolkit's interpreter): the same tiny programs are compiled in dozens of processes, and the
trainer honours JAX's own JAX_COMPILATION_CACHE_DIR. Tests that check RUN_DIR/compile_cache
unset it."""

from __future__ import annotations

import os

import pytest

from scripts.emulators.tpu_image import emulated_xla_flags

# Every trainer the suite starts (in this process, under `multislice local`, in the fork's suite)
# compiles as the emulated TPU hosts do: at XLA:CPU's optimization level 0, so that a reference
# run here and a run on emulated hosts agree bit for bit, at 1.7x less compile CPU. The device
# count is each launcher's own (`multislice local` and the fork's conftest replace it).
os.environ["XLA_FLAGS"] = " ".join(
    [flag for flag in os.environ.get("XLA_FLAGS", "").split()
     if not flag.startswith(("--xla_force_host_platform_device_count",
                             "--xla_backend_optimization_level"))]
    + emulated_xla_flags(1).split())


@pytest.fixture(scope="session", autouse=True)
def shared_compilation_cache(tmp_path_factory: pytest.TempPathFactory):
    # The parent of this worker's base directory is shared by every pytest -n worker.
    root = tmp_path_factory.getbasetemp()
    shared = (root.parent if root.name.startswith("popen-") else root) / "jax-compile-cache"
    shared.mkdir(exist_ok=True)
    before = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(shared)
    yield shared
    if before is None:
        os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
    else:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = before


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--oracle", action="store_true",
                     help="also run the differential oracles (dev-only: they install the "
                     "reference tool, such as xpk, from PyPI into a venv of their own)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "oracle: a differential oracle, run with --oracle")


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
