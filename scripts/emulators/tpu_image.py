"""What a fresh TPU VM image has, rebuilt from parts of this machine, for the boot harness.

The TPU VM images (tpu-ubuntu2204-base, v2-alpha-tpuv5-lite) ship `python3` 3.10 with pip, no
`uv`, no toolkit venv, and nothing under /opt. Every emulated host (scripts/emulators/boot_harness.py)
sees exactly that through a few mounts in its own mount namespace (`HOST_SETUP` below):

- `/usr/local`: a Python 3.10 with pip (a copy of this machine's pyenv 3.10, relocated with
  patchelf), and `/usr/bin/python3` pointing at it; this machine's `python3.11`, `pip*` and
  `/usr/local/bin` tools are hidden (an overlay with whiteouts)
- private `/root`, `/home`, `/opt`, `/tmp`, `/var/lib/multislice`, `/var/log/multislice`, an
  overlay on `/etc` (users and groups made at boot stay on the host), and a private `/dev` with
  the usual nodes plus emulated TPU device nodes `root:GROUP 0660`
- `/srv/multislice-mirror` (read only): what the real downloads would fetch, reached only through
  the overrides the real tools honour: a python-build-standalone style CPython archive listed in a
  downloads JSON (`UV_PYTHON_DOWNLOADS_JSON_URL`), the uv wheel (`PIP_FIND_LINKS`, `PIP_NO_INDEX`)
  and uv's package cache (`UV_CACHE_DIR`, `UV_OFFLINE`): the startup script runs its own install
  commands unchanged, the network is all that is replaced.
- `/srv/jax-cache`, only when the harness is given one (`EMULATED_JAX_CACHE_ENV` below): a JAX
  compilation cache shared with this machine, named to the trainer by JAX's own
  `JAX_COMPILATION_CACHE_DIR`, as a team could on a scratch disk; without it the trainer uses
  the product's own cache in its run directory (gs://BUCKET/runs/STACK/compile_cache).

A GKE pod's default container (`build_container_image`: Docker's python:3.11-bookworm) is the same
but for its Python: CPython 3.11 in /usr/local. scripts/emulators/jobset_emulator.py runs its pods.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

VENV_BIN = Path(sys.executable).parent
PYENV = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
MIRROR = "/srv/multislice-mirror"  # where a host sees the mirror
UV_CACHE = "/srv/uv-cache"  # where a host sees uv's package cache (this machine's, writable)
JAX_CACHE = "/srv/jax-cache"  # where a host sees a shared JAX compilation cache, if given one
# A directory of this machine every emulated host and pod mounts as its JAX compilation cache
# (the test suite sets it: tests/conftest.py); unset, the trainer uses its run directory's.
EMULATED_JAX_CACHE_ENV = "MULTISLICE_EMULATED_JAX_CACHE"
IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# The version the test lock records: the one this machine can provide as a managed download.
INTERPRETER = "3.11.7"
HIDDEN_USR_BIN = ("python3.11", "python3.11-config", "python3-config", "pip", "pip3", "pip3.11",
                  "pydoc3.11", "pygettext3.11", "uv", "uvx")
_PRUNE = ("test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "__pycache__",
          "ensurepip")


class ImageUnavailable(RuntimeError):
    """This machine lacks a part the image is rebuilt from (the message names it)."""


def _find_python(minor: str) -> Path:
    for candidate in sorted(PYENV.glob(f"{minor}.*"), reverse=True):
        if (candidate / "bin" / f"python{minor}").exists():
            return candidate
    raise ImageUnavailable(f"no Python {minor} under {PYENV} to build the emulated image from")


def _copy_python(src: Path, dest: Path, minor: str, keep_site: tuple[str, ...]) -> Path:
    """A relocated copy of a CPython install: bin/pythonX.Y finds lib/ through $ORIGIN."""
    (dest / "bin").mkdir(parents=True)
    (dest / "lib").mkdir()
    binary = dest / "bin" / f"python{minor}"
    shutil.copy2(src / "bin" / f"python{minor}", binary)
    for lib in src.joinpath("lib").glob(f"libpython{minor}*.so*"):
        shutil.copy2(lib, dest / "lib" / lib.name, follow_symlinks=True)
    shutil.copytree(src / "lib" / f"python{minor}", dest / "lib" / f"python{minor}",
                    symlinks=True, ignore=shutil.ignore_patterns(*_PRUNE, "site-packages"))
    site = dest / "lib" / f"python{minor}" / "site-packages"
    site.mkdir()
    for name in keep_site:
        for path in (src / "lib" / f"python{minor}" / "site-packages").glob(name):
            if path.is_dir():
                shutil.copytree(path, site / path.name, symlinks=True,
                                ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(path, site / path.name)
    patchelf = VENV_BIN / "patchelf"
    if not patchelf.exists():
        raise ImageUnavailable("patchelf is not installed in the toolkit venv (dev extra)")
    subprocess.run([str(patchelf), "--set-rpath", "$ORIGIN/../lib", str(binary)], check=True)
    for link in ("python3", "python"):
        (dest / "bin" / link).symlink_to(binary.name)
    return binary


def _interpreter_archive(mirror: Path, version: str) -> None:
    """A python-build-standalone style install-only archive of `version` and a downloads JSON
    that lists it, in the format of uv's own download metadata."""
    minor = ".".join(version.split(".")[:2])
    src = PYENV / version
    if not (src / "bin" / f"python{minor}").exists():
        raise ImageUnavailable(f"no Python {version} under {PYENV} to serve as the managed "
                               "interpreter download")
    stage = mirror / "stage"
    _copy_python(src, stage / "python", minor, keep_site=())
    name = f"cpython-{version}-linux-x86_64-gnu"
    archive = mirror / f"{name}-install_only.tar.gz"
    with tarfile.open(archive, "w:gz", compresslevel=1) as tar:
        tar.add(stage / "python", arcname="python")
    shutil.rmtree(stage)
    major, minor_n, patch = (int(p) for p in version.split("."))
    entry = {"name": "cpython", "arch": {"family": "x86_64", "variant": None}, "os": "linux",
             "libc": "gnu", "major": major, "minor": minor_n, "patch": patch, "prerelease": "",
             "url": f"file://{MIRROR}/{archive.name}",
             "sha256": hashlib.sha256(archive.read_bytes()).hexdigest(), "variant": None,
             "build": "local"}
    (mirror / "python-downloads.json").write_text(json.dumps({name: entry}))


