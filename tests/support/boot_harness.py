"""Emulated TPU VM boots of infra/vm/startup.sh, through faithful stand-ins only.

Each `Host` is one TPU VM of the image that tests/support/tpu_image.py rebuilds: its own mount and
UTS namespaces (python3 3.10 and no uv on PATH; its own /root, /home, /opt, /tmp, /etc overlay,
/var/lib/multislice, /var/log/multislice and /dev with emulated TPU device nodes), its own fake
metadata server (launch spec, launch.py, an access token, and the per-worker `tpu-env`,
`agent-worker-number` and `worker-network-endpoints` the TPU runtime publishes, which the trainer's
cluster detection reads), and a real GCS JSON API server (fake-gcs-server) holding the experiment
archive, the run directory and the published environments. The startup script runs unchanged, as
root: it fetches the archive over the GCS API, installs the lock's CPython with the pinned uv
(downloaded from the image's mirror through `UV_PYTHON_DOWNLOADS_JSON_URL`), builds the
environment with the real `uv pip sync --require-hashes`, and runs the template's trainer on CPU
against the gs:// run directory.

The experiment is the template with an empty `tpu` extra (there is no libtpu on CPU), locked for
this machine with `--offline` against the versions in the toolkit's own venv, so uv installs from
its cache: nothing is downloaded and every version is exact.
"""

from __future__ import annotations

import json
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
from scripts.testing.tpu_emulator import worker_metadata
from tests.support.gcs_emulator import GcsEmulator
from tests.support.metadata_server import FakeMetadataServer
from tests.support.tpu_image import HOST_SETUP, INTERPRETER, Image, image_env

ROOT = Path(__file__).resolve().parents[2]
STARTUP = ROOT / "infra" / "vm" / "startup.sh"
VENV_BIN = Path(sys.executable).parent
ACCEL_GROUP = "accel"  # group of the emulated /dev/accel* nodes (root:accel 0660)


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
    write_lock(exp, "3.11", platform=TPU_PLATFORM, interpreter=INTERPRETER,
               extra_args=["--offline", "-c", str(constraints)])
    return exp


class Stack:
    """One stack's launch spec and archive, uploaded to the emulator's bucket."""

    def __init__(self, gcs: GcsEmulator, experiment: Path, name: str, *, slices: int = 1,
                 steps: int = 5, overrides: dict[str, Any] | None = None,
                 init_timeout_s: int = 600, run_as: str = "root",
                 storage_retry_s: int = 600) -> None:
        self.gcs = gcs
        raw = {
            "project": "my-proj", "region": "us-central2", "zone": "us-central2-b",
            "accelerator_type": "v5litepod-4", "slices": slices,
            "experiment_dir": str(experiment),
            "trainer": {"config": "tiny", "steps": steps, "seed": 0,
                        "overrides": overrides or {}, "init_timeout_s": init_timeout_s,
                        "run_as": run_as},
            "storage_retry_s": storage_retry_s,
        }
        self.cfg = parse_stack(raw, name)
        validate_stack(self.cfg)
        self.bucket = self.cfg.names.bucket
        gcs.create_bucket(self.bucket)
        self.experiment = experiment
        self.sha = self.upload_archive()
        self.run_prefix = self.cfg.names.run_dir.removeprefix(f"gs://{self.bucket}/")

    def upload_archive(self) -> str:
        """Upload the experiment archive as `pulumi up` does; returns its sha256."""
        archive = build_archive(self.experiment)
        self.archive_object = archive.object_name
        self.gcs.put(self.bucket, self.archive_object, archive.data)
        return archive.sha256

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
    """One emulated TPU VM: worker 0 of slice `slice_index` (v5litepod-4: one host a slice)."""

    def __init__(self, image: Image, root: Path, name: str, slice_index: int = 0) -> None:
        self.image = image
        self.name = name
        self.slice_index = slice_index
        self.priv = root / name
        self.fs = self.priv / "fs"
        self.proc: subprocess.Popen[str] | None = None
        self.metadata: FakeMetadataServer | None = None
        self.started = 0.0

    @property
    def state(self) -> Path:
        return self.fs / "var" / "lib" / "multislice"

    @property
    def logs(self) -> Path:
        return self.fs / "var" / "log" / "multislice"

    def start(self, stack: Stack, attributes: dict[str, str],
              gcs_url: str | None = None) -> None:
        """Boot: the startup script as root in the host's namespaces, as the guest agent runs
        it. `gcs_url` replaces the emulator's URL (a proxy in front of it)."""
        slices = stack.cfg.slices
        worker = worker_metadata(stack.cfg.accelerator_type, stack.cfg.names.node_ids,
                                 [["127.0.0.1"]] * slices, self.slice_index, 0)
        self.metadata = FakeMetadataServer({**attributes, **worker}).__enter__()
        gcs = {**stack.gcs.env, **({"STORAGE_EMULATOR_HOST": gcs_url} if gcs_url else {})}
        env = image_env({
            **gcs,
            "GCE_METADATA_HOST": self.metadata.host,  # what google-auth and startup.sh read
            "GCE_METADATA_IP": self.metadata.host,  # what JAX's TPU cluster detection reads
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        })
        # As the guest agent does: the script is a file of the VM's own (here its private /tmp,
        # which also hides this checkout when it lives under this machine's /tmp).
        script = self.fs / "tmp" / "startup-script"
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(STARTUP.read_text())
        self.started = time.time()
        self.proc = subprocess.Popen(
            ["unshare", "--mount", "--uts", "bash", "-c", HOST_SETUP, "host-setup", self.name,
             str(self.priv), str(self.image.usr_local.parent), uv_cache_dir(), ACCEL_GROUP,
             "bash", "/tmp/startup-script"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def wait(self, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        assert self.proc is not None and self.metadata is not None
        try:
            out, err = self.proc.communicate(timeout=timeout)
        finally:
            self.metadata.__exit__(None, None, None)
        result = subprocess.CompletedProcess(self.proc.args, self.proc.returncode, out, err)
        self.proc = None
        return result

    def boot(self, stack: Stack, attributes: dict[str, str], timeout: float = 600,
             gcs_url: str | None = None) -> subprocess.CompletedProcess[str]:
        self.start(stack, attributes, gcs_url=gcs_url)
        return self.wait(timeout)

    def train_log(self) -> str:
        path = self.logs / "train.log"
        return path.read_text() if path.exists() else "(no train.log)"

    def explain(self, result: subprocess.CompletedProcess[str]) -> str:
        startup = self.logs / "startup.log"
        detail = startup.read_text()[-2000:] if startup.exists() else ""
        return f"--- {self.name} startup ---\n{result.stderr[-3000:]}\n--- startup.log ---\n" \
               f"{detail}\n--- train.log ---\n{self.train_log()[-3000:]}"

    def envs(self) -> list[Path]:
        root = self.fs / "opt" / "multislice" / "envs"
        return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def installed_pins(env_dir: Path) -> dict[str, str]:
    """{name: version} of what the environment's venv holds, from its dist-info directories
    (read from outside the host: the venv's interpreter path only exists inside it)."""
    pins = {}
    for site in env_dir.glob("venv/lib/python3.*/site-packages"):
        for info in site.glob("*.dist-info"):
            name, _, version = info.name.removesuffix(".dist-info").partition("-")
            pins[canonical(name)] = version
    return pins


def canonical(name: str) -> str:
    """A distribution name normalised as PEP 503 does."""
    return re.sub(r"[-_.]+", "-", name).lower()
