"""JAX's persistent compilation cache in the run directory: a restarted run skips recompiling.

`JAX_COMPILATION_CACHE_DIR` (JAX's own setting), when set, is used instead: one cache shared by
every run on a machine (a team's scratch disk, a test session), keyed by the program and devices
as always, so a run never loads another program's executable.
"""

from __future__ import annotations

import os

import jax
from etils import epath

COMPILE_CACHE_SUBDIR = "compile_cache"
SHARED_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"


def enable_compilation_cache(run_dir: str | os.PathLike) -> str:
    """Caches every compiled program (however small or fast) in RUN_DIR/compile_cache, or in
    $JAX_COMPILATION_CACHE_DIR when that is set."""
    shared = os.environ.get(SHARED_CACHE_ENV)
    path = epath.Path(shared) if shared else epath.Path(run_dir) / COMPILE_CACHE_SUBDIR
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return str(path)