def _uv_wheel(wheels: Path) -> None:
    """The wheel of the uv version the startup script pins (from PyPI or pip's cache)."""
    from infra.stack_config.manifest import startup_script

    version = next(line.split('"')[1] for line in startup_script().splitlines()
                   if line.startswith("UV_VERSION="))
    result = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
         "--platform", "manylinux_2_17_x86_64", "--python-version", "3.10",
         "--dest", str(wheels), f"uv=={version}"], capture_output=True, text=True)
    if result.returncode != 0 or not list(wheels.glob("uv-*.whl")):
        raise ImageUnavailable(f"cannot download the uv {version} wheel: {result.stderr[-500:]}")


@dataclass(frozen=True)
class Image:
    """The parts every emulated host mounts (built once per test session)."""

    usr_local: Path
    usr_bin_upper: Path
    mirror: Path


def _usr(root: Path, minor: str) -> tuple[Path, Path]:
    """/usr/local holding a CPython `minor` with pip, and the /usr/bin overlay's upper layer:
    python3 is that CPython, and this machine's own Pythons and tools are whited out."""
    usr_local = root / "usr-local"
    _copy_python(_find_python(minor), usr_local, minor,
                 keep_site=("pip", "pip-*.dist-info", "setuptools", "setuptools-*.dist-info",
                            "_distutils_hack", "distutils-precedence.pth",
                            "_sandboxing_egress_ca.pth"))
    upper = root / "usr-bin-upper"
    upper.mkdir()
    (upper / "python3").symlink_to(f"/usr/local/bin/python{minor}")
    for name in HIDDEN_USR_BIN:  # overlayfs whiteouts: these names do not exist on the image
        os.mknod(upper / name, 0o600 | 0o020000, os.makedev(0, 0))
    return usr_local, upper


def build_image(root: Path) -> Image:
    usr_local, upper = _usr(root, "3.10")
    mirror = root / "mirror"
    (mirror / "wheels").mkdir(parents=True)
    _interpreter_archive(mirror, INTERPRETER)
    _uv_wheel(mirror / "wheels")
    (mirror / "hooks").mkdir()
    (mirror / "hooks" / "sitecustomize.py").write_text(EMULATED_LIBTPU)
    return Image(usr_local, upper, mirror)


