"""The run directory's storage: a local path or gs://BUCKET/PATH, through the real clients.

gs:// files go through gcsfs (also what `etils.epath` uses); Orbax checkpoints through
TensorStore. Both honour the standard emulator overrides (`STORAGE_EMULATOR_HOST`,
`TENSORSTORE_GCS_HTTP_URL`), which is how the tests reach a GCS emulator; nothing here switches
code paths for tests.

What GCS cannot do the way a disk does, and what this module does instead:

- append: `append_text` writes the new lines as a small object and composes it onto the end
  (one server-side call; nothing is read back or rewritten).
- exclusive create: `create_exclusive` uploads with `ifGenerationMatch=0`, GCS's atomic
  "only if absent"; exactly one of many racing hosts wins.
- local reads for C++ readers (ArrayRecord): `stage_files` copies objects to local disk once,
  verified against the object's MD5 (or size, for composite objects, which have none).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os
import socket
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

# The toolkit's bucket is a standard one (infra/cloud/storage.py). gcsfs would otherwise ask the
# Storage Control API per bucket whether it is hierarchical or zonal, and warn on every call when
# it cannot tell.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
# google-api-core warns on import that it will drop this Python one day: noise in a run log.
warnings.filterwarnings("ignore", category=FutureWarning, module=r"google\.api_core\..*")

GS = "gs://"
PUBLIC_ENDPOINT = "https://storage.googleapis.com"
CONNECT_TIMEOUT_S = 10.0
STORAGE_RETRY_ENV = "MULTISLICE_STORAGE_RETRY_S"


class StorageError(RuntimeError):
    """A storage location is unusable; the message names it and what to check."""


def is_remote(path: str | os.PathLike) -> bool:
    return str(path).startswith(GS)


def absolute(path: str) -> str:
    """A path as the user typed it, made independent of the working directory: `~` expanded and
    a relative local path joined to the directory it was typed in (Orbax and TensorStore refuse
    relative paths, and a later chdir must not move a run). gs:// URIs and "" pass unchanged."""
    if not path or is_remote(path):
        return path
    return os.path.abspath(os.path.expanduser(path))


def split_uri(uri: str) -> tuple[str, str]:
    """gs://BUCKET/KEY -> (BUCKET, KEY)."""
    rest = uri[len(GS):]
    bucket, _, key = rest.partition("/")
    return bucket, key


@functools.cache
def gcs() -> Any:
    import gcsfs

    return gcsfs.GCSFileSystem()


def storage_retry_s() -> float:
    """How long a refused bucket (401/403) is retried: MULTISLICE_STORAGE_RETRY_S, which the TPU
    VM's startup script sets from the stack's storage_retry_s (a grant made by the same `pulumi
    up` takes minutes to reach every server); 0 elsewhere, where a refusal is a wrong credential
    and should fail at once."""
    value = os.environ.get(STORAGE_RETRY_ENV, "")
    try:
        return max(0.0, float(value)) if value else 0.0
    except ValueError:
        raise StorageError(f"{STORAGE_RETRY_ENV}={value!r} is not a number of seconds") from None


def _refused(exc: BaseException) -> int | None:
    """The HTTP status of a 401 or 403 as gcsfs raises it (403: OSError "Forbidden: ...";
    401: HttpError with .code), else None."""
    if isinstance(exc, OSError) and str(exc).startswith("Forbidden"):
        return 403
    code = getattr(exc, "code", None)
    return code if code in (401, 403) else None


def check_reachable(uri: str, log: Callable[[str], None] | None = None) -> None:
    """Raises StorageError unless the bucket of gs:// `uri` can be listed with our credentials.
    A 401/403 is retried with backoff for storage_retry_s() seconds, one `log` line per retry
    (stderr by default), as the boot path retries: IAM grants propagate."""
    if not is_remote(uri):
        return
    bucket, _ = split_uri(uri)
    _check_endpoint_answers(uri)
    say = log or (lambda line: print(line, file=sys.stderr, flush=True))
    budget = storage_retry_s()
    deadline = time.monotonic() + budget
    delay, attempt = 2.0, 0
    while True:
        try:
            gcs().ls(bucket, detail=False, refresh=True)
            return
        except FileNotFoundError:
            raise StorageError(f"{uri}: bucket gs://{bucket} does not exist (it is created by "
                               "`pulumi up`; check the bucket name)") from None
        except Exception as exc:  # noqa: BLE001 - auth, DNS, refused: all mean "cannot use it"
            status = _refused(exc)
            if status is None:
                raise StorageError(f"{uri}: bucket gs://{bucket} is not reachable at "
                                   f"{_endpoint()} ({type(exc).__name__}: {exc}); check "
                                   "credentials and the service account's access to the "
                                   "bucket") from None
        attempt += 1
        if time.monotonic() + delay > deadline:
            waited = f" after {attempt} attempts in {budget:.0f}s ({STORAGE_RETRY_ENV})" \
                if attempt > 1 else ""
            raise StorageError(
                f"{uri}: bucket gs://{bucket} refuses this host's credentials (HTTP {status})"
                f"{waited}; grant the service account read access to it (on a stack: the "
                "stack's own bucket, or multislice:data_buckets for another one)")
        say(f"storage: gs://{bucket} answered HTTP {status} (an IAM grant takes minutes to "
            f"propagate); retry {attempt} in {delay:.0f}s, for up to {budget:.0f}s")
        time.sleep(delay)
        delay = min(delay * 2, 30.0)


