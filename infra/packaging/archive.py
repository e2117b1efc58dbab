"""Deterministic tar.gz of an experiment directory, named by its content hash (no pulumi import).

The name is the sha256 of the normalised tar (sorted entries, zeroed times and owners), not of the
gzip bytes: those come from the deployer's zlib (zlib and zlib-ng compress differently), and a
laptop and CI must name one tree alike, or every trainer restarts for a new spec. Same tree ->
same name, so an unchanged experiment keeps its spec and a changed one gets a new name; the VM
checks the tar it unpacks against the name (infra/boot/launch.py archive-sha256).
"""

from __future__ import annotations

import fnmatch
import gzip
import hashlib
import io
import os
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

EXCLUDED_DIRS = frozenset(
    {".venv", "venv", "__pycache__", "runs", ".git", ".pytest_cache", ".ruff_cache", ".mypy_cache"}
)
EXCLUDED_SUFFIXES = (".pyc", ".pyo")
# The experiment's own list of what stays out of the archive (`multislice new` writes one that
# leaves out converted weights, Hugging Face checkpoints, data and caches): one pattern a line,
# `#` comments, matched against the path relative to the experiment (or any one name in it); a
# trailing `/` matches directories only.
IGNORE_FILE = ".multisliceignore"
LARGE_FILE_BYTES = 10 * 2**20  # a file this large in the archive is named at preview


def ignore_patterns(root: Path) -> list[str]:
    path = root / IGNORE_FILE
    if not path.is_file():
        return []
    lines = (line.strip() for line in path.read_text(encoding="utf-8").splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def _ignored(rel: str, is_dir: bool, patterns: list[str]) -> bool:
    name = rel.rsplit("/", 1)[-1]
    for pattern in patterns:
        want_dir = pattern.endswith("/")
        pattern = pattern.rstrip("/")
        if want_dir and not is_dir:
            continue
        if "/" in pattern:
            if fnmatch.fnmatchcase(rel, pattern.lstrip("/")):
                return True
        elif fnmatch.fnmatchcase(name, pattern):
            return True
    return False


@dataclass(frozen=True)
class Archive:
    data: bytes
    """The compressed archive (what is uploaded)."""
    sha256: str
    """sha256 of the uncompressed tar: the tree's hash, whatever compressed it."""

    @property
    def object_name(self) -> str:
        return f"code/{self.sha256}.tar.gz"


def _members(root: Path) -> list[Path]:
    patterns = ignore_patterns(root)
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)

        def kept(name: str, is_dir: bool, here: Path = here) -> bool:
            rel = (here / name).relative_to(root).as_posix()
            return not _ignored(rel, is_dir, patterns)

        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS and kept(d, True))
        out.extend(here / d for d in dirnames)
        out.extend(here / f for f in sorted(filenames)
                   if not f.endswith(EXCLUDED_SUFFIXES) and kept(f, False))
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def tree_files(root: str | Path) -> dict[str, str]:
    """{relative path: sha256 of its bytes} of the files the archive of `root` would hold."""
    root = Path(root)
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in _members(root) if p.is_file()}


def large_files(root: str | Path, limit: int = LARGE_FILE_BYTES) -> list[tuple[str, int]]:
    """[(relative path, bytes)] of the files over `limit` that the archive would hold."""
    root = Path(root)
    return [(p.relative_to(root).as_posix(), p.stat().st_size) for p in _members(root)
            if p.is_file() and not p.is_symlink() and p.stat().st_size > limit]


def _normalise(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mode = 0o755 if info.isdir() or info.mode & 0o111 else 0o644
    return info


def gzip_bytes(data: bytes) -> bytes:
    """gzip with no name and no time in the header, by this Python's zlib."""
    packed = io.BytesIO()
    with gzip.GzipFile(fileobj=packed, mode="wb", mtime=0, filename="") as gz:
        gz.write(data)
    return packed.getvalue()


def build_archive(root: str | Path, compress: Callable[[bytes], bytes] = gzip_bytes) -> Archive:
    """Pack ``root`` (sorted entries, zeroed times/owners, no venvs/caches/runs) into tar.gz,
    named by the tar's hash (``compress`` only changes the bytes uploaded)."""
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
    tar_bytes = raw.getvalue()
    return Archive(data=compress(tar_bytes), sha256=hashlib.sha256(tar_bytes).hexdigest())


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


def archive_files(path: str | Path) -> dict[str, str]:
    """{member path: sha256 of its bytes} of a tar.gz this module wrote (directories left out):
    what a render lists, so a diff can name the files of the experiment that changed."""
    files: dict[str, str] = {}
    with tarfile.open(str(path), mode="r:gz") as tar:
        for info in tar:
            if info.isfile():
                handle = tar.extractfile(info)
                assert handle is not None
                files[info.name] = hashlib.sha256(handle.read()).hexdigest()
    return dict(sorted(files.items()))