def build_container_image(root: Path, vm_image: Image) -> Image:
    """The GKE pods' default container (infra.stack_config.schema.DEFAULT_GKE_IMAGE, Docker's
    python:3.11-bookworm): CPython 3.11 with pip in /usr/local, python3 on PATH, no uv, run as
    root. The network it reaches is the VM image's mirror: the same downloads a real pod makes."""
    usr_local, upper = _usr(root, "3.11")
    (root / "mirror").symlink_to(vm_image.mirror)
    return Image(usr_local, upper, root / "mirror")


# What libtpu does first in a trainer, which a CPU run would skip: open every TPU device node
# read-write. A trainer whose user lacks the nodes' group (or runs with --clear-groups) fails
# here as it would on a TPU VM. Reaches the trainer as sitecustomize through PYTHONPATH (every
# Python on the host sees it; only `-m trainer.main` acts on it).
EMULATED_LIBTPU = '''
import glob
import os
import sys

if "trainer.main" in getattr(sys, "orig_argv", ()):
    for node in sorted(glob.glob("/dev/accel*") + glob.glob("/dev/vfio/[0-9]*")):
        try:
            os.close(os.open(node, os.O_RDWR))
        except OSError as err:
            sys.exit(f"emulated libtpu: cannot open TPU device {node}: {err.strerror} "
                     f"(uid {os.getuid()}, groups {sorted(os.getgroups())})")
'''


# A CPU process whose Gloo peer died spins a core in Gloo's event loop until JAX's coordination
# service declares the peer dead (measured: 76 s at 100% CPU after a kill at JAX's default 100 s
# heartbeat timeout, 17 s at 20 s). The trainer reads this (trainer/runtime/distributed.py); a real host
# keeps JAX's default, since a TPU runtime waiting on a dead peer does not spin.
EMULATED_HEARTBEAT_TIMEOUT_S = 30


def emulated_xla_flags(devices: int) -> str:
    """XLA_FLAGS of an emulated TPU host or pod: `devices` CPU devices stand in for its chips,
    and XLA:CPU compiles at LLVM optimization level 0. The emulated jobs run tiny models for a
    few dozen steps, so LLVM's optimizations cost more than they save: measured on the fork's
    programs, compiling takes 1.7x less CPU (8.7 -> 3.9 s for a 1-layer llama-tiny step on 8
    devices), each step about 2x more. Every process of a job gets the same flags (JAX's cache
    key includes them), so their results still agree bit for bit."""
    return (f"--xla_force_host_platform_device_count={devices} "
            "--xla_backend_optimization_level=0")


def image_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment the guest agent gives the startup script (a systemd service: no HOME),
    plus the download overrides."""
    return {
        "PATH": IMAGE_PATH,
        "LANG": "C.UTF-8",
        "UV_PYTHON_DOWNLOADS_JSON_URL": f"{MIRROR}/python-downloads.json",
        "UV_CACHE_DIR": UV_CACHE,
        "UV_OFFLINE": "1",
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": f"{MIRROR}/wheels",
        "PIP_CONFIG_FILE": "/dev/null",
        "PYTHONPATH": f"{MIRROR}/hooks",  # EMULATED_LIBTPU
        **extra,
    }


# Runs as root inside `unshare --mount --uts` at every boot of a host (its disks, /etc included,
# persist across its boots): $1 host name, $2 the host's private directory,
# $3 image parts, $4 uv cache on this machine, $5 group of the emulated TPU device nodes ("" for
# none), $6 the size in MiB of the host's own disk ("" for this machine's free space; a sized
# disk is a tmpfs that lasts one boot), $7 the TPU device layout (`accel`: v4's /dev/accelN;
# `vfio`: v5e and later, /dev/vfio/N plus /dev/vfio/vfio), $8 a JAX compilation cache on this
# machine to mount at JAX_CACHE ("" for none), $9 directories of this machine to mount in the
# host ("SRC:DST ...": a GKE node's hostPath volumes in its pods; "" for none), then the command
# to run.
# A host's own directories, on its own disk ($2/fs): what a VM keeps across its reboots.
HOST_DISK_DIRS = ("root", "home", "opt", "var/lib/multislice", "var/log/multislice", "tmp")
HOST_SETUP = r"""
set -euo pipefail
name="$1" priv="$2" image="$3" uv_cache="$4" accel_group="$5" disk_mb="$6" layout="$7"
jax_cache="$8" binds="$9"
shift 9
mount --make-rprivate /
if [[ -n "$disk_mb" ]]; then  # what the host's directories hold so far, on a disk that size
  mkdir -p "$priv/fs" "$priv/disk"
  mount -t tmpfs -o "size=${disk_mb}m,mode=755" tmpfs "$priv/disk"
  cp -a "$priv/fs/." "$priv/disk/"
  mount --bind "$priv/disk" "$priv/fs"
