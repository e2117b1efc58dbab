"""A fork's model variant whose layer stack is not model.n_layers deep (the README's second
worked example: layers in units of two): the planner, the preview (what `multislice render` and
`pulumi preview` check) and the trainer all ask the variant, agree on which pipelines it takes,
and refuse the others in one line that names the units."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from infra.packaging.experiment import experiment_problems
from infra.stack_config.schema import parse_stack
from scripts.cli import main
from scripts.new import TEMPLATE_DIR, render_template
from tests.infra.conftest import base_config

PRESET = """extends = "tiny"

[model]
kind = "local-global"
n_layers = 4

[model.settings]
window = 16
"""
UNITS = r"model.n_layers = 4 \(2 units of 2 layers: model.kind = 'local-global' repeats its layers"


def with_local_global(experiment: Path) -> Path:
    """The worked example as a fork writes it: the variant's module and its preset, no other
    file (the template's tests hold its twin, tests/toy_local_global.py)."""
    source = (TEMPLATE_DIR / "{{cookiecutter.project_slug}}" / "tests" / "toy_local_global.py"
              ).read_text()
    assert 'KIND = "toy-local-global"' in source
    (experiment / "trainer" / "model" / "local_global.py").write_text(
        source.replace('KIND = "toy-local-global"', 'KIND = "local-global"'))
    (experiment / "configs" / "local-global.toml").write_text(PRESET)
    return experiment


def stack(experiment: Path, slices: int, mesh: dict):
    return parse_stack(base_config(experiment_dir=str(experiment), slices=slices, trainer={
        "config": "local-global", "steps": 20, "mesh": mesh}), "variant")


def check(experiment: Path, *overrides: str) -> subprocess.CompletedProcess:
    """The trainer's own --check on one emulated slice of 4 CPU devices."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MULTISLICE_", "XLA_"))}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4",
               PYTHONPATH=str(experiment))
    return subprocess.run(
        [sys.executable, "-m", "trainer.main", "--check", "--config", "local-global",
         "--run-dir", str(experiment / "runs" / "check"), "--set", "mesh.dcn_data=1",
         "--set", "mesh.ici_fsdp=1", *(f"--set={o}" for o in overrides)],
        cwd=experiment, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # renders the template; the preview, the plan and --check each import its model
def test_plan_preview_and_trainer_agree_on_a_variants_stack_of_units(tmp_path, capsys):
    import re

    fork = with_local_global(render_template("unitfork", tmp_path))
    # 4 stages divide n_layers = 4, not its 2 units: every stage refuses, in one line
    [refused] = experiment_problems(stack(fork, 4, {"dcn_pipeline": 4, "dcn_data": 1}), fork)[0]
    assert re.search(r"does not fit this mesh: " + UNITS + r" in units of 2\) does not split "
                     r"into 4 pipeline stages .*divides 2: 1, 2$", refused), refused
    plan = ["plan", "--experiment", str(fork), "--config", "local-global",
            "--accelerator-type", "v4-8", "--slices", "4"]
    assert main([*plan, "--dcn-pipeline", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(UNITS, err[0]), err
    refused_check = check(fork, "mesh.ici_pipeline=4")
    assert refused_check.returncode == 2, refused_check.stderr[-2000:]
    lines = refused_check.stderr.strip().splitlines()
    assert "Traceback" not in refused_check.stderr and re.search(UNITS, lines[-1]), lines
    assert re.search(r"does not split into 4 pipeline stages", lines[-1])

    # 2 stages: each takes one unit; the plan, the preview and the trainer accept it
    assert experiment_problems(stack(fork, 2, {"dcn_pipeline": 2, "dcn_data": 1}), fork)[0] == []
    assert main([*plan[:-1], "2", "--dcn-pipeline", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recommendation"]["mesh"]["dcn_pipeline"] == 2
    accepted = check(fork, "mesh.ici_pipeline=2", "mesh.ici_data=2", "train.pipeline_microbatches=2")
    assert accepted.returncode == 0, accepted.stderr[-2000:]
    report = json.loads(accepted.stdout)
    assert report["pipeline"]["layers_per_stage"] == 2
    assert (report["model"]["kind"], report["model"]["stacked_units"],
            report["model"]["layers_per_unit"]) == ("local-global", 2, 2)
