"""JAX's persistent compilation cache in the run directory: a restarted run skips recompiling.

`JAX_COMPILATION_CACHE_DIR` (JAX's own setting), when set, is used instead: one cache shared by
every run on a machine (a team's scratch disk, a test session), keyed by the program and devices
as always, so a run never loads another program's executable.

JAX writes entries from process 0 only: on TPU every process of a job computes the same key, so
the others read what process 0 wrote. On CPU the key also hashes each process's own topology, so
in an emulated multislice run (one process a slice) process 1 never finds process 0's entry and,
never writing one of its own, recompiled every program at every start and restart. There each
process writes its own entries, under keys only processes of its index and topology read.

A restart reads the cache from where it is nearest: `MULTISLICE_LOCAL_COMPILE_CACHE` (set by the
start-up script: a directory on the host's own disk, or on a GKE node that outlives its pods)
is a first tier in front of the run's cache. An entry is read there first, then from the run's
cache (and kept locally); every entry written goes to both. A local entry that is unreadable or
corrupt costs a compile, never a wrong program: JAX checks what it deserializes and compiles
again when that fails (jax._src.compiler: "Error reading persistent compilation cache entry").
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import jax
from etils import epath

COMPILE_CACHE_SUBDIR = "compile_cache"
SHARED_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
LOCAL_TIER_ENV = "MULTISLICE_LOCAL_COMPILE_CACHE"
log = logging.getLogger(__name__)


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


def write_from_every_process_on_cpu() -> bool:
    """In a multi-process CPU run, lets processes other than 0 write their own cache entries
    (see the module docstring). Call after jax.distributed is initialised. Returns whether it
    applies; a JAX whose compiler no longer has the hook is left as it is (with a debug line)."""
    if jax.process_count() == 1 or jax.default_backend() != "cpu":
        return False
    try:
        from jax._src import compilation_cache as jax_cache
        from jax._src import compiler
        from jax._src import config as jax_config

        original = compiler._cache_write
        put = jax_cache.put_executable_and_time
        min_compile_s = jax_config.persistent_cache_min_compile_time_secs
    except (ImportError, AttributeError) as err:
        log.debug("JAX has no process-0-only cache write to lift: %s", err)
        return False
    if getattr(original, "writes_from_every_process", False):
        return True

    def write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks):
        # What JAX's own write does after its process-0 check: never a program with host
        # callbacks (baked into the executable), nor one below the minimum compile time.
        if host_callbacks or compile_time_secs < min_compile_s.value:
            return original(cache_key, compile_time_secs, module_name, backend, executable,
                            host_callbacks)
        try:
            put(cache_key, module_name, executable, backend, int(compile_time_secs))
        except Exception as err:  # as JAX's own write: a cache that fails is not the run's end
            warnings.warn(f"Error writing persistent compilation cache entry for "
                          f"'{module_name}': {type(err).__name__}: {err}", stacklevel=1)

    write.writes_from_every_process = True
    compiler._cache_write = write
    return True


class TwoTierCache:
    """JAX's cache interface (get/put of bytes by key) over a near tier and the run's cache."""

    def __init__(self, near: Any, far: Any) -> None:
        self.near, self.far = near, far
        self._path = getattr(far, "_path", None)  # what JAX logs as the cache's location

    def get(self, key: str) -> bytes | None:
        value = self.near.get(key)
        if value is None:
            value = self.far.get(key)
            if value is not None:
                self.near.put(key, value)
        return value

    def put(self, key: str, value: bytes) -> None:
        self.near.put(key, value)
        self.far.put(key, value)

    def clear(self) -> None:
        self.near.clear()


def add_local_tier(environ: dict[str, str] | None = None) -> str | None:
    """Puts $MULTISLICE_LOCAL_COMPILE_CACHE in front of the run's cache (call after
    enable_compilation_cache and compilation_cache.reset_cache()). Returns the local directory,
    or None: none set, $JAX_COMPILATION_CACHE_DIR in use instead of the run's cache, a JAX
    without the hook (a debug line), or a directory that cannot be made (a warning: the tier
    saves time, its absence costs nothing else)."""
    environ = os.environ if environ is None else environ
    local = environ.get(LOCAL_TIER_ENV)
    if not local or environ.get(SHARED_CACHE_ENV):
        return None  # a machine's shared cache is near already
    try:
        from jax._src import compilation_cache as jax_cache
        from jax._src.lru_cache import LRUCache
    except ImportError as err:
        log.debug("JAX has no cache tiers to add: %s", err)
        return None
    jax_cache._initialize_cache()
    far = getattr(jax_cache, "_cache", None)
    if far is None or isinstance(far, TwoTierCache):
        return None
    try:
        epath.Path(local).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        log.warning("%s=%r cannot be made (%s: %s); compiling from the run's cache alone",
                    LOCAL_TIER_ENV, local[:200], type(err).__name__, err)
        return None
    jax_cache._cache = TwoTierCache(LRUCache(local, max_size=-1), far)
    return local
