"""The toolkit's gs:// access: one gcsfs filesystem, set up as the trainer's own
(template trainer/runtime/storage.py, which a fork carries without the toolkit), and a quick check
that the storage endpoint answers at all, so that an unreachable one is one line in seconds
instead of gcsfs's minute of retries and its tracebacks."""

from __future__ import annotations

import os
import socket
import warnings
from typing import Any
from urllib.parse import urlsplit

PUBLIC_ENDPOINT = "https://storage.googleapis.com"
CONNECT_TIMEOUT_S = 10.0


class StorageUnreachable(RuntimeError):
    """The storage endpoint does not accept connections; the message names it and why."""


def filesystem() -> Any:
    """A gcsfs filesystem; honours STORAGE_EMULATOR_HOST like every Google storage client."""
    # Our buckets are standard ones; otherwise gcsfs asks the Storage Control API about each
    # bucket and warns on every call when it cannot tell.
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    # google-api-core's notice that Python 3.11 support ends in 2027, printed once per Google
    # package at import: not about this command.
    warnings.filterwarnings("ignore", category=FutureWarning,
                            module=r"google\.api_core\._python_version_support")
    import gcsfs

    return gcsfs.GCSFileSystem()


def endpoint() -> str:
    """The storage endpoint the clients use: STORAGE_EMULATOR_HOST, else Google's."""
    return os.environ.get("STORAGE_EMULATOR_HOST") or PUBLIC_ENDPOINT


def check_reachable(uri: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Raise StorageUnreachable unless the endpoint for gs:// `uri` accepts a TCP connection."""
    where = endpoint()
    parts = urlsplit(where if "://" in where else f"http://{where}")
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return
    except OSError as err:
        reason = "timed out" if isinstance(err, TimeoutError) else (err.strerror or str(err))
        via = " (STORAGE_EMULATOR_HOST)" if os.environ.get("STORAGE_EMULATOR_HOST") else ""
        raise StorageUnreachable(
            f"{uri}: the storage endpoint {where}{via} is not reachable ({reason}); check the "
            "network and credentials, or the emulator address") from None
