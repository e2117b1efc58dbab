"""Emulated TPU VM boots of infra/vm/startup.sh, through faithful stand-ins only.

Each `Host` is one TPU VM: its own state and log directories, its own hostname (a UTS namespace),
the fake metadata server (launch spec, launch.py, an access token) and a real GCS JSON API server
(fake-gcs-server) holding the experiment archive, the run directory and the published
environments. The startup script runs unchanged: it fetches the archive over the GCS API, builds
the environment with the real `uv pip sync --require-hashes` from the experiment's lock, and runs
the template's trainer on CPU against the gs:// run directory.

The experiment is the template with an empty `tpu` extra (there is no libtpu on CPU), locked for
this machine with `--offline` against the versions in the toolkit's own venv, so uv installs from
its cache: nothing is downloaded and every version is exact.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from infra import manifest
from infra.archive import build_archive
from infra.lock import TPU_PLATFORM, write_lock
from infra.schema import parse_stack, validate_stack
from tests.support.gcs_emulator import GcsEmulator
from tests.support.metadata_server import FakeMetadataServer

ROOT = Path(__file__).resolve().parents[2]
STARTUP = ROOT / "infra" / "vm" / "startup.sh"
VENV_BIN = Path(sys.executable).parent


def uv_cache_dir() -> str:
    out = subprocess.run([str(VENV_BIN / "uv"), "cache", "dir"], capture_output=True, text=True,
                         check=True)
    return out.stdout.strip()


def boot_experiment(dest: Path) -> Path:
    """The template, rendered, with an empty tpu extra and a lock this machine can install."""
    from scripts.new import render_template

    exp = render_template("boot", dest)
    pyproject = exp / "pyproject.toml"
    text, count = re.subn(r'(?m)^tpu = \[.*\]$', "tpu = []", pyproject.read_text())
    assert count == 1, "the template's tpu extra line moved"
    pyproject.write_text(text)
    freeze = subprocess.run([str(VENV_BIN / "uv"), "pip", "freeze", "--python", sys.executable],
                            capture_output=True, text=True, check=True).stdout
    constraints = dest / "constraints.txt"
    constraints.write_text("".join(line + "\n" for line in freeze.splitlines()
                                   if "==" in line and not line.startswith("multislice-toolkit")))
    write_lock(exp, "3.11", platform=TPU_PLATFORM,
               extra_args=["--offline", "-c", str(constraints)])
    return exp


class Stack:
    """One stack's launch spec and archive, uploaded to the emulator's bucket."""

    def __init__(self, gcs: GcsEmulator, experiment: Path, name: str, *, slices: int = 1,
                 steps: int = 5, overrides: dict[str, Any] | None = None,
                 init_timeout_s: int = 600) -> None:
        self.gcs = gcs
        raw = {
            "project": "my-proj", "region": "us-central2", "zone": "us-central2-b",
            "accelerator_type": "v5litepod-4", "slices": slices,
            "experiment_dir": str(experiment),
            "trainer": {"config": "tiny", "steps": steps, "seed": 0,
                        "overrides": overrides or {}, "init_timeout_s": init_timeout_s},
        }
        self.cfg = parse_stack(raw, name)
        validate_stack(self.cfg)
        self.bucket = self.cfg.names.bucket
        gcs.create_bucket(self.bucket)
        archive = build_archive(experiment)
        self.archive_object = archive.object_name
        gcs.put(self.bucket, self.archive_object, archive.data)
        self.sha = archive.sha256
        self.run_prefix = self.cfg.names.run_dir.removeprefix(f"gs://{self.bucket}/")

    def attributes(self, **trainer_changes: Any) -> dict[str, str]:
        spec = manifest.launch_spec(self.cfg, self.sha)
        spec["config"]["trainer"].update(trainer_changes)
        return {
            "launch-spec": json.dumps(spec),
            "multislice-launch-py": (ROOT / "infra" / "vm" / "launch.py").read_text(),
        }

    def events(self) -> list[dict[str, Any]]:
        text = self.gcs.get(self.bucket, f"{self.run_prefix}/metrics.jsonl").decode()
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def summary(self) -> dict[str, Any]:
        return json.loads(self.gcs.get(self.bucket, f"{self.run_prefix}/summary.json"))

    def objects(self, prefix: str = "") -> list[str]:
        return self.gcs.list(self.bucket, prefix)


class Host:
    """One emulated TPU VM."""

    def __init__(self, root: Path, name: str) -> None:
        self.name = name
        self.state = root / name / "state"
        self.logs = root / name / "log"
        self.cache = root / name / "cache"
        self.proc: subprocess.Popen[str] | None = None
        self.started = 0.0

    def start(self, stack: Stack, metadata: FakeMetadataServer,
              cluster: dict[str, str] | None = None) -> None:
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("MULTISLICE_")},
            **stack.gcs.env,
            "GCE_METADATA_HOST": metadata.host,
            "MULTISLICE_STATE_DIR": str(self.state),
            "MULTISLICE_LOG_DIR": str(self.logs),
            "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",  # uv, as on the image
            "UV_OFFLINE": "1",
            "UV_CACHE_DIR": uv_cache_dir(),
            "XDG_CACHE_HOME": str(self.cache),
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
            **(cluster or {}),
        }
        # A VM's own hostname resolves (GCE's DNS does it); gloo looks it up to pick its
        # address. Here: a UTS namespace for the name, a mount namespace for /etc/hosts.
        hosts = self.state.parent / "hosts"
        hosts.parent.mkdir(parents=True, exist_ok=True)
        hosts.write_text(f"127.0.0.1 localhost\n127.0.1.1 {self.name}\n")
        self.started = time.time()
        # Not root (a CI runner): a user namespace maps us to root inside, where both are allowed.
        namespaces = ["--uts", "--mount"] if os.geteuid() == 0 else [
            "--user", "--map-root-user", "--uts", "--mount"]
        self.proc = subprocess.Popen(
            ["unshare", *namespaces, "bash", "-c",
             'mount --bind "$2" /etc/hosts && hostname "$0" && MULTISLICE_RUN_AS="$(id -un)" '
             'exec bash "$1"', self.name, str(STARTUP), str(hosts)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def wait(self, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        assert self.proc is not None
        out, err = self.proc.communicate(timeout=timeout)
        result = subprocess.CompletedProcess(self.proc.args, self.proc.returncode, out, err)
        self.proc = None
        return result

    def boot(self, stack: Stack, attributes: dict[str, str],
             cluster: dict[str, str] | None = None,
             timeout: float = 600) -> subprocess.CompletedProcess[str]:
        with FakeMetadataServer(attributes) as md:
            self.start(stack, md, cluster)
            return self.wait(timeout)

    def train_log(self) -> str:
        path = self.logs / "train.log"
        return path.read_text() if path.exists() else "(no train.log)"

    def explain(self, result: subprocess.CompletedProcess[str]) -> str:
        return f"--- {self.name} startup ---\n{result.stderr[-3000:]}\n--- train.log ---\n" \
               f"{self.train_log()[-3000:]}"

    def venvs(self) -> list[Path]:
        root = self.state / "venvs"
        return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def installed_pins(venv: Path) -> dict[str, str]:
    out = subprocess.run([str(VENV_BIN / "uv"), "pip", "freeze", "--python",
                          str(venv / "bin" / "python")], capture_output=True, text=True,
                         check=True).stdout
    return {name.lower().replace("_", "-"): version for name, _, version in
            (line.partition("==") for line in out.splitlines()) if version}
