"""Eight CPU devices for every test; must run before anything imports jax."""

import os

import pytest

os.environ["JAX_PLATFORMS"] = "cpu"
# The tests' programs are tiny: at XLA:CPU's LLVM optimization level 0 they compile in about
# 1.7x less CPU time and run about 2x slower, which the suite gains on (its time is compiles).
# An optimization level already in XLA_FLAGS is kept.
_FLAGS = [f for f in os.environ.get("XLA_FLAGS", "").split()
          if not f.startswith("--xla_force_host_platform_device_count")]
if not any(f.startswith("--xla_backend_optimization_level") for f in _FLAGS):
    _FLAGS.append("--xla_backend_optimization_level=0")


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a trainer process of `devices` CPU devices, compiled as this session's (a
    child's results then agree bit for bit with the ones computed here)."""
    return " ".join([*_FLAGS, f"--xla_force_host_platform_device_count={devices}"])


os.environ["XLA_FLAGS"] = xla_flags(8)
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
