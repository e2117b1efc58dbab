"""Reading a file a user named, in bounded time and memory: what is not a regular file (a FIFO
that would block forever, a device, a directory) is refused before it is opened, a file over the
size limit before it is read, and YAML whose aliases would expand past a bound before any value
is built (a few lines of nested anchors can stand for billions of nodes).

The Pulumi CLI's own YAML reader (go-yaml v3) refuses such a document too ("document contains
excessive aliasing"), so a stack file this refuses is one `pulumi up` would refuse.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path
from typing import Any

# A stack file or a rendered manifest is kilobytes; a megabyte is far past any real one.
MAX_CONFIG_BYTES = 1 << 20
# The nodes a document may stand for once every alias is expanded: a real stack file has
# hundreds, and any document within MAX_CONFIG_BYTES without aliases has fewer than this.
MAX_YAML_NODES = 1_000_000
# How much of a value an error message quotes.
QUOTE_CHARS = 80


class UserFileError(ValueError):
    """A file that cannot be read as asked; the message names the path and what was wrong."""


def quote(value: object, limit: int = QUOTE_CHARS) -> str:
    """repr(value) cut to `limit` characters, saying how long it was: error messages echo a
    bounded prefix of what a user gave, never a megabyte of it."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(str(value))} characters)"


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def read_text(path: Path, what: str, max_bytes: int = MAX_CONFIG_BYTES) -> str:
    """The UTF-8 text of `path` (`what` names it in errors: "stack file"), refusing a path that
    does not resolve (a symlink loop), anything but a regular file, and more than `max_bytes`."""
    try:
        info = os.stat(path)
    except OSError as exc:
        raise UserFileError(f"{path}: cannot read the {what} ({exc.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise UserFileError(f"{path}: is {_kind(info.st_mode)}; the {what} must be a regular file")
    if info.st_size > max_bytes:
        raise UserFileError(f"{path}: {info.st_size:,} bytes; a {what} is at most "
                            f"{max_bytes:,} bytes")
    try:
        # O_NONBLOCK: if the path was swapped for a FIFO since the stat, open does not wait for
        # a writer; the read is bounded even if the file grew.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                raise UserFileError(f"{path}: changed while being read; the {what} must be a "
                                    "regular file")
            data = handle.read(max_bytes + 1)
    except OSError as exc:
        raise UserFileError(f"{path}: cannot read the {what} ({exc.strerror})") from None
    if len(data) > max_bytes:
        raise UserFileError(f"{path}: over {max_bytes:,} bytes; a {what} is at most "
                            f"{max_bytes:,} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserFileError(f"{path}: is not a text file (byte {exc.start} is not UTF-8); the "
                            f"{what} is UTF-8 text") from None


def expanded_nodes(node: Any, limit: int = MAX_YAML_NODES) -> int:
    """How many nodes a composed YAML node stands for with every alias expanded, counted once
    per node object (an alias is the same object again), stopping past `limit`."""
    import yaml

    sizes: dict[int, int] = {}

    def size(n: Any) -> int:
        key = id(n)
        if key in sizes:
            return sizes[key]
        sizes[key] = 1  # a recursive alias counts once while its own size is being found
        total = 1
        if isinstance(n, yaml.SequenceNode):
            children = n.value
        elif isinstance(n, yaml.MappingNode):
            children = [part for pair in n.value for part in pair]
        else:
            children = []
        for child in children:
            total += size(child)
            if total > limit:
                break
        sizes[key] = total
        return total

    return size(node) if node is not None else 0


def load_yaml(text: str, source: str, loader: Any = None) -> Any:
    """The document in `text`, built with `loader` (default yaml.SafeLoader) only once its
    expanded size is within MAX_YAML_NODES; `source` names it in errors. yaml.YAMLError passes
    through for the caller to word."""
    import yaml

    loader_cls = loader or yaml.SafeLoader
    reader = loader_cls(text)
    try:
        try:
            node = reader.get_single_node()
        except RecursionError:
            raise UserFileError(f"{source}: nested too deep to read; a config nests a few "
                                "levels") from None
        if node is None:
            return None
        nodes = expanded_nodes(node)
        if nodes > MAX_YAML_NODES:
            raise UserFileError(f"{source}: its aliases expand to over {MAX_YAML_NODES:,} values; "
                                "a config this size is an alias bomb (the Pulumi CLI refuses it "
                                "as 'excessive aliasing')")
        return reader.construct_document(node)
    finally:
        reader.dispose()


def resolve(path: Path, what: str) -> Path:
    """`path` made absolute with every symlink followed; a loop is a UserFileError naming it
    (Path.resolve raises RuntimeError or OSError for one, depending on the Python version)."""
    try:
        return path.expanduser().resolve()
    except RuntimeError:  # Python < 3.13 on a loop
        raise UserFileError(f"{what} {path}: cannot be resolved: a symlink loop") from None
    except OSError as exc:
        why = "a symlink loop" if exc.errno == errno.ELOOP else exc.strerror
        raise UserFileError(f"{what} {path}: cannot be resolved: {why}") from None


def directory(path: Path, what: str, create: bool = True) -> Path:
    """`path` resolved (and, with `create`, created if missing), as a directory `what` (a flag:
    "--workdir") can use; a file or a loop there is a UserFileError of one line."""
    scheme = re.match(r"^([a-z][a-z0-9+.-]*):/", str(path))
    if scheme:  # Path("gs://b/p") is "gs:/b/p": it would become a directory named "gs:"
        typed = re.sub(r"^([a-z][a-z0-9+.-]*):/(?!/)", r"\1://", str(path))
        raise UserFileError(f"{what} {typed}: is a {scheme[1]}:// URI, but this takes a local "
                            "directory; give a path on this machine")
    resolved = resolve(path, what)
    if resolved.exists() and not resolved.is_dir():
        kind = _kind(resolved.stat().st_mode) if not resolved.is_file() else "a file"
        raise UserFileError(f"{what} {path}: is {kind}; give a directory (it is created if "
                            "missing)")
    if not create:
        return resolved
    try:
        resolved.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserFileError(f"{what} {path}: cannot create the directory ({exc.strerror})") \
            from None
    return resolved
