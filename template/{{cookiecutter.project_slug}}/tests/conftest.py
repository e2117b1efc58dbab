"""Eight CPU devices for every test; must run before anything imports jax."""

import os

import pytest

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split()
     if not f.startswith("--xla_force_host_platform_device_count")]
    + ["--xla_force_host_platform_device_count=8"]
)
for name in ("MULTISLICE_COORDINATOR", "MULTISLICE_NUM_PROCESSES", "MULTISLICE_PROCESS_ID"):
    os.environ.pop(name, None)


@pytest.fixture(scope="session", autouse=True)
def shared_compilation_cache(tmp_path_factory: pytest.TempPathFactory):
    """One JAX compilation cache for every trainer this session starts, in-process or not: the
    same small programs compile in dozens of tests (tests/test_train.py alone: 183 s without,
    108 s with). A JAX_COMPILATION_CACHE_DIR that is already set (a team's, or the toolkit's
    suite) is kept. Tests that check RUN_DIR/compile_cache unset it."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        yield os.environ["JAX_COMPILATION_CACHE_DIR"]
        return
    shared = tmp_path_factory.mktemp("jax-compile-cache")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(shared)
    yield str(shared)
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
