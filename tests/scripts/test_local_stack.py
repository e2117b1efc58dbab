"""`multislice local --stack-config FILE`: the stack's trainer as its VMs run it, the mesh scaled to
this machine's CPUs, the model, batch and steps to laptop scale, and a line saying what was
scaled."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from scripts import PROJECT_ROOT
from scripts.argtypes import UsageError
from scripts.local.from_stack import plan_from_stack, scale_axes
from scripts.local.laptop import Keep
from tests.infra.conftest import make_full_experiment


def write_stack(root: Path, **overrides) -> Path:
    config = {"project": "my-proj", "region": "us-central1", "zone": "us-central1-a",
              "accelerator_type": "v5litepod-16", "slices": 4, "experiment_dir": "experiments/demo",
              "trainer": {"config": "tiny", "steps": 100, "seed": 7,
                          "mesh": {"ici_fsdp": 16, "dcn_data": 4},
                          "overrides": {"train.global_batch_size": 64}}}
    config.update(overrides)
    path = root / "stacks" / "Pulumi.dev.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"config": {f"multislice:{k}": v for k, v in config.items()}}))
    return path


@pytest.fixture
def project(tmp_path: Path) -> Path:
    shutil.copy(PROJECT_ROOT / "Pulumi.yaml", tmp_path / "Pulumi.yaml")
    make_full_experiment(tmp_path)
    return tmp_path


def test_axes_shrink_largest_first_by_their_smallest_factor():
    assert scale_axes({"ici_fsdp": 16, "ici_tensor": 1}, 4) == {"ici_fsdp": 4, "ici_tensor": 1}
    assert scale_axes({"ici_data": 2, "ici_fsdp": 8}, 4) == {"ici_data": 2, "ici_fsdp": 2}
    assert scale_axes({"dcn_data": 6}, 2) == {"dcn_data": 1}  # 6 -> 3 -> 1: products stay whole
    assert scale_axes({"dcn_data": 2}, 4) == {"dcn_data": 2}  # never grown


def test_the_stacks_trainer_runs_with_its_mesh_scaled_and_says_so(project):
    plan = plan_from_stack(write_stack(project), None, None)
    assert (plan.slices, plan.devices_per_slice) == (2, 4)
    assert plan.experiment == project / "experiments" / "demo"
    args = list(plan.trainer_args)
    pairs = {args[i + 1] for i, a in enumerate(args) if a == "--set"}
    assert {"mesh.ici_fsdp=4", "mesh.dcn_data=2", "train.global_batch_size=64"} <= pairs
    assert not {p for p in pairs if p.startswith(("mesh.ici_fsdp=16", "mesh.dcn_data=4"))}
    assert args[:4] == ["--config", "tiny", "--steps", "100"] and "--seed" in args
    assert not {"--run-dir", "--expect-slices", "--expect-devices-per-slice"} & set(args)
    # tiny, 64 x 64 tokens and 100 steps are laptop scale already: only the mesh is scaled
    assert plan.scaled == (
        "stack dev (4 x v5litepod-16, 16 devices a slice) as 2 emulated slice(s) x 4 CPU devices: "
        "mesh ici_fsdp 16 -> 4, dcn_data 4 -> 2; trainer otherwise as on the VMs (--config tiny, "
        "--steps 100; arguments after -- come last and win)")


def _sets(plan) -> dict[str, str]:
    args = list(plan.trainer_args)
    return dict(args[i + 1].split("=", 1) for i, a in enumerate(args) if a == "--set")


def test_a_tpu_sized_stack_runs_at_laptop_scale_and_the_line_says_what_was_scaled(project):
    # The example stacks' shape: the 85M default preset, 256 x 1024 tokens, 10,000 steps and
    # eval batches the emulation's corpus does not hold.
    stack = write_stack(project, trainer={
        "config": "default", "steps": 10000, "mesh": {"ici_fsdp": 16, "dcn_data": 4},
        "overrides": {"eval.num_batches": 8, "eval.batch_size": 256,
                      "train.init_from": "gs://my-proj-ms-dev/weights/w"}})
    plan = plan_from_stack(stack, None, None)
    sets = _sets(plan)
    assert list(plan.trainer_args[:4]) == ["--config", "default", "--steps", "100"]
    # the tiny preset's shape, over the stack's own preset (its optimizer and data stay)
    assert (sets["model.d_model"], sets["model.n_layers"], sets["model.seq_len"]) == \
        ("64", "2", "64")
    assert "model.vocab_size" not in sets and sets["train.init_from"] == '""'
    # 256 sequences of 64 tokens -> 64 (4096 tokens), still a multiple of 4 x 2 batch shards
    assert sets["train.global_batch_size"] == "64"
    assert (sets["eval.num_batches"], sets["eval.batch_size"]) == ("2", "0")
    assert (sets["train.total_steps"], sets["optim.warmup_steps"]) == ("100", "5")
    assert sets["checkpoint.save_interval_steps"] == "10" and sets["metrics.log_every"] == "5"
    assert plan.scaled == (
        "stack dev (4 x v5litepod-16, 16 devices a slice) as 2 emulated slice(s) x 4 CPU devices: "
        "mesh ici_fsdp 16 -> 4, dcn_data 4 -> 2; model default 85.2M -> the tiny preset's shape "
        "(0.1M parameters; --keep-model keeps it); train.init_from gs://my-proj-ms-dev/weights/w "
        "dropped (weights of the stack's model); batch 256 -> 64 sequences of 64 tokens "
        "(--keep-batch keeps it); eval 8 x 256 -> 2 x 64 sequences; steps 10000 -> 100, the "
        "schedule with them (total_steps 10000 -> 100, warmup 500 -> 5), a checkpoint every "
        "200 -> 10 (--keep-steps keeps them); trainer otherwise as on the VMs (--config "
        "default, --steps 100 of the stack's 10000; arguments after -- come last and win)")


def test_keep_flags_run_that_part_of_the_stack_as_it_is(project):
    stack = write_stack(project, trainer={"config": "default", "steps": 10000,
                                          "mesh": {"ici_fsdp": 16, "dcn_data": 4}})
    kept = _sets(plan_from_stack(stack, None, None, Keep(model=True, steps=True)))
    assert "model.d_model" not in kept and "train.total_steps" not in kept
    # the default model's 1024 tokens a sequence: 4 sequences make the 4096-token budget, but
    # the batch must still split over 4 x 2 shards: 8
    assert kept["train.global_batch_size"] == "8"
    everything = plan_from_stack(stack, None, None, Keep(model=True, batch=True, steps=True))
    assert "train.global_batch_size" not in _sets(everything)
    assert list(everything.trainer_args[:4]) == ["--config", "default", "--steps", "10000"]


def test_explicit_counts_scale_to_exactly_them_or_name_a_divisor(project):
    stack = write_stack(project)
    plan = plan_from_stack(stack, 4, 8)
    assert (plan.slices, plan.devices_per_slice) == (4, 8)
    assert "mesh.ici_fsdp=8" in plan.trainer_args and "mesh.dcn_data=4" in plan.trainer_args
    with pytest.raises(UsageError, match=r"--devices-per-slice 3: the stack's devices per slice "
                       r"\(16, mesh ici_fsdp 16\) cannot be scaled to exactly 3; give a divisor "
                       r"of 16 such as 2"):
        plan_from_stack(stack, None, 3)


def test_an_invalid_stack_is_one_line_before_anything_runs(project):
    stack = write_stack(project, trainer={"config": "tiny", "mesh": {"ici_fsdp": 3}})
    with pytest.raises(UsageError) as caught:
        plan_from_stack(stack, None, None)
    assert str(caught.value).startswith(f"--stack-config {stack}: ")
    with pytest.raises(UsageError, match="no such file"):
        plan_from_stack(project / "stacks" / "Pulumi.nope.yaml", None, None)


@pytest.mark.slow  # a two-process run of the template's trainer
def test_a_stack_rehearses_on_cpu_from_the_directory_the_user_is_in(tmp_path):
    from scripts.new import render_template

    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(PROJECT_ROOT / "Pulumi.yaml", project / "Pulumi.yaml")
    render_template("demo", project / "experiments")
    write_stack(project)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "scripts.cli", "local", "--stack-config",
         "../project/stacks/Pulumi.dev.yaml", "--", "--steps", "2"], cwd=elsewhere,
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[multislice] stack dev (4 x v5litepod-16, 16 devices a slice) as 2 emulated " \
        "slice(s) x 4 CPU devices: mesh ici_fsdp 16 -> 4, dcn_data 4 -> 2" in done.stderr
    assert "final step 2" in done.stderr
    assert (elsewhere / "runs" / "local-stack-dev-2x4" / "summary.json").is_file()
