"""`multislice render`: the Pulumi program under the mock runtime, as a stable manifest and diff."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from scripts import render
from scripts.cli import main as cli
from tests.infra.conftest import make_experiment

ROOT = render.ROOT


@pytest.fixture(scope="module")
def experiment() -> str:
    """A minimal experiment inside the project (experiment_dir is relative to Pulumi.yaml)."""
    rel = f"experiments/_render_test_{os.getpid()}"
    exp = make_experiment(ROOT, rel)
    yield rel
    shutil.rmtree(exp)


def write_stack(directory: Path, experiment: str, stack: str = "dev", **overrides) -> Path:
    config = {
        "project": "my-proj", "region": "us-central2", "zone": "us-central2-b",
        "accelerator_type": "v5litepod-16", "slices": 2, "capacity": "spot",
        "labels": {"team": "research"}, "experiment_dir": experiment,
        "trainer": {"config": "tiny", "steps": 100, "mesh": {"ici_fsdp": 16, "dcn_data": -1},
                    "overrides": {"train.global_batch_size": 64}},
    }
    config.update(overrides)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"Pulumi.{stack}.yaml"
    path.write_text(yaml.safe_dump({"config": {f"multislice:{k}": v for k, v in config.items()}}))
    return path


@pytest.fixture(scope="module")
def rendered(experiment, tmp_path_factory) -> tuple[Path, Path, dict]:
    """(stack config, manifest file written by the CLI, parsed manifest)."""
    directory = tmp_path_factory.mktemp("stack")
    stack = write_stack(directory, experiment)
    out = directory / "manifest.yaml"
    assert cli(["render", str(stack), "--output", str(out)]) == 0
    return stack, out, yaml.safe_load(out.read_text())


def by_type(manifest: dict, typ: str) -> list[dict]:
    return [r for r in manifest["resources"] if r["type"] == typ]


def test_same_input_gives_the_same_bytes(rendered, tmp_path):
    stack, first, _ = rendered
    again = tmp_path / "again.yaml"
    assert cli(["render", str(stack), "--output", str(again)]) == 0
    assert again.read_bytes() == first.read_bytes()


@pytest.mark.slow
def test_same_bytes_from_another_process_hash_seed_and_directory(rendered, tmp_path):
    stack, first, _ = rendered
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    fresh = subprocess.run([sys.executable, "-m", "scripts.cli", "render", str(stack)],
                           cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT)},
                           capture_output=True, timeout=300, check=True)
    assert fresh.stdout == first.read_bytes()


def test_manifest_has_no_absolute_paths_or_timestamps(rendered):
    stack, first, _ = rendered
    text = first.read_text()
    for path in (str(ROOT), str(stack.parent), str(Path.home())):
        assert path not in text
    assert not re.search(r"\d{4}-\d\d-\d\dT\d\d:\d\d", text)
    assert text.startswith("manifest_version: 1\n")


def test_manifest_describes_every_resource_with_its_parent(rendered):
    _, _, manifest = rendered
    assert manifest["stack"] == "dev" and manifest["project"] == "multislice"
    keys = [(r["type"], r["name"]) for r in manifest["resources"]]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    types = {r["type"] for r in manifest["resources"]}
    assert {"gcp:compute/network:Network", "gcp:compute/firewall:Firewall",
            "gcp:compute/routerNat:RouterNat", "gcp:storage/bucket:Bucket",
            "gcp:serviceaccount/account:Account", render.DYNAMIC} <= types
    components = {f"{r['type']}::{r['name']}" for r in manifest["resources"] if not r["custom"]}
    for resource in manifest["resources"]:
        if resource["custom"]:
            assert resource["parent"] in components, resource["name"]
        else:
            assert resource["parent"] is None
    (bucket,) = by_type(manifest, "gcp:storage/bucket:Bucket")
    assert bucket["inputs"]["publicAccessPrevention"] == "enforced"
    assert bucket["inputs"]["labels"] == {"multislice-stack": "dev", "team": "research"}


def test_queued_resource_carries_the_full_api_request(rendered):
    _, _, manifest = rendered
    (qr,) = [r for r in by_type(manifest, render.DYNAMIC) if "api_request" in r]
    assert qr["parent"].startswith("multislice:infra:QueuedResource::")
    request = qr["api_request"]
    assert request["parent"] == "projects/my-proj/locations/us-central2-b"
    assert request["queued_resource_id"] == "ms-dev-qr"
    queued = request["queued_resource"]
    assert queued["spot"] == {}
    (node_spec,) = queued["tpu"]["node_spec"]
    assert node_spec["multislice_params"] == {"node_count": 2, "node_id_prefix": "ms-dev"}
    node = node_spec["node"]
    assert node["accelerator_type"] == "v5litepod-16"
    assert node["service_account"]["email"] == "ms-dev-tpu@my-proj.iam.gserviceaccount.com"
    assert node["network_config"]["enable_external_ips"] is False
    assert node["metadata"]["startup-script"].startswith("#!")
    assert node["metadata"]["launch-spec-uri"] == "gs://my-proj-ms-dev/launch/dev.json"
    [spec] = [r for r in by_type(manifest, "gcp:storage/bucketObject:BucketObject")
              if r["inputs"]["name"] == "launch/dev.json"]
    launch = json.loads(spec["inputs"]["source"]["string_asset"])
    assert launch["expect_slices"] == 2 and launch["mesh"]["dcn_data"] == 2
    assert "__provider" not in qr["inputs"]  # the pickled provider is neither stable nor useful


def test_json_format_holds_the_same_manifest(rendered, capsys):
    stack, _, manifest = rendered
    assert cli(["render", str(stack), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == manifest


def test_diff_names_each_changed_added_and_removed_field(rendered, experiment, tmp_path, capsys):
    stack, manifest_file, _ = rendered
    changed = write_stack(tmp_path / "pr", experiment, slices=4, ssh_from_iap=True,
                          labels={"owner": "infra"})
    assert cli(["render", str(changed), "--diff", str(stack)]) == 0
    lines = capsys.readouterr().out.splitlines()
    qr_header = (f"~ {render.DYNAMIC} ms-dev-qr (REPLACED: labels, slices cannot change in "
                 "place)")
    assert qr_header in lines, lines
    assert "-   inputs.slices: 2" in lines and "+   inputs.slices: 4" in lines
    assert "-   inputs.labels.team: \"research\"" in lines
    assert "+   inputs.labels.owner: \"infra\"" in lines
    assert ("+   api_request.queued_resource.tpu.node_spec[0].multislice_params.node_count: 4"
            in lines)
    assert "+   inputs.source.string_asset(json).expect_slices: 4" in lines
    added = [line for line in lines if line.endswith("(added)")]
    assert added and all("iap" in line for line in added)  # the SSH-from-IAP firewall rule
    assert re.fullmatch(r"1 added, 0 removed, \d+ replaced, \d+ objects rewritten, \d+ updated "
                        r"in place, outputs changed", lines[-2]), lines[-2]
    assert lines[-1] == ("verdict: REPLACES the queued resource (labels changed, slices 2 -> 4): "
                         "the job gives up its capacity and queues again")

    # a manifest from --output works as OTHER too, and an unchanged stack has no differences
    assert cli(["render", str(stack), "--diff", str(manifest_file)]) == 0
    assert capsys.readouterr().out == "no changes\nverdict: keeps the queued resource\n"


def test_invalid_stack_config_exits_2_with_the_schema_message(experiment, tmp_path, capsys):
    bad = write_stack(tmp_path, experiment, zone="europe-west4-a")
    out = tmp_path / "manifest.yaml"
    assert cli(["render", str(bad), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "zone: 'europe-west4-a' is not in region 'us-central2'" in err and str(bad) in err
    assert not out.exists()


def test_diff_against_an_unrelated_file_exits_2(rendered, tmp_path, capsys):
    stack, _, _ = rendered
    other = tmp_path / "notes.yaml"
    other.write_text("hello: world\n")
    assert cli(["render", str(stack), "--diff", str(other)]) == 2
    assert "neither a manifest" in capsys.readouterr().err


@pytest.mark.parametrize(("content", "message"), [
    (b"\x89PNG\r\n\x1a\n\xff\xfe\x00", "not a text file"),
    (b"manifest_version: 1\nresources:\n  - type: gcp:storage/bucket:Bucket\n    inputs: {na",
     "cannot read it"),  # cut short
    (b"manifest_version: 1\nresources: {a: 1}\n", "'resources' is not a list"),
    (b"manifest_version: 1\nresources: [1, 2]\n", "'resources' is not a list"),
    (b"config: [\n", "cannot read it"),
])
def test_diff_with_a_base_that_is_not_a_render_is_one_line(rendered, tmp_path, capsys, content,
                                                           message):
    stack, _, _ = rendered
    base = tmp_path / "base.yaml"
    base.write_bytes(content)
    assert cli(["render", str(stack), "--diff", str(base)]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines()
           if not line.startswith("multislice render: warning:")]  # the stack's own warnings
    assert len(err) == 1 and message in err[0] and "Traceback" not in err[0], err


def test_diff_of_a_trainer_change_keeps_the_queued_resource(rendered, experiment, tmp_path,
                                                             capsys):
    stack, _, _ = rendered
    trainer = {"config": "tiny", "steps": 500, "mesh": {"ici_fsdp": 16, "dcn_data": -1},
               "overrides": {"train.global_batch_size": 64}}
    changed = write_stack(tmp_path / "pr", experiment, trainer=trainer, wait_for_active_s=7200)
    assert cli(["render", str(changed), "--diff", str(stack)]) == 0
    lines = capsys.readouterr().out.splitlines()
    spec = [line for line in lines if line.startswith("~ ") and "launch/dev.json" in line]
    assert spec == ["~ gcp:storage/bucketObject:BucketObject my-proj-ms-dev/launch/dev.json "
                    "(rewritten as a new object: source changed; a bucket object cannot "
                    "change in place)"], lines
    assert "+   inputs.source.string_asset(json).trainer.steps: 500" in lines
    assert f"~ {render.DYNAMIC} ms-dev-qr (updated in place: wait_for_active_s)" in lines
    assert lines[-1] == ("verdict: keeps the queued resource; the VMs restart their trainers on "
                         "the new launch spec (saved at a step boundary, resumed from it)")


def test_diff_of_two_stacks_matches_resources_by_role_and_shows_only_real_differences(
        rendered, experiment, tmp_path, capsys):
    stack, _, _ = rendered
    other = write_stack(tmp_path / "other", experiment, stack="prod", slices=4,
                        capacity="on-demand")
    assert cli(["render", str(other), "--diff", str(stack)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert not [line for line in lines if line.endswith(("(added)", "(removed)"))], out
    assert "-   inputs.slices: 2" in lines and "+   inputs.slices: 4" in lines
    changed_inputs = {line.split(":")[0][4:] for line in lines
                      if line.startswith(("-   inputs.", "+   inputs.")) and "string_asset" not in
                      line and "startup-script" not in line}
    # what names the stack: its stack file (the env check's) and its run (the hosts' writes)
    assert changed_inputs == {"inputs.slices", "inputs.capacity", "inputs.stack_file",
                              "inputs.condition.expression"}, changed_inputs
    assert lines[-1].startswith("verdict: REPLACES the queued resource (capacity \"spot\" -> "
                                "\"on-demand\", slices 2 -> 4)")


def _run(run_prefix: str, **shape) -> dict:
    """A manifest holding just the stack's run check, as infra/preview/run_check.py registers it."""
    inputs = {"project": "p", "bucket": "b", "run_prefix": run_prefix,
              "model_shape": {"d_model": 768, **shape}}
    return {"resources": [{"type": render.DYNAMIC, "name": "ms-dev-run-check",
                           "inputs": inputs}]}