fi
# Everything that reads $priv or $image (under this machine's /tmp) before /tmp is replaced.
mkdir -p "$priv/etc-upper" "$priv/etc-work" "$priv/usr-bin-work" "$priv/dev"
mount -t overlay overlay -o "lowerdir=/etc,upperdir=$priv/etc-upper,workdir=$priv/etc-work" /etc
[[ -d "$priv/usr-bin-upper" ]] || cp -a "$image/usr-bin-upper" "$priv/usr-bin-upper"
mount -t overlay overlay \
  -o "lowerdir=/usr/bin,upperdir=$priv/usr-bin-upper,workdir=$priv/usr-bin-work" /usr/bin
mount --bind "$image/usr-local" /usr/local
mount -o remount,bind,ro /usr/local
mkdir -p /srv/multislice-mirror /srv/uv-cache
mount --bind "$image/mirror" /srv/multislice-mirror
mount -o remount,bind,ro /srv/multislice-mirror
mount --bind "$uv_cache" /srv/uv-cache
if [[ -n "$jax_cache" ]]; then
  mkdir -p /srv/jax-cache
  mount --bind "$jax_cache" /srv/jax-cache
fi
held=()  # each SRC held at a private place until its DST exists (after the host's own disks)
for bind in $binds; do  # SRC:DST, or SRC:DST:ro for a read-only mount
  held+=("/srv/bind-${#held[@]}:${bind#*:}")
  mkdir -p "${bind%%:*}" "${held[-1]%%:*}"
  mount --bind "${bind%%:*}" "${held[-1]%%:*}"
done
printf '127.0.0.1 localhost\n127.0.1.1 %s\n' "$name" >/etc/hosts
# A host's own name records (a VPC's private DNS zone) and a CA bundle its image lists
[[ ! -f "$priv/extra-hosts" ]] || cat "$priv/extra-hosts" >>/etc/hosts
[[ ! -f "$priv/ca-certificates.crt" ]] || cp "$priv/ca-certificates.crt" /etc/ssl/certs/
hostname "$name"
dev="$priv/dev"
mount -t tmpfs -o mode=755 tmpfs "$dev"
for node in null zero full random urandom tty; do
  touch "$dev/$node"
  mount --bind "/dev/$node" "$dev/$node"
done
mkdir "$dev/pts" "$dev/shm"
mount --rbind /dev/pts "$dev/pts"
mount -t tmpfs -o mode=1777 tmpfs "$dev/shm"
ln -s /proc/self/fd "$dev/fd"
ln -s /proc/self/fd/0 "$dev/stdin"
ln -s /proc/self/fd/1 "$dev/stdout"
ln -s /proc/self/fd/2 "$dev/stderr"
if [[ -n "$accel_group" ]]; then
  getent group "$accel_group" >/dev/null || groupadd --system "$accel_group"
  if [[ "$layout" == vfio ]]; then  # v5e and later: IOMMU groups /dev/vfio/N and the container
    mkdir "$dev/vfio"
    : >"$dev/vfio/vfio"
    chmod 0666 "$dev/vfio/vfio"
    nodes=("$dev"/vfio/{0,1,2,3})
  else  # v4: /dev/accelN
    nodes=("$dev"/accel{0,1,2,3})
  fi
  for node in "${nodes[@]}"; do
    : >"$node"
    chgrp "$accel_group" "$node"
    chmod 0660 "$node"
  done
fi
mount --rbind "$dev" /dev
for dir in """ + " ".join(HOST_DISK_DIRS) + r"""; do
  mkdir -p "$priv/fs/$dir" "/$dir"
  mount --bind "$priv/fs/$dir" "/$dir"
done
for bind in "${held[@]}"; do
  target="${bind#*:}" readonly=0
  [[ "$target" != *:ro ]] || { target="${target%:ro}"; readonly=1; }
  mkdir -p "$target"
  mount --move "${bind%%:*}" "$target"
  (( ! readonly )) || mount -o remount,bind,ro "$target"
done
chmod 700 /root
chmod 1777 /tmp
exec "$@"
"""
