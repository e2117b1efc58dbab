"""Emulated TPU VM boots of infra/boot/startup.sh, through faithful stand-ins only.

Each `Host` is one TPU VM of the image that scripts/emulators/tpu_image.py rebuilds, in its job's
network namespace (scripts/emulators/netns.py: the job's own loopback, so its own coordinator port)
with its own mount and UTS namespaces (python3 3.10 and no uv on PATH; its own /root, /home,
/opt, /tmp, /etc overlay, /var/lib/multislice, /var/log/multislice and /dev with emulated TPU
device nodes), its own fake metadata server (launch spec, launch.py, an access token, and the
per-worker `tpu-env`, `agent-worker-number` and `worker-network-endpoints` the TPU runtime
publishes, which the trainer's cluster detection reads), and a real GCS JSON API server (fake-gcs-server) holding the experiment
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

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from infra.packaging.archive import build_archive
from infra.packaging.lock import LOCK_FILE, TPU_PLATFORM, LockError, write_lock
from infra.stack_config import manifest
from infra.stack_config.schema import parse_stack
from infra.stack_config.topology import parse_accelerator_type
from infra.stack_config.validation import validate_stack
from scripts.emulators.gcs_emulator import GcsEmulator
from scripts.emulators.metadata_server import FakeMetadataServer
from scripts.emulators.netns import JobNetwork
from scripts.emulators.tpu_emulator import worker_metadata
from scripts.emulators.tpu_image import (
    EMULATED_HEARTBEAT_TIMEOUT_S,
    EMULATED_JAX_CACHE_ENV,
    HOST_SETUP,
    INTERPRETER,
    JAX_CACHE,
    Image,
    ImageUnavailable,
    emulated_xla_flags,
    image_env,
)

ROOT = Path(__file__).resolve().parents[2]
STARTUP = ROOT / "infra" / "boot" / "startup.sh"
VENV_BIN = Path(sys.executable).parent
ACCEL_GROUP = "accel"  # group of the emulated TPU device nodes (root:accel 0660)


# An absl fatal error's stack frames ("    @     0x7f..."): dozens of lines with no reason in them.
_STACK_FRAME = re.compile(r"^\s+@\s+0x[0-9a-f]+ .*\n?", re.MULTILINE)


def log_tail(text: str, chars: int) -> str:
    """The end of a host's log for a failing test's report, native stack frames left out."""
    return _STACK_FRAME.sub("", text)[-chars:]


def device_layout(accelerator_type: str) -> str:
    """How the TPU VM image exposes the chips: v4 as /dev/accelN, v5e and later through VFIO
    (/dev/vfio/N, one IOMMU group a chip, and /dev/vfio/vfio), as a v5litepod VM lists them."""
    return "accel" if accelerator_type.startswith("v4-") else "vfio"


def uv_cache_dir() -> str:
    out = subprocess.run([str(VENV_BIN / "uv"), "cache", "dir"], capture_output=True, text=True,
                         check=True)
    return out.stdout.strip()


def boot_experiment(dest: Path) -> Path:
    """The template, rendered, with an empty tpu extra and a lock this machine can install."""
    from scripts.new import render_template

    return make_cpu_installable(render_template("boot", dest), dest)


def make_cpu_installable(exp: Path, workdir: Path, python_version: str = "3.11") -> Path:
    """Empty the experiment's `tpu` extra (there is no libtpu on CPU) and lock it again for the
    emulated image, offline, at the versions of the toolkit's own venv, so that uv installs
    from its cache. Without uv's "via" comments, which name where the files were: the same
    experiment gives the same lock (so the same environment key) from any directory. Raises
    LockError (uv's message) for a dependency this venv lacks."""
    pyproject = exp / "pyproject.toml"
    text, count = re.subn(r'(?m)^tpu = \[.*\]$', "tpu = []", pyproject.read_text())
    if count != 1:
        raise LockError(f"{pyproject}: no one-line `tpu = [...]` extra to empty for CPU")
    pyproject.write_text(text)
    freeze = subprocess.run([str(VENV_BIN / "uv"), "pip", "freeze", "--python", sys.executable],
                            capture_output=True, text=True, check=True).stdout
    constraints = workdir / "constraints.txt"
    constraints.write_text("".join(line + "\n" for line in freeze.splitlines()
                                   if "==" in line and not line.startswith("multislice-toolkit")))
    write_lock(exp, python_version, platform=TPU_PLATFORM, interpreter=INTERPRETER,
               extra_args=["--offline", "--no-annotate", "-c", str(constraints)])
    return exp


class Stack:
    """One stack's archive and launch spec object, uploaded to the emulator's bucket as `pulumi
    up` does (infra/cloud/storage.py)."""

    def __init__(self, gcs: GcsEmulator, experiment: Path, name: str, *, slices: int = 1,
                 accelerator_type: str = "v5litepod-4",
                 steps: int = 5, overrides: dict[str, Any] | None = None,
                 init_timeout_s: int = 600, run_as: str = "root",
                 storage_retry_s: int = 600, spec_poll_s: int = 60,
                 envs_from: Stack | None = None, raw: dict[str, Any] | None = None) -> None:
        """`envs_from`: start with the environment the deployer published for another stack
        (envs/ of its bucket) and pinned in its spec, as a stack whose deployer published it
        (`pulumi up` on Linux x86_64, or `multislice env-publish`) has them.
        `raw`: the stack's own keys (a user's stack file), instead of the ones made here from
        the other arguments."""
        self.gcs = gcs
        self._network: JobNetwork | None = None
        raw = raw or {
            "project": "my-proj", "region": "us-central2", "zone": "us-central2-b",
            "accelerator_type": accelerator_type, "slices": slices,
            "experiment_dir": str(experiment),
            "trainer": {"config": "tiny", "steps": steps, "seed": 0,
                        "overrides": overrides or {}, "init_timeout_s": init_timeout_s,
                        "run_as": run_as},
            "storage_retry_s": storage_retry_s,
            "spec_poll_s": spec_poll_s,
        }
        self.raw = raw
        self.name = name
        self.cfg = parse_stack(raw, name)
        validate_stack(self.cfg)
        self.bucket = self.cfg.names.bucket
        if self.bucket not in gcs.buckets():
            gcs.create_bucket(self.bucket)
        self.env_sha256: str | None = None
        if envs_from is not None:
            for name in envs_from.objects("envs/"):
                gcs.put(self.bucket, name, gcs.get(envs_from.bucket, name))
        self.experiment = experiment
        self.sha = self.upload_archive()
        self.publish_spec()

    def upload_archive(self) -> str:
        """Upload the experiment archive as `pulumi up` does; returns its sha256."""
        archive = build_archive(self.experiment)
        self.archive_object = archive.object_name
        self.gcs.put(self.bucket, self.archive_object, archive.data)
        return archive.sha256

    @property
    def run_prefix(self) -> str:
        return self.cfg.names.run_dir.removeprefix(f"gs://{self.bucket}/")

    def publish_spec(self, run_name: str | None = None, **trainer_changes: Any) -> str:
        """Write the launch spec object for the stack with these trainer changes, as `pulumi up`
        does (delete, then create: infra/cloud/storage.py), and upload the archive it names; returns
        the object's new generation."""
        raw = {**self.raw, "trainer": {**self.raw["trainer"], **trainer_changes}}
        if run_name is not None:
            raw["run_name"] = run_name
        self.raw = raw
        self.cfg = parse_stack(raw, self.name)
        validate_stack(self.cfg)
        self.sha = self.upload_archive()
        self.env_sha256 = self.published_env_sha256()
        name = self.cfg.names.launch_spec_object
        if self.gcs.exists(self.bucket, name):
            self.gcs.delete(self.bucket, name)
        self.gcs.put(self.bucket, name, self.spec_text().encode())
        return self.generation()

    def published_env_sha256(self) -> str | None:
        """What `pulumi up` pins (infra/preview/env_check.py): the digest the deployer wrote
        beside envs/KEY.tar.gz for the experiment's lock, or None."""
        from infra.packaging.env_build import FORMAT, env_key, parse_sha256

        key = env_key(self.experiment / LOCK_FILE)
        name = f"envs/{key}.{FORMAT}.sha256"
        if key is None or not self.gcs.exists(self.bucket, name):
            return None
        return parse_sha256(self.gcs.get(self.bucket, name).decode())

    def spec_text(self) -> str:
        """The launch spec `pulumi up` writes for the stack as it is now (with the digest of the
        deployer's environment when one is published)."""
        return manifest.launch_spec_text(self.cfg, self.sha, self.env_sha256)

    def publish_env(self, env_dir: Path) -> str:
        """Publish the environment in `env_dir` (a host's /opt/multislice/envs/KEY, built by
        the hosts' own build functions, as infra/packaging/env_build.py runs them) as the deployer does:
        envs/KEY.tar.gz, then its .sha256; pin it in a new launch spec. Returns the digest."""
        import base64
        import hashlib

        import google_crc32c

        from infra.packaging.env_build import sha256_text

        with tempfile.TemporaryDirectory(prefix="env-publish-") as tmp:
            tarball = Path(tmp) / "env.tar.gz"
            subprocess.run(["tar", "-C", str(env_dir), "-czf", str(tarball), "python", "venv"],
                           check=True)
            data = tarball.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        name = f"envs/{env_dir.name}.tar.gz"
        self.gcs.put(self.bucket, name, data)
        crc32c = base64.b64encode(google_crc32c.Checksum(data).digest()).decode()
        self.gcs.put(self.bucket, f"{name}.sha256",
                     sha256_text(env_dir.name, digest, crc32c).encode())
        self.publish_spec()
        assert self.env_sha256 == digest, (self.env_sha256, digest)
        return digest

    def network(self) -> JobNetwork:
        """The job's own network namespace, which every host of this stack joins (its own
        loopback, so its own coordinator port); a new one after `Host.stop_all`."""
        if self._network is None or self._network.closed:
            self._network = JobNetwork()
            Host.networks.append(self._network)
        return self._network

    def generation(self) -> str:
        return self.gcs.metadata(self.bucket, self.cfg.names.launch_spec_object)["generation"]

    def spec(self) -> dict[str, Any]:
        return json.loads(self.gcs.get(self.bucket, self.cfg.names.launch_spec_object))

    def attributes(self) -> dict[str, str]:
        """The VMs' metadata, fixed for the stack (infra/stack_config/manifest.py:vm_metadata)."""
        return manifest.vm_metadata(self.cfg)

    def events(self) -> list[dict[str, Any]]:
        text = self.gcs.get(self.bucket, f"{self.run_prefix}/metrics.jsonl").decode()
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def summary(self) -> dict[str, Any]:
        return json.loads(self.gcs.get(self.bucket, f"{self.run_prefix}/summary.json"))

    def objects(self, prefix: str = "") -> list[str]:
        return self.gcs.list(self.bucket, prefix)


class Host:
    """One emulated TPU VM: worker `worker` of slice `slice_index`, with the chips of one host of
    the stack's accelerator type as CPU devices (v5litepod-4: one host a slice; v4-16: two).
    Every host started is listed in `Host.running` until it stops, so a test that fails midway
    can power them all off (`stop_all`) before the next test meets its processes."""

    running: list[Host] = []
    networks: list[JobNetwork] = []
    # True: the trainer uses the product's compile cache (RUN_DIR/compile_cache) even where the
    # harness has a shared one (EMULATED_JAX_CACHE_ENV), for the boot that proves that path.
    product_compile_cache: bool = False

    @classmethod
    def stop_all(cls) -> None:
        """Power off every host, then remove every job's network namespace."""
        for host in list(cls.running):
            host.stop()
        while cls.networks:
            cls.networks.pop().close()

    def __init__(self, image: Image, root: Path, name: str, slice_index: int = 0,
                 disk_mb: int | None = None, worker: int = 0) -> None:
        """`disk_mb`: a disk of that size for the host's own directories (/opt, /var, /root,
        /tmp...), which lasts one boot and is not visible from outside the host."""
        self.image = image
        self.disk_mb = disk_mb
        self.name = name
        self.slice_index = slice_index
        self.worker = worker
        self.priv = root / name
        self.fs = self.priv / "fs"
        self.proc: subprocess.Popen[str] | None = None
        self.metadata: FakeMetadataServer | None = None
        self.started = 0.0
        self.console = self.priv / "console.log"
        self.own_pids = False
        # What a host of an organisation's image has beyond the stock one: names its VPC's DNS
        # answers ({name: address}), a CA bundle it trusts (which the installers are pointed
        # at, as such images do) and environment variables the guest agent gives (None: unset).
        self.names: dict[str, str] = {}
        self.ca_bundle: bytes | None = None
        self.env: dict[str, str | None] = {}

    @property
    def state(self) -> Path:
        return self.fs / "var" / "lib" / "multislice"

    @property
    def logs(self) -> Path:
        return self.fs / "var" / "log" / "multislice"

    def start(self, stack: Stack, attributes: dict[str, str] | None = None,
              gcs_url: str | None = None) -> None:
        """Boot: the startup script as root in the host's namespaces, as the guest agent runs
        it. `gcs_url` replaces the emulator's URL (a proxy in front of it)."""
        slices = stack.cfg.slices
        topology = parse_accelerator_type(stack.cfg.accelerator_type)
        assert self.worker < topology.hosts, (self.worker, topology)
        # Every host of the job is 127.0.0.1 in the job's network namespace.
        worker = worker_metadata(stack.cfg.accelerator_type, stack.cfg.names.node_ids,
                                 [["127.0.0.1"] * topology.hosts] * slices, self.slice_index,
                                 self.worker)
        attributes = stack.attributes() if attributes is None else attributes
        self.metadata = FakeMetadataServer({**attributes, **worker}).__enter__()
        gcs = {**stack.gcs.env, **({"STORAGE_EMULATOR_HOST": gcs_url} if gcs_url else {})}
        network = stack.network()
        for url in (*gcs.values(), f"http://{self.metadata.host}"):
            network.forward(urllib.parse.urlsplit(url).port)
        env = image_env({
            **gcs,
            "GCE_METADATA_HOST": self.metadata.host,  # what google-auth and startup.sh read
            "GCE_METADATA_IP": self.metadata.host,  # what JAX's TPU cluster detection reads
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": emulated_xla_flags(topology.devices // topology.hosts),
            "MULTISLICE_HEARTBEAT_TIMEOUT_S": str(EMULATED_HEARTBEAT_TIMEOUT_S),
        })
        self.priv.mkdir(parents=True, exist_ok=True)
        if self.names:
            (self.priv / "extra-hosts").write_text(
                "".join(f"{address} {name}\n" for name, address in self.names.items()))
        if self.ca_bundle is not None:
            (self.priv / "ca-certificates.crt").write_bytes(self.ca_bundle)
            bundle = "/etc/ssl/certs/ca-certificates.crt"
            env.update(SSL_CERT_FILE=bundle, REQUESTS_CA_BUNDLE=bundle)  # uv and curl; pip
        for key, value in self.env.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        # As the guest agent does: the script is a file of the VM's own (here its private /tmp,
        # which also hides this checkout when it lives under this machine's /tmp).
        script = self.fs / "tmp" / "startup-script"
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(STARTUP.read_text())
        self.launch(network, env, stack.cfg.accelerator_type, ["bash", "/tmp/startup-script"])

    def launch(self, network: JobNetwork, env: dict[str, str], accelerator_type: str,
               command: list[str], binds: Sequence[tuple[Path, str]] = (),
               own_pids: bool = False) -> None:
        """Run `command` as root in the host's namespaces once the image's host setup is done;
        its stderr is the host's console (a VM's serial console, a pod's log). `binds`: this
        machine's directories mounted at paths of the host (a node's hostPath volumes).
        `own_pids`: in a PID namespace of its own, where `command` is PID 1, as a container's
        first process is (`init_pid` names it here): the kernel delivers it only the signals it
        has a handler for, SIGKILL aside."""
        self.own_pids = own_pids
        jax_cache = "" if self.product_compile_cache else os.environ.get(EMULATED_JAX_CACHE_ENV, "")
        if jax_cache:
            env = {**env, "JAX_COMPILATION_CACHE_DIR": JAX_CACHE}
        self.console = self.priv / "console.log"
        self.console.write_text("")
        self.started = time.time()
        if self not in Host.running:
            Host.running.append(self)
        with self.console.open("a") as console:
            self.proc = subprocess.Popen(
                ["nsenter", f"--net={network.path}", "unshare", "--mount", "--uts",
                 *(["--pid", "--fork", "--mount-proc"] if own_pids else []), "bash", "-c",
                 HOST_SETUP, "host-setup",
                 self.name, str(self.priv), str(self.image.usr_local.parent), uv_cache_dir(),
                 ACCEL_GROUP, str(self.disk_mb or ""), device_layout(accelerator_type),
                 jax_cache, " ".join(f"{src}:{dst}" for src, dst in binds), *command],
                env=env, stdout=subprocess.DEVNULL, stderr=console, text=True,
                start_new_session=True)

    def init_pid(self) -> int | None:
        """The pid (here) of the command's first process: PID 1 of its own PID namespace when
        launched with `own_pids` (unshare's one child), else the launched process itself."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        if not self.own_pids:
            return self.proc.pid
        try:
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        except OSError:
            return None
        return int(children.split()[0]) if children.split() else self.proc.pid

    def idle(self) -> bool:
        """The startup script is watching for a new launch spec: the job is done on this one."""
        return "for a new generation (every" in self.console.read_text()

    def exit_status(self) -> int | None:
        """The trainer's last exit status on this boot (state/exit-status), if it exited."""
        path = self.state / "exit-status"
        if not path.exists() or path.stat().st_mtime < self.started:
            return None
        return int(path.read_text().split("exit=")[1].split()[0])

    def spec_state(self) -> str | None:
        """What the host reports for its spec (state/spec-report, as RUN_DIR/logs/HOST.spec)."""
        path = self.state / "spec-report"
        if not path.exists() or path.stat().st_mtime < self.started:
            return None
        return json.loads(path.read_text())["state"]

    def wait(self, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        """Until the script exits (no launch spec to read) or goes idle (done with its spec: the
        job finished, stopped, or the spec cannot be applied): then the VM is stopped.
        returncode: the script's own, else the trainer's last status, else 1 for a spec the host
        reports as failed."""
        assert self.proc is not None and self.metadata is not None
        deadline = time.monotonic() + timeout
        try:
            while self.proc.poll() is None and not self.idle():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name} neither finished nor failed in {timeout}s:\n"
                                       + self.console.read_text()[-3000:])
                time.sleep(0.5)
            code = self.proc.returncode
            if code is None:
                code = self.exit_status()
            if code is None and self.spec_state() == "failed":
                code = 1  # the spec could not be applied (the ERROR line says why)
        finally:
            self.stop()
        return subprocess.CompletedProcess(["startup-script"], code, "", self.console.read_text())

    @staticmethod
    def wait_all(hosts: Sequence[Host], timeout: float = 600
                 ) -> list[subprocess.CompletedProcess[str]]:
        """`wait` for hosts of one job, all under one deadline: a timeout names every host with
        the end of its console, those that already ended included (one that ended early, say
        alone, is usually why the others wait)."""
        deadline = time.monotonic() + timeout
        results: dict[int, subprocess.CompletedProcess[str]] = {}
        while len(results) < len(hosts):
            for i, host in enumerate(hosts):
                if i not in results and (host.proc is None or host.proc.poll() is not None
                                         or host.idle()):
                    results[i] = host.wait(1)
            if len(results) < len(hosts) and time.monotonic() > deadline:
                for host in hosts:
                    host.stop()
                raise TimeoutError(f"not every host of the job finished in {timeout}s:\n" + "\n".join(
                    f"--- {host.name} ({'ended' if i in results else 'still running'}):\n"
                    + host.console.read_text()[-2000:] for i, host in enumerate(hosts)))
            time.sleep(0.5)
        return [results[i] for i in range(len(hosts))]

    def stop(self) -> None:
        """Power off: every process of the VM, then its metadata server."""
        if self.proc is not None:
            # The whole process group, even when its leader (the startup script) has exited: a
            # powered-off VM or a deleted pod leaves no process behind, an orphaned trainer
            # included. The kernel keeps a group's id from reuse while any member lives, so a
            # reaped leader whose pid no process holds names only our orphans, if any.
            if self.proc.poll() is None or not Path(f"/proc/{self.proc.pid}").exists():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None
        if self.metadata is not None:
            self.metadata.__exit__(None, None, None)
            self.metadata = None
        if self in Host.running:
            Host.running.remove(self)

    def boot(self, stack: Stack, attributes: dict[str, str] | None = None, timeout: float = 600,
             gcs_url: str | None = None) -> subprocess.CompletedProcess[str]:
        self.start(stack, attributes, gcs_url=gcs_url)
        return self.wait(timeout)

    def train_log(self) -> str:
        path = self.logs / "train.log"
        return path.read_text() if path.exists() else "(no train.log)"

    def explain(self, result: subprocess.CompletedProcess[str]) -> str:
        startup = self.logs / "startup.log"
        detail = startup.read_text()[-2000:] if startup.exists() else ""
        return f"--- {self.name} startup ---\n{log_tail(result.stderr, 3000)}\n" \
               f"--- startup.log ---\n{detail}\n--- train.log ---\n" \
               f"{log_tail(self.train_log(), 3000)}"

    def envs(self) -> list[Path]:
        root = self.fs / "opt" / "multislice" / "envs"
        return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def deployer_env(**extra: str) -> dict[str, str]:
    """A deployer's machine (this one) whose package index is the emulated image's mirror, as
    pip and uv read it: uv's offline cache, the mirror's wheels and CPython downloads. Run its
    commands under `with_mirror` (the mirror at the path its metadata names)."""
    from scripts.emulators.tpu_image import MIRROR

    return {**os.environ, "UV_PYTHON_DOWNLOADS_JSON_URL": f"{MIRROR}/python-downloads.json",
            "UV_CACHE_DIR": uv_cache_dir(), "UV_OFFLINE": "1", "PIP_NO_INDEX": "1",
            "PIP_FIND_LINKS": f"{MIRROR}/wheels", "PIP_CONFIG_FILE": "/dev/null", **extra}