def test_the_verdict_names_a_model_shape_change_and_a_new_run_name():
    base = _run("runs/dev")
    assert render.run_verdict(base, _run("runs/dev")) is None
    assert render.run_verdict(base, _run("runs/dev", d_model=64)) == (
        "the model's shape changes (d_model 768 -> 64): the run's checkpoints in gs://b/runs/dev "
        "will not restore; set a new run_name")
    assert render.run_verdict(base, _run("runs/dev-v2", d_model=64)) == (
        "the trainer starts fresh in gs://b/runs/dev-v2 (a new run_name; gs://b/runs/dev keeps "
        "its checkpoints)")
    assert render.run_verdict({"resources": []}, base) is None  # a base from older code
    # "resumes" is no longer claimed once the run cannot, on either orchestration
    for said in (render.KEEPS_WITH_NEW_SPEC, render.GKE_NEW_RUN):
        told = render.with_run_verdict(said, "the trainer starts fresh in X")
        assert "resume" not in told and told.endswith(": the trainer starts fresh in X")


def test_a_render_records_the_run_the_models_shape_and_the_deployers_act_as_account(tmp_path):
    from tests.infra.conftest import make_full_experiment

    exp = make_full_experiment(tmp_path)
    manifest = render.build_manifest(write_stack(tmp_path / "stacks", str(exp),
                                                 deployer="user:ana@example.com"))
    run = render._run_check(manifest)
    assert (run["bucket"], run["run_prefix"]) == ("my-proj-ms-dev", "runs/dev")
    assert run["model_shape"]["d_model"] == 64 and "dtype" not in run["model_shape"]
    assert "seq_len" not in run["model_shape"]  # RoPE: no parameter has its shape
    # the check holds nothing: it is never replaced, and the spec object waits for it
    (spec,) = [r for r in manifest["resources"] if r["type"] == render.BUCKET_OBJECT
               and "/launch/" in f"/{r['inputs']['name']}"]
    assert "pulumi-python:dynamic:Resource::ms-dev-run-check" in spec["depends_on"]
    # the account the deployer's actAs grant covers is named
    [grant] = [r for r in manifest["resources"]
               if r["type"] == "gcp:serviceaccount/iAMMember:IAMMember"]
    assert grant["inputs"] == {
        "member": "user:ana@example.com", "role": "roles/iam.serviceAccountUser",
        "serviceAccountId": "projects/my-proj/serviceAccounts/"
                            "ms-dev-tpu@my-proj.iam.gserviceaccount.com"}

