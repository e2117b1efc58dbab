"""The CPython builds the lock pins for TPU VMs (infra/packaging/lock.py VM_INTERPRETERS) are in the pinned
uv's own download list (startup.sh UV_VERSION): a pin that uv cannot download would fail on every
VM at boot, after preview passed."""

from __future__ import annotations

import json
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from infra.packaging.lock import VM_INTERPRETERS
from scripts.emulators.tpu_image import ImageUnavailable, _uv_wheel


def test_every_vm_interpreter_is_a_download_of_the_pinned_uv(tmp_path: Path) -> None:
    try:
        _uv_wheel(tmp_path)  # the wheel of the version startup.sh pins, from PyPI or pip's cache
    except ImageUnavailable as exc:
        pytest.skip(str(exc))
    [wheel] = tmp_path.glob("uv-*.whl")
    uv = tmp_path / "uv"
    with zipfile.ZipFile(wheel) as archive:
        [member] = [n for n in archive.namelist() if n.endswith(".data/scripts/uv")]
        uv.write_bytes(archive.read(member))
    uv.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("UV_")}  # its own list
    listed = subprocess.run([str(uv), "python", "list", "--all-versions", "--only-downloads",
                             "--all-platforms", "--all-arches", "--output-format", "json"],
                            env=env,
                            capture_output=True, text=True, check=True, timeout=60).stdout
    keys = {entry["key"] for entry in json.loads(listed)}
    for version in VM_INTERPRETERS.values():
        for machine in ("x86_64", "aarch64"):
            assert f"cpython-{version}-linux-{machine}-gnu" in keys, (version, machine)
