"""Where the suite keeps its persistent JAX compilation cache (tests/conftest.py uses it).

${XDG_CACHE_HOME:-~/.cache}/multislice/jax-cache/jax-<jax>-jaxlib-<jaxlib>: a directory per
version pair, so an upgrade starts a cache of its own and the old one can be deleted whole
(`make clean` deletes every one). JAX keys each entry by the program, the devices, the flags
and its own version too, so a stale entry is never loaded; the directory only keeps the size
in check.
"""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path


def cache_home() -> Path:
    """$XDG_CACHE_HOME, or ~/.cache where it is unset or empty (the XDG base directory spec)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


def suite_compile_cache() -> Path:
    versions = f"jax-{metadata.version('jax')}-jaxlib-{metadata.version('jaxlib')}"
    path = cache_home() / "multislice" / "jax-cache" / versions
    path.mkdir(parents=True, exist_ok=True)
    # Emulated hosts may train as a user of their own (trainer.run_as): they write here too.
    path.chmod(0o777)
    return path
