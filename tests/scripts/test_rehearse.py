"""`multislice rehearse`: what it emulates a stack with, and the input it refuses before booting
anything. The rehearsal itself (emulated hosts, an edit applied) is a boot test:
tests/infra/test_startup_script.py::test_rehearse_*."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.schema import parse_stack
from infra.validation import validate_stack
from scripts.argtypes import UsageError
from scripts.cli import main as cli_main
from scripts.rehearse import emulated_stack, emulated_type

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("stack_type", "host_type"), [
    ("v5litepod-16", "v5litepod-4"), ("v5litepod-4", "v5litepod-4"), ("v4-32", "v4-8"),
    ("v5p-16", "v5p-8"),
])
def test_a_stack_is_emulated_with_one_four_chip_host_of_its_family(stack_type, host_type):
    assert emulated_type(stack_type) == host_type


def _cfg(tmp_path: Path, **keys):
    (tmp_path / "exp").mkdir(exist_ok=True)
    raw = {"project": "my-proj", "region": "us-central1", "zone": "us-central1-a",
           "experiment_dir": str(tmp_path / "exp"), **keys}
    cfg = parse_stack(raw, "dev")
    validate_stack(cfg, check_files=False)
    return cfg


def test_the_mesh_is_scaled_to_two_hosts_and_the_line_says_so(tmp_path):
    cfg = _cfg(tmp_path, accelerator_type="v5litepod-16", slices=4,
               trainer={"config": "tiny", "steps": 100,
                        "mesh": {"ici_fsdp": 16, "ici_data": 1, "dcn_data": 4}})
    raw, line = emulated_stack(cfg, tmp_path / "copy", steps=12)
    assert raw["accelerator_type"] == "v5litepod-4" and raw["slices"] == 2
    assert raw["trainer"]["mesh"]["ici_fsdp"] == 4 and raw["trainer"]["mesh"]["dcn_data"] == 2
    assert raw["trainer"]["steps"] == 12 and raw["experiment_dir"] == str(tmp_path / "copy")
    emulated = parse_stack(raw, "dev")  # a valid stack of its own, as the hosts read it
    validate_stack(emulated, check_files=False)
    assert emulated.resolved_mesh()["ici_fsdp"] == 4
    assert "stack dev (4 x v5litepod-16) as 2 emulated v5litepod-4 host(s)" in line
    assert "mesh ici_fsdp 16 -> 4, dcn_data 4 -> 2" in line and "steps 100 -> 12" in line


def test_a_gke_stack_is_rehearsed_as_vms_that_boot_the_same_script(tmp_path):
    cfg = _cfg(tmp_path, accelerator_type="v5litepod-16", slices=2, orchestration="gke",
               gke={"cluster": "projects/my-proj/locations/us-central1/clusters/c",
                    "image": "r/i@sha256:" + "a" * 64},
               trainer={"config": "tiny", "steps": 100, "mesh": {"ici_fsdp": 16}})
    raw, line = emulated_stack(cfg, tmp_path / "copy", steps=None)
    emulated = parse_stack(raw, "dev")
    validate_stack(emulated, check_files=False)
    assert emulated.orchestration == "tpu-vm" and emulated.gke is None
    assert line.endswith("; its GKE pods as TPU VMs, which boot the same startup script")


def test_a_stack_file_that_does_not_load_is_one_line_before_anything_boots(tmp_path, capsys):
    missing = tmp_path / "Pulumi.none.yaml"
    assert cli_main(["rehearse", "--stack-config", str(missing)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"multislice rehearse: error: --stack-config {missing}: no such file"]


def test_a_family_without_a_four_chip_host_is_named():
    with pytest.raises(UsageError, match="no one-host 4-chip type of the v3 family"):
        emulated_type("v3-32")
