"""JAX's persistent compilation cache in the run directory: a restarted run skips recompiling."""

from __future__ import annotations

import os

import jax
from etils import epath

COMPILE_CACHE_SUBDIR = "compile_cache"


def enable_compilation_cache(run_dir: str | os.PathLike) -> str:
    """Caches every compiled program (however small or fast) in RUN_DIR/compile_cache."""
    path = epath.Path(run_dir) / COMPILE_CACHE_SUBDIR
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return str(path)