def _endpoint() -> str:
    return os.environ.get("STORAGE_EMULATOR_HOST") or PUBLIC_ENDPOINT


def _check_endpoint_answers(uri: str) -> None:
    """One TCP connection to the storage endpoint: an unreachable one is a line in seconds,
    instead of a minute of gcsfs retries that log a traceback each."""
    where = _endpoint()
    parts = urlsplit(where if "://" in where else f"http://{where}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname or "", port), timeout=CONNECT_TIMEOUT_S):
            return
    except OSError as err:
        reason = "timed out" if isinstance(err, TimeoutError) else (err.strerror or str(err))
        raise StorageError(f"{uri}: the storage endpoint {where} is not reachable ({reason}); "
                           "check the network, or STORAGE_EMULATOR_HOST") from None


def check_run_dir_layout(run_dir: str) -> None:
    """Raises StorageError when the run directory, or its checkpoints/ directory, is a file,
    or when a local run directory cannot be created or written."""
    from etils import epath

    root = epath.Path(run_dir)
    for path, what in ((root, "the run directory"), (root / "checkpoints", "its checkpoints")):
        if path.exists() and not path.is_dir():
            raise StorageError(f"{path} ({what}) is a regular file, not a directory; move it "
                               "away or give another --run-dir")
    if is_remote(run_dir):
        return
    probe = os.path.join(run_dir, f".write-check-{os.getpid()}")
    try:
        os.makedirs(run_dir, exist_ok=True)
        with open(probe, "w", encoding="utf-8") as fh:
            fh.write("ok")
        os.remove(probe)
    except OSError as err:
        where = err.filename or run_dir
        raise StorageError(f"run directory {run_dir} cannot be written ({where}: "
                           f"{err.strerror or err}); give a --run-dir on a writable disk"
                           ) from None


def append_text(path: str, text: str) -> None:
    """Appends `text` to the file at `path` (created if absent)."""
    if not text:
        return
    if not is_remote(path):
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
        return
    fs = gcs()
    data = text.encode()
    try:
        fs.pipe_file(path, data, mode="create")  # gcsfs maps the 412 of an existing object
        return                                   # to FileExistsError
    except FileExistsError:
        pass
    part = f"{path}.part-{uuid.uuid4().hex}"
    fs.pipe_file(part, data)
    try:
        fs.merge(path, [path, part])
    finally:
        fs.rm_file(part)
    fs.invalidate_cache(path)


def create_exclusive(path: str, text: str) -> bool:
    """Creates `path` holding `text` only if nothing is there; True if this call created it."""
    if not is_remote(path):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        return True
    try:
        gcs().pipe_file(path, text.encode(), mode="create")
    except FileExistsError:  # 412 Precondition Failed: another process created it first
        return False
    return True


def exists(path: str) -> bool:
    if not is_remote(path):
        return os.path.exists(path)
    fs = gcs()
    fs.invalidate_cache(path)
    return fs.exists(path)


def read_text(path: str) -> str:
    if not is_remote(path):
        return Path(path).read_text(encoding="utf-8")
    return gcs().cat_file(path).decode()


def _md5_of(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return base64.b64encode(digest.digest()).decode()


def stage_files(uris: Sequence[str], dest: Path) -> list[Path]:
    """Copies each gs:// object into `dest` (same base name) unless an identical copy is there.

    A copy is identical when its MD5 matches the object's (its size, when GCS keeps no MD5).
    Each file is written under a unique temporary name and renamed, so processes staging the
    same files at once never see a partial file. Raises StorageError on a checksum mismatch.
    """
    fs = gcs()
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for uri in uris:
        info = fs.info(uri)
        local = dest / uri.rsplit("/", 1)[-1]
        want_md5, size = info.get("md5Hash"), int(info["size"])

        def matches(candidate: Path, want_md5: str | None = want_md5, size: int = size) -> bool:
            if not candidate.is_file() or candidate.stat().st_size != size:
                return False
            return want_md5 is None or _md5_of(candidate) == want_md5

        if not matches(local):
            tmp = local.with_name(f".{local.name}.{uuid.uuid4().hex}")
            try:
                fs.get_file(uri, str(tmp))
                if not matches(tmp):
                    raise StorageError(f"{uri}: the local copy does not match the object's "
                                       f"checksum (md5 {want_md5}, {size} bytes); retry")
                os.replace(tmp, local)
            finally:
                tmp.unlink(missing_ok=True)
        out.append(local)
    return out


def staging_dir(uri: str) -> Path:
    """Where a gs:// data set is staged on this host: ~/.cache/trainer-data/<hash of the URI>."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "trainer-data" / hashlib.sha256(uri.rstrip("/").encode()).hexdigest()[:16]
