"""A mesh axis an experiment adds (its trainer/config.py MESH_AXES) is a stack's
trainer.mesh.ici_NAME/dcn_NAME: filled and checked against the slice shape like the built-in
axes, handed to the trainer, and checked at preview by the experiment's own config and model."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.boot.launch import trainer_argv
from infra.packaging.experiment import experiment_problems
from infra.stack_config.manifest import launch_spec
from infra.stack_config.schema import StackConfigError, parse_stack
from infra.stack_config.validation import validate_stack
from scripts.new import render_template
from tests.infra.conftest import base_config

EXPERT_AXIS = '''MESH_AXES: tuple[str, ...] = ("pipeline", "data", "fsdp", "expert", "tensor")'''


def with_expert_axis(experiment: Path) -> Path:
    """The three lines a fork writes to add an axis (README: "A model variant of your own")."""
    config = experiment / "trainer" / "config.py"
    text = config.read_text()
    assert "MESH_AXES: tuple[str, ...] = BUILTIN_MESH_AXES" in text
    config.write_text(text.replace("MESH_AXES: tuple[str, ...] = BUILTIN_MESH_AXES", EXPERT_AXIS))
    base = experiment / "configs" / "base.toml"
    base.write_text(base.read_text().replace("[mesh]\n", "[mesh]\nici_expert = 1\ndcn_expert = 1\n"))
    return experiment


def stack(experiment: Path, mesh: dict, overrides: dict | None = None):
    return parse_stack(base_config(experiment_dir=str(experiment), trainer={
        "config": "tiny", "steps": 20, "mesh": mesh, "overrides": overrides or {}}), "axes")


def test_an_added_axis_is_filled_checked_and_handed_to_the_trainer(tmp_path):
    cfg = stack(tmp_path, {"ici_expert": 2, "ici_fsdp": -1, "dcn_data": -1})
    assert cfg.resolved_mesh() == {"ici_data": 1, "ici_fsdp": 2, "ici_tensor": 1,
                                   "ici_pipeline": 1, "ici_expert": 2, "dcn_data": 2,
                                   "dcn_fsdp": 1, "dcn_tensor": 1, "dcn_pipeline": 1,
                                   "dcn_expert": 1}
    argv = trainer_argv(launch_spec(cfg, "0" * 64))
    assert "mesh.ici_expert=2" in argv and "mesh.dcn_expert=1" in argv
    wrong = stack(tmp_path, {"ici_expert": 3, "ici_fsdp": -1, "dcn_data": -1})
    with pytest.raises(StackConfigError, match=r"the product of the fixed axes \(3\) does not "
                                               r"divide devices per slice of v4-8 \(4\)"):
        validate_stack(wrong, base_dir=tmp_path, check_files=False)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("expert", 2, r"unknown key 'expert': allowed keys of trainer.mesh: dcn_data, "),
    ("ici_fdsp", 2, r"unknown key 'ici_fdsp' \(did you mean ici_fsdp\?\)"),
    ("ici_expert", "two", r"ici_expert = 'two': expected an integer"),
])
def test_a_mesh_key_that_names_no_axis_size_is_refused(tmp_path, key, value, message):
    with pytest.raises(StackConfigError, match=message):
        stack(tmp_path, {key: value})


@pytest.mark.slow  # renders the template; two child interpreters import its model
def test_preview_asks_the_experiment_whether_it_knows_the_axis_and_fits_its_model(tmp_path):
    plain = render_template("plainaxes", tmp_path / "plain")
    [refused] = experiment_problems(stack(plain, {"ici_expert": 2, "ici_fsdp": -1}), plain)[0]
    assert "unknown key(s) mesh.dcn_expert, mesh.ici_expert; allowed keys in [mesh]" in refused
    forked = with_expert_axis(render_template("forkaxes", tmp_path / "fork"))
    assert experiment_problems(stack(forked, {"ici_expert": 2, "ici_fsdp": -1}), forked)[0] == []
    # a model dimension the mesh does not divide: refused at preview by the trainer's own check
    [misfit] = experiment_problems(stack(forked, {"ici_tensor": 4, "ici_fsdp": 1},
                                         {"model.d_ff": 198}), forked)[0]
    assert misfit.startswith("trainer: forkaxes's model does not fit this mesh: model.d_ff = "
                             "198 is not divisible by the tensor parallelism 4"), misfit


@pytest.mark.slow  # renders the template; the plan asks the experiment twice
def test_the_plan_keeps_an_added_axis_and_puts_its_mesh_to_the_experiment(tmp_path, capsys):
    import json

    from scripts.cli import main

    forked = with_expert_axis(render_template("planaxes", tmp_path))
    args = ["plan", "--experiment", str(forked), "--config", "tiny", "--accelerator-type",
            "v4-32", "--slices", "2", "--set", "mesh.ici_expert=2", "--json"]
    assert main(args) == 0, capsys.readouterr().err
    mesh = json.loads(capsys.readouterr().out)["recommendation"]["mesh"]
    # the expert axis takes 2 of a slice's 16 devices; FSDP gets the other 8
    assert (mesh["ici_expert"], mesh["ici_fsdp"]) == (2, 8)
    assert main([*args[:-1], "--set", "mesh.ici_expert=3"]) == 2
    assert "ici_expert=3 does not divide the 16 devices per slice" in capsys.readouterr().err
