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
    """$XDG_CACHE_HOME, or ~/.cache where it is unset, empty or relative (the XDG base
    directory spec: a relative path is invalid and ignored)."""
    named = os.environ.get("XDG_CACHE_HOME") or ""
    return Path(named) if os.path.isabs(named) else Path.home() / ".cache"


def suite_compile_cache() -> Path:
    """The cache directory, made; where it cannot be made (XDG_CACHE_HOME a file, read-only,
    a full disk) a directory of this user's under the system's temporary directory, said once
    on stderr, so the suite still runs (every compile is then paid once more per machine)."""
    import sys
    import tempfile

    versions = f"jax-{metadata.version('jax')}-jaxlib-{metadata.version('jaxlib')}"
    path = cache_home() / "multislice" / "jax-cache" / versions
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fallback = Path(tempfile.gettempdir()) / f"multislice-jax-cache-{os.getuid()}" / versions
        print(f"tests: the compile cache {path} cannot be made ({exc.strerror}); using "
              f"{fallback}", file=sys.stderr)
        path = fallback
        path.mkdir(parents=True, exist_ok=True)
    # Emulated hosts may train as a user of their own (trainer.run_as): they write here too.
    path.chmod(0o777)
    return path
