"""`multislice plan` reads the model from the experiment, and its snippet is a valid stack edit."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from scripts import render
from scripts.cli import main
from scripts.new import render_template
from tests.support.examples import EXAMPLE_STACKS


@pytest.fixture(scope="module")
def project() -> Path:
    """Scratch space inside the toolkit's project (stack files find Pulumi.yaml above them, and
    the program resolves experiment_dir against it): experiments/_plan_test_PID/ holds my-model,
    rendered from the template, and the stacks the tests write."""
    scratch = render.ROOT / "experiments" / f"_plan_test_{os.getpid()}"
    render_template("my-model", scratch)
    (scratch / "stacks").mkdir()
    yield scratch
    shutil.rmtree(scratch)


def example_stack(project: Path, stack: Path) -> tuple[Path, dict]:
    """The example stack as a user's copy: it trains the scratch experiment."""
    doc = yaml.safe_load(stack.read_text())
    if "multislice:experiment_dir" in doc["config"]:
        doc["config"]["multislice:experiment_dir"] = str(
            (project / "my-model").relative_to(render.ROOT))
    path = project / "stacks" / stack.name
    path.write_text(yaml.safe_dump(doc))
    return path.relative_to(render.ROOT), doc


def plan_json(capsys, *args: str) -> dict:
    assert main(["plan", *args, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_help_prints_and_exits_0(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--help"])
    assert exit_info.value.code == 0
    assert "bubble of at most 10%" in capsys.readouterr().out.replace("\n", " ").replace(
        "                        ", "")


def test_experiment_preset_counts_parameters_as_the_trainer_does(project, capsys):
    out = plan_json(capsys, "--experiment", str(project / "my-model"),
                    "--config", "llama-3.2-1b", "--accelerator-type", "v5litepod-16",
                    "--slices", "2")
    assert out["params"] == 1_235_814_400  # SwiGLU, 8 KV heads, 128k vocabulary, tied
    config = project / "my-model" / "configs"
    base = (config / "base.toml").read_text()
    preset = (config / "llama-3.2-1b.toml").read_text()
    assert "global_batch_size" in base and "seq_len" in preset
    # tokens per step = train.global_batch_size x model.seq_len of that preset
    assert out["tokens_per_batch"] % 8192 == 0


def test_size_flags_with_an_experiment_are_refused(project, capsys):
    code = main(["plan", "--experiment", str(project / "my-model"),
                 "--config", "tiny", "--accelerator-type", "v4-8", "--slices", "2",
                 "--params", "8e9"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--params" in err[0] and "drop the size flags" in err[0]


def test_missing_preset_is_one_line_naming_it(project, capsys):
    code = main(["plan", "--experiment", str(project / "my-model"),
                 "--config", "nope", "--accelerator-type", "v4-8", "--slices", "2"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope" in err[0]


@pytest.mark.slow  # each plan asks the experiment twice (its model, then its resolve)
@pytest.mark.parametrize("stack", EXAMPLE_STACKS, ids=lambda p: p.name)
def test_snippet_pasted_into_each_example_stack_renders(project, stack, capsys, monkeypatch):
    monkeypatch.chdir(render.ROOT)  # the stack path as a user types it, relative
    rel, doc = example_stack(project, stack)
    if doc["config"].get("multislice:gke", {}).get("kind") == "capacity":
        assert main(["plan", "--stack-config", str(rel)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "it trains nothing" in err[0], err
        return
    if doc["config"]["multislice:slices"] < 2:
        assert main(["plan", "--stack-config", str(rel)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "single slice" in err[0]
        return
    out = plan_json(capsys, "--stack-config", str(rel))
    snippet = yaml.safe_load(out["recommendation"]["stack_settings"])
    assert set(snippet) == {"multislice:trainer"}
    before = doc["config"]["multislice:trainer"]
    after = snippet["multislice:trainer"]
    # merged into the stack's own block: every setting but the mesh is kept
    assert {k: v for k, v in after.items() if k not in ("mesh", "overrides")} == {
        k: v for k, v in before.items() if k not in ("mesh", "overrides")}
    doc["config"].update(snippet)
    pasted = rel.with_name(f"Pulumi.pasted-{stack.name.split('.')[1]}.yaml")
    pasted.write_text(yaml.safe_dump(doc))
    assert main(["render", str(pasted), "--output", str(project / "pasted.yaml")]) == 0, \
        capsys.readouterr().err


def test_stack_file_that_is_not_text_is_one_line(project, capsys, monkeypatch):
    monkeypatch.chdir(project)
    binary = Path("stacks/Pulumi.binary.yaml")
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe" * 10)
    for command in (["plan", "--stack-config", str(binary)], ["render", str(binary)]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert "not a text file" in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 2, err  # the file, then its one problem
    binary.unlink()


def _planned_run(stack_file: Path) -> tuple[int, int]:
    """(parameter count, global batch) the trainer gets from a stack file, as the VMs start it:
    the launch spec's preset and overrides, through the experiment's own config code."""
    from infra.packaging.experiment import model_summary, trainer_overrides
    from infra.stack_config.validation import load_stack_file

    cfg = load_stack_file(stack_file, check_files=False)
    preset, overrides = trainer_overrides(cfg)
    summary = model_summary(render.ROOT / cfg.experiment_dir, preset, overrides)
    return summary["param_count"], summary["train"]["global_batch_size"]


@pytest.mark.slow  # a plan (two experiment interpreters) and a render, twice
@pytest.mark.parametrize(("preset", "sets", "extra"), [
    ("llama-3.2-1b", ["train.global_batch_size=64", "optim.learning_rate=1e-4"], []),
    ("tiny", [], ["--tokens-per-batch", "2097152"]),  # a batch the plan needs, said in tokens
], ids=["preset-and-overrides", "tokens-per-batch"])
def test_a_pasted_snippet_trains_the_model_and_batch_that_were_planned(
        project, capsys, monkeypatch, preset, sets, extra):
    monkeypatch.chdir(render.ROOT)
    experiment = project / "my-model"
    args = ["--experiment", str(experiment), "--config", preset, "--accelerator-type",
            "v5litepod-16", "--slices", "2", *extra]
    out = plan_json(capsys, *args, *[x for s in sets for x in ("--set", s)])
    snippet = yaml.safe_load(out["recommendation"]["stack_settings"])
    rel, doc = example_stack(project, render.ROOT / "stacks" / "Pulumi.seed-v5e.yaml")
    doc["config"].pop("multislice:trainer", None)
    doc["config"].update(snippet)
    doc["config"]["multislice:accelerator_type"] = "v5litepod-16"
    doc["config"]["multislice:slices"] = 2
    pasted = rel.with_name(f"Pulumi.paste-{len(sets)}.yaml")
    pasted.write_text(yaml.safe_dump(doc))
    params, batch = _planned_run(pasted)
    assert params == out["params"]
    assert batch * _seq_len(experiment, preset) == out["tokens_per_batch"]
    assert main(["render", str(pasted), "--output", str(project / f"paste-{len(sets)}.yaml")]) \
        == 0, capsys.readouterr().err


def _seq_len(experiment: Path, preset: str) -> int:
    from infra.packaging.experiment import model_summary

    return model_summary(experiment, preset, [])["model"]["seq_len"]


def test_a_from_hf_sized_preset_is_planned_with_the_batch_it_needs_not_micro_batches(
        project, capsys):
    # The preset from-hf writes for a small model takes the batch of the nearest shipped preset
    # (tiny: 16 sequences): far too few tokens for DCN. The plan says the batch it needs.
    experiment = project / "my-model"
    preset = experiment / "configs" / "hf-small.toml"
    preset.write_text("[model]\nvocab_size = 256\nd_model = 64\nn_layers = 2\nn_heads = 4\n"
                      "d_ff = 192\nmlp = \"swiglu\"\nseq_len = 64\n\n[train]\n"
                      "global_batch_size = 16\n")
    try:
        code = main(["plan", "--experiment", str(experiment), "--config", "hf-small",
                     "--accelerator-type", "v5litepod-16", "--slices", "2"])
        out, err = capsys.readouterr()
    finally:
        preset.unlink()
    assert code == 0, err
    assert "micro-batch" not in out, out
    # 130,000 tokens a slice x 2 slices / 64, up to a multiple of the 32 batch shards
    assert "Raise train.global_batch_size from 16 to 4,064 sequences of 64 tokens" in out, out
    assert "train.global_batch_size: 4064" in out


SPARSE_VARIANT = '''"""A test's variant: the dense model, counted as a mixture of experts would be (each token
uses 1/20 of the parameters)."""

from .registry import register
from .transformer import TransformerLM, param_count


def sparse_flops_per_token(cfg) -> int:
    return 6 * param_count(cfg) // 20


@register("sparse-test", flops_per_token=sparse_flops_per_token)
class SparseTestLM(TransformerLM):
    pass
'''


@pytest.mark.slow  # two child interpreters that import the experiment's model (~5 s)
def test_a_sparse_variant_needs_the_tokens_its_flops_per_token_says(project, capsys):
    # A fork's variant (a module that registers it) and its preset (extends another): the plan
    # takes the model's work per token from the experiment's own flops_per_token.
    fork = project / "sparse-model"
    shutil.copytree(project / "my-model", fork)
    (fork / "trainer" / "model" / "sparse_test.py").write_text(SPARSE_VARIANT)
    (fork / "configs" / "sparse.toml").write_text(
        'extends = "llama-3.2-1b"\n[model]\nkind = "sparse-test"\n')
    args = ["--experiment", str(fork), "--accelerator-type", "v5litepod-16", "--slices", "2"]
    dense = plan_json(capsys, *args, "--config", "llama-3.2-1b")
    sparse = plan_json(capsys, *args, "--config", "sparse")
    assert sparse["params"] == dense["params"] == 1_235_814_400
    assert dense["active_fraction"] == 1.0  # attention's FLOPs put it above 1: capped
    assert sparse["active_fraction"] == pytest.approx(0.05)
    assert sparse["min_tokens_per_slice"] == pytest.approx(20 * dense["min_tokens_per_slice"],
                                                           rel=1e-6)
    assert main(["plan", *args, "--config", "sparse"]) == 0
    out = capsys.readouterr().out
    assert "work per token" in out and "5.0% of 6 x parameters" in out
    assert "needs 20.0x the tokens of a dense model" in out


@pytest.mark.slow  # child interpreters that import the experiment's model (~3 s each)
def test_the_recommendation_is_one_the_experiments_own_resolve_accepts(project, capsys):
    # d_model 72 does not split over FSDP 16 (v4-32: 16 devices a slice), so the model refuses
    # the first recommendation; the plan says so and gives the largest FSDP it accepts.
    args = ["--experiment", str(project / "my-model"), "--config", "tiny", "--set",
            "model.d_model=72", "--accelerator-type", "v4-32", "--slices", "2"]
    out = plan_json(capsys, *args)
    assert out["recommendation"]["mesh"]["ici_fsdp"] == 8
    assert out["recommendation"]["mesh"]["ici_data"] == 2
    assert main(["plan", *args]) == 0
    text = capsys.readouterr().out
    assert "refuses ici_fsdp=16 dcn_data=2: model.d_model = 72 is not divisible by the fsdp " \
           "parallelism 16" in text, text
    assert "ici_fsdp=8 with ici_data=2 is the largest FSDP inside a slice it accepts" in text
    # a mesh the user gave is checked, never changed
    assert main(["plan", *args, "--ici-fsdp", "16", "--dcn-data", "-1"]) == 2
    assert "the recommended mesh (ici_fsdp=16 dcn_data=2) is refused by" in \
        capsys.readouterr().err
