"""`multislice rehearse`: what it emulates a stack with, and the input it refuses before booting
anything. The rehearsal itself (emulated hosts, an edit applied) is a boot test:
tests/infra/test_startup_script.py::test_rehearse_*."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.stack_config.schema import parse_stack
from infra.stack_config.validation import validate_stack
from scripts.argtypes import UsageError
from scripts.cli import main as cli_main
from scripts.rehearse.stack import Source, emulated_stack, emulated_type, settled_edit
from tests.infra.conftest import make_full_experiment
from tests.support.examples import EXAMPLE_STACKS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("stack_type", "host_type"), [
    ("v5litepod-16", "v5litepod-4"), ("v5litepod-4", "v5litepod-4"), ("v4-32", "v4-8"),
    ("v5p-16", "v5p-8"),
])
def test_a_stack_is_emulated_with_one_four_chip_host_of_its_family(stack_type, host_type):
    assert emulated_type(stack_type) == host_type


def _cfg(tmp_path: Path, **keys):
    if not (tmp_path / "exp").exists():
        make_full_experiment(tmp_path, "exp")
    raw = {"project": "my-proj", "region": "us-central1", "zone": "us-central1-a",
           "experiment_dir": str(tmp_path / "exp"), **keys}
    cfg = parse_stack(raw, "dev")
    validate_stack(cfg, check_files=False)
    return cfg


def test_the_mesh_is_scaled_to_two_hosts_and_the_line_says_so(tmp_path):
    cfg = _cfg(tmp_path, accelerator_type="v5litepod-16", slices=4,
               trainer={"config": "tiny", "steps": 100,
                        "mesh": {"ici_fsdp": 16, "ici_data": 1, "dcn_data": 4}})
    raw, line = emulated_stack(cfg, tmp_path / "exp", steps=12)
    assert raw["accelerator_type"] == "v5litepod-4" and raw["slices"] == 2
    assert raw["trainer"]["mesh"]["ici_fsdp"] == 4 and raw["trainer"]["mesh"]["dcn_data"] == 2
    assert raw["trainer"]["steps"] == 12 and raw["experiment_dir"] == str(tmp_path / "exp")
    emulated = parse_stack(raw, "dev")  # a valid stack of its own, as the hosts read it
    validate_stack(emulated, check_files=False)
    assert emulated.resolved_mesh()["ici_fsdp"] == 4
    assert "stack dev (4 x v5litepod-16) as 2 emulated v5litepod-4 host(s)" in line
    assert "mesh ici_fsdp 16 -> 4, dcn_data 4 -> 2" in line and "steps 100 -> 12" in line


def _gke_cfg(tmp_path: Path, accelerator_type: str = "v5litepod-16", ici: int = 16):
    return _cfg(tmp_path, accelerator_type=accelerator_type, slices=2, orchestration="gke",
                gke={"cluster": "projects/my-proj/locations/us-central1/clusters/c",
                     "image": "r/i@sha256:" + "a" * 64},
                trainer={"config": "tiny", "steps": 100, "mesh": {"ici_fsdp": ici}})


def test_a_gke_stack_is_rehearsed_as_vms_that_boot_the_same_script_with_as_vms(tmp_path):
    raw, line = emulated_stack(_gke_cfg(tmp_path), tmp_path / "exp", steps=None)
    emulated = parse_stack(raw, "dev")
    validate_stack(emulated, check_files=False)
    assert emulated.orchestration == "tpu-vm" and emulated.gke is None
    assert line.endswith("; its GKE pods as TPU VMs, which boot the same startup script "
                         "(--as-vms)")


@pytest.mark.parametrize(("stack_type", "pool_type"), [
    ("v5litepod-16", "v5litepod-8"), ("v5litepod-8", "v5litepod-8"), ("v4-32", "v4-16"),
])
def test_a_gke_stack_is_rehearsed_as_a_jobset_of_two_four_chip_pods_a_slice(
        tmp_path, stack_type, pool_type):
    chips = int(stack_type.rsplit("-", 1)[1]) // (2 if stack_type.startswith("v4") else 1)
    raw, line = emulated_stack(_gke_cfg(tmp_path, stack_type, chips), tmp_path / "exp",
                               steps=None, jobset=True)
    emulated = parse_stack(raw, "dev")
    validate_stack(emulated, check_files=False)  # a GKE stack of its own, as pulumi would see it
    assert emulated.orchestration == "gke" and emulated.gke is not None
    assert raw["accelerator_type"] == pool_type and raw["slices"] == 2
    assert emulated.resolved_mesh()["ici_fsdp"] == 8
    assert f"as a JobSet of 2 emulated {pool_type} slice(s) of 2 pods" in line


def test_a_stack_file_that_does_not_load_is_one_line_before_anything_boots(tmp_path, capsys):
    missing = tmp_path / "Pulumi.none.yaml"
    assert cli_main(["rehearse", "--stack-config", str(missing)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"multislice rehearse: error: --stack-config {missing}: no such file"]


def test_a_pod_failure_injected_into_a_vm_rehearsal_is_one_line_before_anything_boots(
        tmp_path, capsys, monkeypatch):
    from tests.infra.conftest import make_experiment

    make_experiment(tmp_path, "exp")
    stack = tmp_path / "Pulumi.vm.yaml"
    stack.write_text("config:\n  multislice:project: my-proj\n  multislice:region: us-central1\n"
                     "  multislice:zone: us-central1-a\n  multislice:accelerator_type: v5litepod-16\n"
                     f"  multislice:experiment_dir: {tmp_path / 'exp'}\n")
    monkeypatch.setattr("os.geteuid", lambda: 0)
    assert cli_main(["rehearse", "--stack-config", str(stack), "--crash-at-step", "3",
                     "--workdir", str(tmp_path / "w")]) == 2
    [err] = capsys.readouterr().err.strip().splitlines()
    assert "--crash-at-step act on a JobSet's pods; stack 'vm' is rehearsed as TPU VMs" in err
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("flag", ["--crash-at-step", "--disrupt-at-step"])
def test_a_pod_failure_past_the_runs_last_step_is_one_line_before_anything_boots(
        tmp_path, capsys, flag):
    from tests.infra.conftest import make_experiment

    make_experiment(tmp_path, "exp")
    stack = tmp_path / "Pulumi.gk.yaml"
    stack.write_text("config:\n  multislice:project: my-proj\n  multislice:region: us-central1\n"
                     "  multislice:zone: us-central1-a\n  multislice:accelerator_type: v5litepod-16\n"
                     "  multislice:orchestration: gke\n  multislice:gke:\n"
                     "    cluster: projects/my-proj/locations/us-central1/clusters/c\n"
                     f"  multislice:experiment_dir: {tmp_path / 'exp'}\n")
    assert cli_main(["rehearse", "--stack-config", str(stack), "--steps", "8", flag, "8",
                     "--workdir", str(tmp_path / "w")]) == 2
    [err] = capsys.readouterr().err.strip().splitlines()
    assert f"{flag} 8 is not before the run's last step 8: it would never happen; use 1..7" \
        in err
    assert not (tmp_path / "w").exists()


def test_a_family_without_a_four_chip_host_is_named():
    with pytest.raises(UsageError, match="no one-host 4-chip type of the v3 family"):
        emulated_type("v3-32")


def test_the_steps_of_each_spec_and_the_edits_time_to_training_are_told_apart():
    # The hosts' events reach the rehearsal late: here the edit (generation 2) is published
    # before the old spec's first step is read. Only generation 2's own first step is timed.
    from scripts.rehearse.stack import CodeSteps

    codes = CodeSteps("1", "a" * 64)
    said = codes.observe({"event": "distributed_init", "spec_generation": 1, "time": 10.0})
    codes.published("2", "b" * 64)
    applied_at = codes.applied[1]
    for step in (1, 2, 3):
        said += codes.observe({"event": "step", "step": step, "time": applied_at - 5 + step})
    said += codes.observe({"event": "distributed_init", "spec_generation": 2,
                           "time": applied_at + 8})
    said += codes.observe({"event": "restore", "restored_step": 3, "time": applied_at + 9})
    said += codes.observe({"event": "step", "step": 4, "time": applied_at + 12.5})
    said += codes.observe({"event": "end", "final_step": 6, "time": applied_at + 14})
    assert said == [
        f"code {'a' * 12} (spec generation 1) ran steps 1..3",
        f"resumed at step 3 on code {'b' * 12} (spec generation 2)",
        f"step 4 is the first on code {'b' * 12} (spec generation 2): 12.5s after the edit was "
        "applied",
        f"code {'b' * 12} (spec generation 2) ran steps 4..6",
    ]


def test_an_edit_of_several_files_is_applied_once_the_files_stop_changing():
    source = Source(Path("stacks/Pulumi.dev.yaml"), Path("exp"), cfg=None, fingerprint="v0")
    assert not settled_edit(source, "v0")
    # The code is saved, then the stack file: the look between them sees a half-edit.
    assert not settled_edit(source, "code")
    assert not settled_edit(source, "code+stack")
    assert settled_edit(source, "code+stack") and source.fingerprint == "code+stack"
    assert not settled_edit(source, "code+stack")  # applied once
    # An edit undone before the next look is never applied.
    assert not settled_edit(source, "typo")
    assert not settled_edit(source, "code+stack") and source.pending == ""
    assert not settled_edit(source, "typo")


def test_an_edit_of_a_gke_stacks_trainer_settings_is_told_as_taken_in_place(tmp_path):
    from scripts.rehearse.stack import load_source, render_verdict
    from scripts.render import GKE_KEEPS_WITH_NEW_SPEC
    from tests.infra.conftest import make_experiment

    make_experiment(tmp_path, "exp")
    text = ("config:\n  multislice:project: my-proj\n  multislice:region: us-central1\n"
            "  multislice:zone: us-central1-a\n  multislice:accelerator_type: v5litepod-16\n"
            "  multislice:slices: 2\n  multislice:orchestration: gke\n  multislice:gke:\n"
            "    cluster: projects/my-proj/locations/us-central1/clusters/c\n"
            f"  multislice:experiment_dir: {tmp_path / 'exp'}\n"
            "  multislice:trainer:\n    config: tiny\n    steps: 16\n"
            "    mesh: {ici_fsdp: 16, dcn_data: 2}\n"
            "    overrides: {train.global_batch_size: 32}\n")
    stack = tmp_path / "Pulumi.gk.yaml"
    stack.write_text(text)
    source = load_source(stack)
    after = text.replace("steps: 16", "steps: 20")
    # a running JobSet keeps its place; its pods restart their trainers on the new spec
    assert render_verdict(text, after, source, tmp_path / "work") == GKE_KEEPS_WITH_NEW_SPEC


@pytest.mark.slow  # an experiment interpreter importing its model per stack (~5 s each)
@pytest.mark.parametrize("stack_file", EXAMPLE_STACKS, ids=lambda p: p.name)
def test_every_example_stack_is_rehearsed_at_a_scale_its_own_config_code_accepts(
        tmp_path, stack_file):
    # What `rehearse` (and `local`) run of a shipped example: the emulated stack passes the
    # experiment's own config checks on the emulated topology (batch and eval over the scaled
    # mesh and processes), with the model, batch and steps at laptop scale.
    from infra.stack_config.stack_file import parse_namespaced, read_stack_file
    from scripts.argtypes import UsageError
    from scripts.local.from_stack import load_stack

    if "multislice:experiment_dir" not in read_stack_file(stack_file):  # a capacity stack
        with pytest.raises(UsageError, match="is a GKE capacity stack .* it trains nothing"):
            load_stack(stack_file)
        return
    exp = make_full_experiment(tmp_path, "exp")
    config = {**read_stack_file(stack_file), "multislice:experiment_dir": str(exp)}
    cfg = parse_namespaced(config, stack_file.stem.removeprefix("Pulumi."))
    jobset = cfg.orchestration == "gke"
    raw, line = emulated_stack(cfg, exp, steps=None, jobset=jobset)
    emulated = parse_stack(raw, cfg.stack)
    validate_stack(emulated, check_files=True)
    from infra.packaging.experiment import model_summary, trainer_overrides
    from scripts.local.laptop import MAX_PARAMS, MAX_STEPS, MAX_TOKENS_PER_STEP

    summary = model_summary(exp, *trainer_overrides(emulated))
    assert summary["param_count"] <= MAX_PARAMS and emulated.trainer.steps <= MAX_STEPS, line
    tokens = summary["train"]["global_batch_size"] * summary["model"]["seq_len"]
    assert tokens <= MAX_TOKENS_PER_STEP, line


def test_a_user_who_is_not_root_runs_the_same_command_through_sudo(tmp_path, monkeypatch,
                                                                    capsys):
    import scripts.rehearse.command as command

    stack = tmp_path / "stacks" / "Pulumi.dev.yaml"
    exp = make_full_experiment(tmp_path, "experiments/demo")
    stack.parent.mkdir()
    stack.write_text("config:\n  multislice:project: my-proj\n  multislice:region: us-central1\n"
                     "  multislice:zone: us-central1-a\n  multislice:accelerator_type: v5litepod-8"
                     f"\n  multislice:experiment_dir: {exp}\n"
                     "  multislice:trainer: {config: tiny, steps: 10, mesh: {ici_fsdp: 8}}\n")
    (tmp_path / "Pulumi.yaml").write_text((ROOT / "Pulumi.yaml").read_text())
    argv = ["/venv/bin/multislice", "rehearse", "--stack-config", str(stack)]
    monkeypatch.setattr(command.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(command.sys, "argv", argv)
    ran: list[list[str]] = []
    monkeypatch.setattr(command.os, "execv", lambda path, args: ran.append(args))
    monkeypatch.setattr(command.shutil, "which", lambda name: f"/usr/bin/{name}")
    command._again_as_root()
    assert ran == [["/usr/bin/sudo", command.sys.executable, *argv]]
    assert "running the same command through sudo" in capsys.readouterr().out
    # no sudo (a container's root-less shell): one line, exit 2, nothing booted
    monkeypatch.setattr(command.shutil, "which", lambda name: None)
    assert cli_main(["rehearse", "--stack-config", str(stack)]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "needs root, and this user is not root and has no sudo: run the same command as root")


def test_the_jobset_rehearsal_prints_status_whole_once_then_only_what_changed():
    from scripts.rehearse.jobset import status_update

    first = "JobSet ms-gk/ms-gk Running restarts 0\nslice 0 pod 0 Running\nslice 1 pod 0 Running"
    assert status_update("", first).endswith(first)
    later = first.replace("restarts 0", "restarts 1").replace("slice 1 pod 0 Running",
                                                              "slice 1 pod 0 Pending")
    told = status_update(first, later).splitlines()
    assert told[1:] == ["JobSet ms-gk/ms-gk Running restarts 1", "slice 1 pod 0 Pending"]


def test_tensorstores_missing_gcloud_file_line_is_not_echoed_but_a_refusal_is():
    from scripts.rehearse.stack import echoed

    noise = ("E1206 15:05:31.185705   20728 google_auth_provider.cc:188] Could not find the "
             "credentials file in the standard gcloud location [/root/.config/gcloud/"
             "application_default_credentials.json]. You may specify a credentials file")
    assert not echoed(noise)
    assert echoed(noise.replace("Could not find", "PERMISSION_DENIED: Could not find"))
    assert echoed("E1206 15:05:31.1 1 storage.cc:1] gs://b/x: 403 Forbidden")
    assert echoed("step 5/100 loss 5.356") and not echoed("MULTISLICE_STEP 5")
    # the console's copy of a trainer line: shown once, from the trainer's log
    assert not echoed("[reh-s0-w0 attempt 0] step 5/100 loss 5.356")
    assert echoed("[rehearse] step 5")


def test_a_stack_on_a_platforms_shared_network_is_rehearsed_as_a_valid_stack(tmp_path):
    # multislice:network with egress none: the emulated stack keeps the network keys the user
    # set and writes back no default of the stack's own VPC (subnet_cidr was, and refused)
    cfg = _cfg(tmp_path, accelerator_type="v5litepod-16", slices=2, egress="none",
               network={"project": "platform-host", "name": "training",
                        "subnet": "training-us-central1"}, tags=["tpu-hosts"],
               trainer={"config": "tiny", "steps": 100, "mesh": {"ici_fsdp": 16}})
    raw, _ = emulated_stack(cfg, tmp_path / "exp", steps=4)
    assert "subnet_cidr" not in raw and raw["network"]["name"] == "training"
    emulated = parse_stack(raw, "dev")
    validate_stack(emulated, check_files=False)
