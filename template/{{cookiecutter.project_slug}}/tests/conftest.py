"""Eight CPU devices for every test; must run before anything imports jax."""

import math
import os
import sys
from importlib import metadata
from pathlib import Path

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


def persistent_compilation_cache() -> Path:
    """${XDG_CACHE_HOME:-~/.cache}/multislice/jax-cache/jax-V-jaxlib-V: the one the toolkit's
    suite uses too. JAX keys each entry by program, devices, flags and version; the directory
    per version pair keeps an upgrade's entries apart, so the old ones can be deleted whole."""
    named = os.environ.get("XDG_CACHE_HOME") or ""  # relative: invalid (XDG spec), ignored
    home = Path(named) if os.path.isabs(named) else Path.home() / ".cache"
    versions = f"jax-{metadata.version('jax')}-jaxlib-{metadata.version('jaxlib')}"
    path = home / "multislice" / "jax-cache" / versions
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file there, read-only, full: the suite runs without it
        import tempfile

        fallback = Path(tempfile.gettempdir()) / f"trainer-jax-cache-{os.getuid()}" / versions
        print(f"tests: the compile cache {path} cannot be made ({exc.strerror}); using "
              f"{fallback}", file=sys.stderr)
        path = fallback
        path.mkdir(parents=True, exist_ok=True)
    return path


# One JAX compilation cache for every trainer this suite starts, in-process or not, and for the
# next run of the suite: the same small programs compile in dozens of tests (tests/test_train.py
# alone: 183 s without a shared cache, 108 s with), and again at every run. Every program is
# written, however fast it compiled (JAX's default skips those under a second: most of these).
# A JAX_COMPILATION_CACHE_DIR that is already set (a team's, or the toolkit's suite) is kept.
# Tests that check RUN_DIR/compile_cache unset it.
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(persistent_compilation_cache())
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"


def xdist_workers(cores: int, memory_gib: float) -> int:
    """`pytest -n auto`: 1.5 workers a core (the multi-process tests wait on their peers, so a
    worker a core leaves CPU idle), at most one per 4 GiB of memory."""
    return max(1, min(math.ceil(cores * 1.5), int(memory_gib // 4)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return xdist_workers(len(os.sched_getaffinity(0)), memory_gib)


def layers_per_unit(kind: str) -> int:
    """The layers of the variant's repeating unit (TransformerLM.layers_per_unit)."""
    from types import SimpleNamespace

    from trainer.model.registry import model_kind

    return int(getattr(model_kind(SimpleNamespace(kind=kind)).build, "layers_per_unit", 1))


def small_preset(preset: str) -> list[str]:
    """Overrides that shrink `preset` to seconds on a CPU while keeping what makes it itself
    (its MLP, grouped-query or multi-head attention, RoPE scaling, tied or not, scan, and two
    of its variant's units of layers)."""
    from trainer.config import preset_raw

    model = preset_raw(preset)["model"]
    grouped = 0 < model["n_kv_heads"] < model["n_heads"]
    n_layers = 2 * layers_per_unit(model["kind"])
    out = ["model.vocab_size=256", "model.d_model=64", f"model.n_layers={n_layers}",
           "model.n_heads=4",
           f"model.n_kv_heads={2 if grouped else 0}", "model.head_dim=0", "model.d_ff=128",
           "model.seq_len=64", "model.dtype=float32", "model.loss_chunk_size=0",
           "model.attention=dense", "model.remat=none"]
    if model["rope_scaling"] == "llama3":
        out.append("model.rope_original_max_len=16")  # the scaling bites inside 64 positions
    return out
