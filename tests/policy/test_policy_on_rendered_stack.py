"""The policy pack against the stack the Pulumi program really declares (offline render)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from pulumi_policy import PolicyResource, ResourceValidationArgs, StackValidationArgs
from pulumi_policy.proxy import unknown_checking_proxy

from scripts import render
from tests.infra.conftest import make_experiment

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "policy"))
import multislice_policies as mp  # noqa: E402

RESOURCE_CHECKS = (
    mp.check_no_open_ingress,
    mp.check_no_external_ips,
    mp.check_bucket_public_access_prevention,
    mp.check_no_default_compute_service_account,
    mp.check_required_labels,
)


@pytest.fixture(scope="module")
def experiment() -> str:
    rel = f"experiments/_policy_test_{os.getpid()}"
    exp = make_experiment(render.ROOT, rel)
    yield rel
    shutil.rmtree(exp)


def rendered_violations(directory: Path, experiment: str, **overrides) -> list[str]:
    config = {
        "project": "my-proj", "region": "us-central2", "zone": "us-central2-b",
        "accelerator_type": "v4-8", "slices": 2, "experiment_dir": experiment,
        "trainer": {"config": "tiny", "mesh": {"ici_fsdp": 4, "dcn_data": 2}},
    }
    config.update(overrides)
    directory.mkdir(parents=True, exist_ok=True)
    stack = directory / "Pulumi.prod.yaml"
    stack.write_text(yaml.safe_dump({"config": {f"multislice:{k}": v for k, v in config.items()}}))
    manifest = render.build_manifest(stack)
    found: list[str] = []

    def report(message: str, urn: str | None = None) -> None:
        found.append(message)

    resources = []
    for resource in manifest["resources"]:
        urn = f"urn:pulumi:prod::multislice::{resource['type']}::{resource['name']}"
        props = unknown_checking_proxy(resource["inputs"])
        args = ResourceValidationArgs(resource["type"], props, urn, resource["name"], None, None)
        for check in RESOURCE_CHECKS:
            check(args, report)
        resources.append(PolicyResource(resource["type"], props, urn, resource["name"], None,
                                        None, None, [], {}))
    mp.check_slice_cap(StackValidationArgs(resources), report)
    return found


def test_the_default_stack_passes_every_policy(experiment, tmp_path):
    assert rendered_violations(tmp_path, experiment) == []


def test_external_ips_and_too_many_slices_are_caught_in_the_real_program(experiment, tmp_path):
    found = rendered_violations(tmp_path, experiment, external_ips=True, slices=32,
                                trainer={"config": "tiny", "mesh": {"ici_fsdp": 4, "dcn_data": 32},
                                         "overrides": {"train.global_batch_size": 128}})
    assert len(found) == 2
    assert any("enableExternalIps" in m for m in found)
    assert any("32 TPU slices" in m for m in found)


@pytest.mark.parametrize("gke", [
    {"cluster": "projects/my-proj/locations/us-central1/clusters/c"},
    {"create_cluster": True},
], ids=["existing-cluster", "created-cluster"])
def test_a_gke_stack_passes_every_policy(experiment, tmp_path, gke):
    assert rendered_violations(
        tmp_path, experiment, region="us-central1", zone="us-central1-a",
        accelerator_type="v5litepod-16", orchestration="gke",
        gke={**gke, "image": "r/i@sha256:" + "a" * 64},
        trainer={"config": "tiny", "mesh": {"ici_fsdp": 16, "dcn_data": 2},
                 "overrides": {"train.global_batch_size": 64}}) == []