def lock_wheels(lock: Path, dest: Path) -> Path:
    """Every wheel `lock` pins, as the files PyPI serves (hash-checked against the lock), for
    the image's interpreter on manylinux x86_64: what an organisation's index would serve the
    hosts. Downloaded from PyPI by this machine's pip (its cache helps), with none of this
    machine's pip configuration (find-links, extra indexes or constraints of its own)."""
    dest.mkdir(parents=True, exist_ok=True)
    glibc = int(TPU_PLATFORM.rsplit("_", 1)[1])
    platforms = [f"--platform=manylinux_2_{minor}_x86_64" for minor in range(glibc, 16, -1)]
    minor = INTERPRETER.split(".")[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k == "PIP_CERT"}
    result = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
         "--no-deps", "--only-binary=:all:", *platforms, "--platform=manylinux2014_x86_64",
         f"--python-version=3.{minor}", "--implementation=cp", f"--abi=cp3{minor}",
         "--abi=abi3", "--abi=none", "--require-hashes", "-r", str(lock), "--dest", str(dest)],
        env={**env, "PIP_CONFIG_FILE": "/dev/null"}, capture_output=True, text=True)
    pinned = sum(1 for line in lock.read_text().splitlines() if "==" in line)
    got = len(list(dest.glob("*.whl")))
    if result.returncode != 0 or got != pinned:
        raise ImageUnavailable(f"cannot download the {pinned} wheels {lock} pins from PyPI (got "
                               f"{got}): {result.stderr[-800:]}")
    return dest


def with_mirror(mirror: Path, *binds: tuple[Path, str]) -> list[str]:
    """The argv prefix that runs a command in a mount namespace of its own with the image's
    `mirror` at /srv/multislice-mirror (and each (source, target) of `binds` mounted there)."""
    script = ('mount --make-rprivate / && mount -t tmpfs tmpfs /srv '
              '&& mkdir /srv/multislice-mirror && mount --bind "$1" /srv/multislice-mirror && '
              + "".join(f'mount --bind "${i + 2}" {target} && '
                        for i, (_, target) in enumerate(binds))
              + f'shift {1 + len(binds)} && exec "$@"')
    return ["unshare", "--mount", "bash", "-c", script, "deployer", str(mirror),
            *(str(source) for source, _ in binds)]


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
