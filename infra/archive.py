"""Deterministic tar.gz of an experiment directory, named by its content hash (no pulumi import).

Same tree -> same bytes -> same object name, so an unchanged experiment is never re-uploaded and
a changed one gets a new name (the VM verifies the hash after download).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path

EXCLUDED_DIRS = frozenset(
    {".venv", "venv", "__pycache__", "runs", ".git", ".pytest_cache", ".ruff_cache", ".mypy_cache"}
)
EXCLUDED_SUFFIXES = (".pyc", ".pyo")


@dataclass(frozen=True)
class Archive:
    data: bytes
    sha256: str

    @property
    def object_name(self) -> str:
        return f"code/{self.sha256}.tar.gz"


def _members(root: Path) -> list[Path]:
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        here = Path(dirpath)
        out.extend(here / d for d in dirnames)
        out.extend(here / f for f in sorted(filenames) if not f.endswith(EXCLUDED_SUFFIXES))
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def _normalise(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mode = 0o755 if info.isdir() or info.mode & 0o111 else 0o644
    return info


def build_archive(root: str | Path) -> Archive:
    """Pack ``root`` (sorted entries, zeroed times/owners, no venvs/caches/runs) into tar.gz."""
    root = Path(root)
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in _members(root):
            if path.is_symlink():
                continue  # links could point outside the experiment; the archive stays closed
            info = _normalise(tar.gettarinfo(str(path), arcname=path.relative_to(root).as_posix()))
            if info.isfile():
                with path.open("rb") as fh:
                    tar.addfile(info, fh)
            else:
                tar.addfile(info)
    packed = io.BytesIO()
    with gzip.GzipFile(fileobj=packed, mode="wb", mtime=0, filename="") as gz:
        gz.write(raw.getvalue())
    data = packed.getvalue()
    return Archive(data=data, sha256=hashlib.sha256(data).hexdigest())


def write_archive(archive: Archive, cache_dir: str | Path) -> Path:
    """Write once under ``cache_dir`` (content-addressed, so an existing file is reused)."""
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"{archive.sha256}.tar.gz"
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(archive.data)
        tmp.replace(path)
    return path
