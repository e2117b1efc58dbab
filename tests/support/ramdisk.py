"""A tmpfs for the emulated TPU hosts' own disks.

A host's disk holds what a real VM's boot disk holds: the unpacked environment (about 1 GB of
CPython, jaxlib, scipy...), its state and its logs. On this machine's virtio disk every unpacked
environment cost about 6-7 CPU-seconds of kernel and block-device work (ext4 journalling,
writeback, discards on delete), against under 2 on a tmpfs, measured system-wide with the same
`tar -x` of one published environment. A tmpfs mounted here, outside every host's namespaces,
keeps what each host wrote across its reboots, as a boot disk does, and gives the memory back
when it is unmounted.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def ramdisk(path: Path, size: str = "50%") -> Iterator[Path]:
    """`path` (made if missing) as a tmpfs of at most `size` (mount's units) while inside.

    The unmount is lazy: a host still running when the block ends keeps its files until it is
    powered off, and the memory is freed then."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=755", "tmpfs",
                              str(path)], capture_output=True, text=True)
    if mounted.returncode != 0:
        raise RuntimeError(f"cannot mount a tmpfs at {path} for the emulated hosts' disks: "
                           f"{mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], capture_output=True)
