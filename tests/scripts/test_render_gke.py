"""`multislice render --diff` on a GKE stack: the verdict says what happens to the node pools."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from scripts import render
from tests.infra.conftest import make_experiment
from tests.scripts.test_render_cli import write_stack

IMAGE = "us-docker.pkg.dev/p/r/boot:1@sha256:" + "a" * 64
GKE = {"region": "us-central1", "zone": "us-central1-a", "orchestration": "gke",
       "gke": {"cluster": "projects/my-proj/locations/us-central1/clusters/train",
               "image": IMAGE}}


@pytest.fixture(scope="module")
def experiment() -> str:
    rel = f"experiments/_render_gke_test_{os.getpid()}"
    exp = make_experiment(render.ROOT, rel)
    yield rel
    shutil.rmtree(exp)


@pytest.fixture(scope="module")
def base(experiment, tmp_path_factory) -> dict:
    return render.build_manifest(write_stack(tmp_path_factory.mktemp("base"), experiment, **GKE))


def diff_to(base: dict, directory: Path, experiment: str, **overrides) -> str:
    stack = write_stack(directory, experiment, **{**GKE, **overrides})
    return render.diff_manifests(base, render.build_manifest(stack))


def test_a_trainer_change_keeps_the_node_pools_and_the_running_jobset(base, experiment, tmp_path):
    diff = diff_to(base, tmp_path, experiment, trainer={
        "config": "tiny", "steps": 5000, "mesh": {"ici_fsdp": 16, "dcn_data": -1},
        "overrides": {"train.global_batch_size": 64}})
    assert diff.splitlines()[-1] == render.GKE_KEEPS_WITH_NEW_SPEC
    body = diff.splitlines()[:-1]
    # only the launch spec object changes: a running JobSet's pods follow it in place
    assert not [line for line in body if "NodePool" in line or "JobSet" in line], body
    assert any("/launch/" in line and line.startswith("~ ") for line in body), body


def test_a_code_change_keeps_the_node_pools_and_the_running_jobset(base, experiment, tmp_path):
    main = render.ROOT / experiment / "trainer" / "main.py"
    before = main.read_text()
    try:
        main.write_text(before + "# day two\n")
        diff = diff_to(base, tmp_path, experiment)
    finally:
        main.write_text(before)
    assert diff.splitlines()[-1] == render.GKE_KEEPS_WITH_NEW_SPEC
    assert "trainer/main.py" in diff
    assert not [line for line in diff.splitlines()[:-1] if "JobSet" in line], diff


def test_more_slices_add_node_pools_and_replace_the_jobset(base, experiment, tmp_path):
    diff = diff_to(base, tmp_path, experiment, slices=4)
    verdict = diff.splitlines()[-1]
    assert verdict.startswith("verdict: keeps the other TPU node pools; adds node pools "
                              "ms-dev-s2, ms-dev-s3; REPLACES the JobSet"), verdict


def test_another_accelerator_replaces_the_node_pools(base, experiment, tmp_path):
    diff = diff_to(base, tmp_path, experiment, accelerator_type="v5litepod-32", trainer={
        "config": "tiny", "steps": 100, "mesh": {"ici_fsdp": 32, "dcn_data": -1},
        "overrides": {"train.global_batch_size": 64}})
    verdict = diff.splitlines()[-1]
    assert verdict.startswith("verdict: REPLACES 2 TPU node pool(s) (nodeCount, "
                              "placementPolicy changed)"), verdict


def test_the_kubeconfig_holds_no_token_and_shows_its_credential_plugin(base):
    providers = [r for r in base["resources"] if r["type"] == "pulumi:providers:kubernetes"]
    assert len(providers) == 2  # the stack's own objects; what it upserts (its namespace)
    for provider in providers:
        kubeconfig = json.loads(provider["inputs"]["kubeconfig"])
        assert [u["user"]["exec"]["args"] for u in kubeconfig["users"]] == [["gke-token"]]
        assert "token" not in {key for u in kubeconfig["users"] for key in u["user"]}


def test_flex_start_capacity_replaces_the_node_pools_and_keeps_the_jobset(base, experiment,
                                                                          tmp_path):
    diff = diff_to(base, tmp_path, experiment, capacity="flex-start")
    verdict = diff.splitlines()[-1]
    assert verdict.startswith("verdict: REPLACES 2 TPU node pool(s) (nodeConfig, nodeCount "
                              "changed)"), verdict
    assert "JobSet" not in verdict, verdict


# ---- the shipped capacity and workload examples, shared safely (issue: many teams) ----


def _of(manifest: dict, kind: str) -> list[dict]:
    return [r["inputs"] for r in manifest["resources"] if r["type"].endswith(f":{kind}")]


def test_the_capacity_example_renders_a_cluster_teams_can_share_safely(tmp_path):
    import yaml

    from tests.support.examples import ROOT

    manifest = render.build_manifest(ROOT / "stacks" / "Pulumi.gke-capacity.yaml")
    namespaces = _of(manifest, "Namespace")
    assert {n["metadata"]["name"] for n in namespaces} == {"team-a", "team-b"}
    assert {n["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]
            for n in namespaces} == {"baseline"}
    assert sorted(p["metadata"]["namespace"] for p in _of(manifest, "NetworkPolicy")) == \
        ["team-a", "team-b"]
    queues = _of(manifest, "ClusterQueue")
    assert len(queues) == 4 and {q["spec"]["cohortName"] for q in queues} == {"ms-gke-capacity"}
    taint = {"key": "multislice.dev/stack", "value": "ms-gke-capacity", "effect": "NO_SCHEDULE"}
    pools = [p for p in _of(manifest, "NodePool") if "placementPolicy" in p]  # the TPU pools
    assert len(pools) == 3 and all(taint in p["nodeConfig"]["taints"] for p in pools)
    flavors = _of(manifest, "ResourceFlavor")
    assert len(flavors) == 2 and all(f["spec"]["tolerations"] == [{
        "key": "multislice.dev/stack", "operator": "Equal", "value": "ms-gke-capacity",
        "effect": "NoSchedule"}] for f in flavors)
    assert _of(manifest, "ValidatingAdmissionPolicyBinding")
    # the same capacity on an existing cluster installs no controller
    raw = yaml.safe_load((ROOT / "stacks" / "Pulumi.gke-capacity.yaml").read_text())
    gke = raw["config"]["multislice:gke"]
    del gke["create_cluster"], gke["authorized_networks"]
    gke["cluster"] = "projects/your-platform-project/locations/us-central1/clusters/shared"
    existing = tmp_path / "Pulumi.cap-existing.yaml"
    existing.write_text(yaml.safe_dump(raw))
    manifest = render.build_manifest(existing)
    assert not [r for r in manifest["resources"] if r["type"] == "kubernetes:yaml/v2:ConfigFile"]
    assert not _of(manifest, "Namespace")  # the platform's, checked at preview


def test_the_workload_examples_pods_pass_baseline_and_a_workload_without_a_queue_is_refused(
        tmp_path, experiment):
    import yaml

    from tests.support.examples import ROOT
    from tests.support.pod_security import admitted

    raw = yaml.safe_load((ROOT / "stacks" / "Pulumi.gke-workload.yaml").read_text())
    raw["config"]["multislice:experiment_dir"] = experiment
    stack = tmp_path / "Pulumi.wl.yaml"
    stack.write_text(yaml.safe_dump(raw))
    (jobset,) = _of(render.build_manifest(stack), "JobSet")
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert admitted(pod, "baseline") == []
    del raw["config"]["multislice:gke"]["local_queue"]
    stack.write_text(yaml.safe_dump(raw))
    with pytest.raises(render.RenderError, match="gke.local_queue: required with gke.kind "
                                               "'workload': shared pools take only"):
        render.build_manifest(stack)


def test_a_gke_verdict_speaks_of_pools_and_jobsets_never_of_a_queued_resource():
    from scripts.render import JOBSET, NODE_POOL, ResourceChange, gke_verdict

    spec = ["metadata.annotations.multislice.dev/launch-spec-sha256"]
    new_jobset = [ResourceChange(JOBSET, "ms-w", "added", [], [])]
    new_spec = [ResourceChange(render.BUCKET_OBJECT, "b/launch/w.json", "rewritten", ["source"],
                               ["source"])]
    assert gke_verdict(new_spec, owns_pools=False) == render.GKE_WORKLOAD_KEEPS_WITH_NEW_SPEC
    assert gke_verdict(new_spec) == render.GKE_KEEPS_WITH_NEW_SPEC
    assert gke_verdict(new_jobset, owns_pools=False).startswith(
        "verdict: CREATES the JobSet (new stack)")
    new_run = [ResourceChange(JOBSET, "ms-w", "replaced", ["spec"], ["spec"],
                              [f"spec.replicatedJobs[0].template.spec.template.{spec[0]}"])]
    assert "a new launch spec is a new run: REPLACES the JobSet on the admin's pools" in \
        gke_verdict(new_run, owns_pools=False)
    assert gke_verdict([], owns_pools=False) == \
        "verdict: keeps the JobSet (the node pools are the admin's)"
    new_capacity = [ResourceChange(NODE_POOL, f"ms-p-s{i}", "added", [], []) for i in range(2)]
    assert gke_verdict(new_capacity, has_jobset=False) == \
        "verdict: CREATES 2 TPU node pool(s) (new capacity stack)"
    assert gke_verdict([], has_jobset=False) == "verdict: keeps the TPU node pools"
    for words in (gke_verdict(c, owns_pools=o, has_jobset=j) for c, o, j in (
            (new_jobset, False, True), (new_run, False, True), (new_capacity, True, False))):
        assert "queued resource" not in words
