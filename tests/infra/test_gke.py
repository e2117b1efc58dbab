"""Orchestration gke: the node pool table, the stack checks, the JobSet, and the program's graph."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import kubernetes_validate
import pytest

from infra import PROJECT_ROOT
from infra.gke import capacity as gke_capacity
from infra.gke import controllers
from infra.gke import manifest as gke_manifest
from infra.gke import names as jobset_names
from infra.gke.topology import GKE_FAMILIES, GkeTopologyError, gke_slice
from infra.gke.webhooks import ManifestError, control_plane_ports
from infra.stack_config.schema import DEFAULT_GKE_IMAGE, StackConfig, StackConfigError
from infra.stack_config.topology import GENERATIONS, parse_accelerator_type
from infra.stack_config.validation import stack_problems
from tests.infra.conftest import base_config
from tests.infra.pulumi_mocks import run_program

NODE_POOL = "gcp:container/nodePool:NodePool"
CLUSTER = "gcp:container/cluster:Cluster"
JOBSET = "kubernetes:jobset.x-k8s.io/v1alpha2:JobSet"
SPEC_SHA256 = gke_manifest.launch_spec_sha256("{}")
KSA = "kubernetes:core/v1:ServiceAccount"
SA_IAM = "gcp:serviceaccount/iAMMember:IAMMember"
PROVIDER = "pulumi:providers:kubernetes"
NETWORK = "gcp:compute/network:Network"
QUEUED = "pulumi-python:dynamic:Resource"
IMAGE = "us-docker.pkg.dev/p/r/boot:1@sha256:" + "a" * 64
CLUSTER_NAME = "projects/my-proj/locations/us-central1/clusters/train"
KUBERNETES_VERSION = "1.31"  # the oldest minor of GKE's release channels here


def gke_config(**overrides):
    cfg = base_config(
        region="us-central1", zone="us-central1-a", accelerator_type="v5litepod-16", slices=2,
        orchestration="gke", gke={"cluster": CLUSTER_NAME, "image": IMAGE},
        trainer={"config": "tiny", "steps": 20, "mesh": {"ici_fsdp": 16},
                 "overrides": {"train.global_batch_size": 32}})
    cfg.update(overrides)
    return cfg


def problems_of(**overrides) -> list[str]:
    cfg = StackConfig.model_validate({"stack": "exp", **gke_config(**overrides)})
    return stack_problems(cfg)[0]


# ---- the table --------------------------------------------------------------------------------


def test_v5litepod_16_is_four_ct5lp_nodes_of_a_4x4_topology():
    shape = gke_slice(parse_accelerator_type("v5litepod-16"))
    assert (shape.accelerator, shape.machine_type, shape.topology, shape.nodes) == (
        "tpu-v5-lite-podslice", "ct5lp-hightpu-4t", "4x4", 4)


@pytest.mark.parametrize("gen", GENERATIONS, ids=lambda g: g.family)
def test_every_multi_host_size_has_a_topology_whose_chips_fill_its_nodes(gen):
    family = GKE_FAMILIES[gen.family]
    mapped = 0
    for size in gen.valid_sizes:
        topo = parse_accelerator_type(f"{gen.family}-{size}")
        if topo.chips < 8:
            continue
        shape = gke_slice(topo)
        dims = [int(d) for d in shape.topology.split("x")]
        assert math.prod(dims) == topo.chips == shape.nodes * shape.chips_per_node, size
        assert len(dims) == (3 if gen.counts_tensorcores else 2), shape.topology
        assert shape.machine_type == family.machine_type
        mapped += 1
    assert mapped >= (4 if gen.family == "tpu7x" else 5)  # TPU7x: the documented four


@pytest.mark.parametrize("name", ["v5litepod-4", "v4-8", "v5p-8", "v6e-4", "v5litepod-1"])
def test_a_single_host_type_is_refused_with_the_reason_and_a_multi_host_choice(name):
    with pytest.raises(GkeTopologyError, match="single-host.*multi-host TPU slice node pools "
                                               "only.*use a multi-host type such as"):
        gke_slice(parse_accelerator_type(name))


# ---- the stack checks --------------------------------------------------------------------------


def test_the_gke_example_config_has_no_problems():
    assert problems_of() == []


def test_a_stack_that_names_no_image_runs_the_default_one_pinned_by_digest():
    overrides = {"gke": {"cluster": CLUSTER_NAME}}
    assert problems_of(**overrides) == []
    cfg = StackConfig.model_validate({"stack": "exp", **gke_config(**overrides)})
    [container] = gke_manifest.jobset(cfg, SPEC_SHA256)["spec"]["replicatedJobs"][0]["template"]["spec"][
        "template"]["spec"]["containers"]
    assert container["image"] == DEFAULT_GKE_IMAGE
    name, digest = DEFAULT_GKE_IMAGE.split("@sha256:")
    assert name == "docker.io/library/python:3.11.15-bookworm"
    assert re.fullmatch(r"[0-9a-f]{64}", digest)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"gke": {"cluster": "train", "image": IMAGE}},
     r"gke.cluster: 'train' is not a full cluster resource name; use projects/PROJECT/"),
    ({"gke": {"cluster": "projects/my-proj/locations/europe-west4/clusters/c", "image": IMAGE}},
     r"gke.cluster: .* is in 'europe-west4', but the stack's TPUs are in zone 'us-central1-a'"),
    ({"gke": {"cluster": "projects/other-proj/locations/us-central1/clusters/c", "image": IMAGE}},
     r"is in project 'other-proj', not the stack's project 'my-proj'"),
    ({"gke": {"image": IMAGE}}, r"gke: give exactly one of cluster .* and create_cluster"),
    ({"gke": {"cluster": CLUSTER_NAME, "create_cluster": True, "image": IMAGE}},
     r"gke: give exactly one of cluster"),
    ({"gke": {"cluster": CLUSTER_NAME, "image": "python:3.11"}},
     r"gke.image: 'python:3.11' is not pinned by digest"),
    ({"gke": {"cluster": CLUSTER_NAME,
              "image": "us-docker.pkg.dev/my-proj/trainer@sha256:" + "a" * 64}},
     r"gke.image: .* is in Artifact Registry but names no repository"),
    ({"gke": {"cluster": CLUSTER_NAME, "image": IMAGE, "namespace": "team-a",
              "local_queue": "q" * 64}},
     r"gke.local_queue: 'q{64}' \(64 characters\) becomes the JobSet's "
     r"kueue.x-k8s.io/queue-name label, whose value Kubernetes allows at most 63"),
    ({"gke": {"create_cluster": True, "install_jobset": False, "image": IMAGE}},
     r"gke.install_jobset: false on a cluster create_cluster makes"),
    # a trailing newline (a YAML block scalar) is no image reference, as for the registry
    ({"gke": {"cluster": CLUSTER_NAME, "image": IMAGE + "\n"}},
     r"gke.image: .*\\n' is not an image reference"),
    ({"gke": {"cluster": CLUSTER_NAME + "\n", "image": IMAGE}},
     r"is not a GKE cluster name"),
    ({"gke": None}, r"gke: orchestration 'gke' needs multislice:gke"),
    ({"accelerator_type": "v5litepod-4", "trainer": {"mesh": {"ici_fsdp": 4}}},
     r"accelerator_type: 'v5litepod-4' is a single-host slice"),
    ({"runtime_version": "v2-alpha-tpuv5-lite"},
     r"runtime_version: does not apply to orchestration 'gke'"),
    ({"valid_until": "6h"}, r"valid_until: does not apply to orchestration 'gke'"),
    ({"ssh_from_iap": True}, r"ssh_from_iap: does not apply"),
    ({"external_ips": False}, r"external_ips: does not apply"),
    ({"wait_for_active_s": 60}, r"wait_for_active_s: does not apply"),
    ({"capacity": "guaranteed"}, r"capacity: 'guaranteed' is a queued-resource tier"),
    ({"capacity": "flex-start", "accelerator_type": "v4-16", "region": "us-central2",
      "zone": "us-central2-b", "trainer": {"mesh": {"ici_fsdp": 8}},
      "gke": {"cluster": "projects/my-proj/locations/us-central2/clusters/c", "image": IMAGE}},
     r"capacity: 'flex-start' does not run TPU v4 on GKE .*TPU v3 and v4 are not supported"),
    ({"capacity": "flex-start", "reservation_name": "r"},
     r"reservation_name: 'r' is set but capacity is 'flex-start'"),
    ({"gke": {"cluster": CLUSTER_NAME, "image": IMAGE, "install_kueue": False}},
     r"gke.install_kueue: False is set but gke.queueing is false"),
    ({"subnet_cidr": "10.0.0.0/20"}, r"subnet_cidr: does not apply to an existing cluster"),
])
def test_bad_gke_settings_get_one_line_naming_the_key_and_what_is_allowed(overrides, message):
    found = problems_of(**overrides)
    assert any(re.search(message, p) for p in found), found


def test_a_gke_block_on_a_tpu_vm_stack_is_refused_by_name():
    cfg = StackConfig.model_validate({"stack": "exp", **base_config(
        gke={"cluster": CLUSTER_NAME, "image": IMAGE})})
    assert any(p.startswith("gke: is set but orchestration is 'tpu-vm'")
               for p in stack_problems(cfg)[0])


def test_flex_start_on_a_tpu_vm_stack_is_refused_with_the_orchestration_that_has_it():
    cfg = StackConfig.model_validate({"stack": "exp", **base_config(capacity="flex-start")})
    (problem,) = stack_problems(cfg)[0]
    assert problem.startswith("capacity: 'flex-start' is a GKE node pool setting here")
    assert "set multislice:orchestration: gke, or use on-demand, spot, reserved" in problem


def test_an_unknown_gke_key_is_refused_with_the_allowed_keys(project_root):
    cfg = gke_config(gke={"cluster": CLUSTER_NAME, "image": IMAGE, "queue": True})
    with pytest.raises(StackConfigError, match=r"gke.queue.*(cluster|allowed)"):
        run_program(cfg, project_root)


def test_pod_names_over_63_characters_are_refused_as_the_jobset_webhook_would():
    assert problems_of() == []
    assert jobset_names.longest_names("ms-exp", 2, 4) == {"job": "ms-exp-slice-1",
                                                          "pod": "ms-exp-slice-1-3-abcde"}
    fits = "ms-" + "x" * 44  # ms-x...x-slice-1-3-abcde: 63 characters
    assert len(jobset_names.longest_names(fits, 2, 4)["pod"]) == 63
    assert jobset_names.name_problems("x" * 44, fits, 2, 4) == []
    (problem,) = jobset_names.name_problems("x" * 45, fits + "x", 2, 4)
    assert "JobSet pod names such as" in problem and "(64 characters)" in problem
    assert "DNS-1035 labels of at most 63 characters" in problem
    # the largest slice count and slice a stack can have still fit: 256 slices of v5p-12288
    assert jobset_names.name_problems("x" * 20, "ms-" + "x" * 20, 256, 1536) == []


# ---- the JobSet ---------------------------------------------------------------------------------


@pytest.fixture
def jobset():
    cfg = StackConfig.model_validate({"stack": "exp", **gke_config(
        trainer={"config": "tiny", "steps": 20, "mesh": {"ici_fsdp": 16}, "max_restarts": 7,
                 "overrides": {"train.global_batch_size": 32}})})
    return cfg, gke_manifest.jobset(cfg, SPEC_SHA256)


def test_the_jobset_has_one_job_per_slice_and_one_pod_per_node(jobset):
    cfg, js = jobset
    (rjob,) = js["spec"]["replicatedJobs"]
    job = rjob["template"]["spec"]
    assert rjob["replicas"] == cfg.slices == 2
    assert job["parallelism"] == job["completions"] == 4
    assert job["completionMode"] == "Indexed"  # GKE injects TPU_WORKER_ID only for Indexed Jobs
    assert js["metadata"]["annotations"] == {
        "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}
    pod = job["template"]["spec"]
    # the shape, and the label only this stack's pools carry (not another stack's of that shape)
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
                                   "cloud.google.com/gke-tpu-topology": "4x4",
                                   "multislice-stack": "exp"}
    pools = [gke_capacity.node_pool(cfg, i) for i in range(cfg.slices)]
    assert all(pod["nodeSelector"]["multislice-stack"] == p["node_config"]["labels"][
        "multislice-stack"] for p in pools)
    (container,) = pod["containers"]
    assert container["resources"]["limits"] == {"google.com/tpu": 4}
    assert container["image"] == IMAGE
    assert pod["serviceAccountName"] == "ms-exp-trainer"
    assert {"name": "MULTISLICE_LAUNCH_SPEC_URI", "value": "gs://my-proj-ms-exp/launch/exp.json"} \
        in container["env"]


def test_disruptions_restart_for_free_exit_2_and_3_fail_and_crashes_use_max_restarts(jobset):
    _, js = jobset
    policy = js["spec"]["failurePolicy"]
    assert policy["maxRestarts"] == 7
    assert policy["rules"] == [
        {"name": "disruption", "action": "RestartJobSetAndIgnoreMaxRestarts",
         "onJobFailureReasons": ["PodFailurePolicy"],
         "onJobFailureMessagePatterns": ["matching FailJob rule at index 0$"]},
        {"name": "deterministic_exit", "action": "FailJobSet",
         "onJobFailureReasons": ["PodFailurePolicy"],
         "onJobFailureMessagePatterns": ["matching FailJob rule at index 1$"]}]
    job = js["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["backoffLimit"] == 0
    assert job["podFailurePolicy"]["rules"] == [
        {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        {"action": "FailJob", "onExitCodes": {
            "containerName": "trainer", "operator": "In", "values": [2, 3]}}]
    assert job["template"]["spec"]["restartPolicy"] == "Never"


def test_each_slice_job_validates_strictly_against_the_kubernetes_api_schema(jobset):
    _, js = jobset
    rjob = js["spec"]["replicatedJobs"][0]
    job = {"apiVersion": "batch/v1", "kind": "Job",
           "metadata": {"name": "ms-exp-slice-0", "namespace": js["metadata"]["namespace"],
                        **rjob["template"]["metadata"]},
           "spec": rjob["template"]["spec"]}
    kubernetes_validate.validate(job, KUBERNETES_VERSION, strict=True)
    broken = json.loads(json.dumps(job))
    broken["spec"]["template"]["spec"]["containers"][0]["resources"]["limit"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


# ---- the program ---------------------------------------------------------------------------------


def test_an_existing_cluster_gets_one_compact_tpu_pool_per_slice_and_no_network(project_root):
    mocks, outputs = run_program(gke_config(capacity="spot"), project_root)
    pools = mocks.of_type(NODE_POOL)
    assert [p.name for p in pools] == ["ms-exp-s0", "ms-exp-s1"]
    for pool in pools:
        pool.expect("cluster", "train")
        pool.expect("location", "us-central1")
        pool.expect("nodeLocations", ["us-central1-a"])
        pool.expect("nodeCount", 4)
        pool.expect("placementPolicy", {"type": "COMPACT", "tpuTopology": "4x4"})
        pool.expect("management", {"autoRepair": True, "autoUpgrade": True})
        node = pool.inputs["nodeConfig"]
        assert node["machineType"] == "ct5lp-hightpu-4t"
        assert node["spot"] is True
        assert node["gvnic"] == {"enabled": True}
        # the nodes' own account; the trainer's is reached only through Workload Identity
        assert node["serviceAccount"] == "ms-exp-node@my-proj.iam.gserviceaccount.com"
        assert node["workloadMetadataConfig"] == {"mode": "GKE_METADATA"}
    assert not mocks.of_type(NETWORK) and not mocks.of_type(CLUSTER)
    assert not [r for r in mocks.of_type(QUEUED) if "queued_resource_id" in r.inputs]
    assert outputs["node_pools"] == ["ms-exp-s0", "ms-exp-s1"]


def test_a_named_reservation_is_consumed_as_a_specific_reservation(project_root):
    mocks, _ = run_program(gke_config(capacity="reserved", reservation_name="tpu-res"),
                           project_root)
    for pool in mocks.of_type(NODE_POOL):
        assert pool.inputs["nodeConfig"]["reservationAffinity"] == {
            "consumeReservationType": "SPECIFIC_RESERVATION",
            "key": "compute.googleapis.com/reservation-name", "values": ["tpu-res"]}
        assert "spot" not in pool.inputs["nodeConfig"]


def test_flex_start_pools_start_empty_and_scale_to_the_whole_slice_without_a_reservation(
        project_root):
    mocks, _ = run_program(gke_config(capacity="flex-start"), project_root)
    for pool in mocks.of_type(NODE_POOL):
        assert "nodeCount" not in pool.inputs
        pool.expect("autoscaling", {"totalMinNodeCount": 0, "totalMaxNodeCount": 4,
                                    "locationPolicy": "ANY"})
        pool.expect("management", {"autoRepair": False, "autoUpgrade": True})
        pool.expect("placementPolicy", {"type": "COMPACT", "tpuTopology": "4x4"})
        node = pool.inputs["nodeConfig"]
        assert node["flexStart"] is True and "spot" not in node
        assert node["reservationAffinity"] == {"consumeReservationType": "NO_RESERVATION"}


def test_the_workload_identity_binding_ties_the_pods_to_the_trainer_account(project_root):
    mocks, _ = run_program(gke_config(), project_root)
    (ksa,) = mocks.of_type(KSA)
    assert ksa.inputs["metadata"]["annotations"] == {
        "iam.gke.io/gcp-service-account": "ms-exp-tpu@my-proj.iam.gserviceaccount.com"}
    (binding,) = [b for b in mocks.of_type(SA_IAM) if "workload-identity" in b.name]
    binding.expect("role", "roles/iam.workloadIdentityUser")
    binding.expect("member", "serviceAccount:my-proj.svc.id.goog[ms-exp/ms-exp-trainer]")
    binding.expect("serviceAccountId",
                   "projects/my-proj/serviceAccounts/ms-exp-tpu@my-proj.iam.gserviceaccount.com")


def test_the_kubernetes_provider_keeps_no_token_and_mints_one_per_call(project_root):
    mocks, _ = run_program(gke_config(), project_root)
    providers = mocks.of_type(PROVIDER)  # the stack's own objects, and the upserting one
    assert [p.name for p in providers] == ["ms-exp-gke-slices-k8s", "ms-exp-gke-slices-k8s-shared"]
    for provider in providers:
        kubeconfig = json.loads(provider.inputs["kubeconfig"])
        (user,) = kubeconfig["users"]
        assert set(user["user"]) == {"exec"}, "a bearer token in the state expires in an hour"
        # Kueue's CRDs only fit a server-side apply
        assert provider.inputs["enableServerSideApply"] in (True, "true")
    kubeconfig = json.loads(providers[0].inputs["kubeconfig"])
    (user,) = kubeconfig["users"]
    assert set(user["user"]) == {"exec"}, "a bearer token in the state expires in an hour"
    plugin = user["user"]["exec"]
    assert plugin["apiVersion"] == "client.authentication.k8s.io/v1beta1"
    assert [plugin["command"], *plugin["args"]] == [".venv/bin/multislice", "gke-token"]
    assert plugin["interactiveMode"] == "Never"
    assert (PROJECT_ROOT / plugin["command"]).parent.name == "bin"  # the venv Pulumi.yaml names


def test_the_jobset_waits_for_its_pools_controller_and_identity(project_root):
    mocks, _ = run_program(gke_config(gke={"cluster": CLUSTER_NAME, "image": IMAGE,
                                           "install_jobset": True}), project_root)
    opts = mocks.options["ms-exp"]  # the JobSet's logical name
    names = {getattr(d, "_name", None) for d in opts.depends_on}
    assert {"ms-exp-s0", "ms-exp-s1", "ms-exp-trainer", "ms-exp-boot",
            "ms-exp-trainer-workload-identity",
            "ms-exp-gke-slices-jobset-controller"} <= names
    # a new spec, or a new queue label (immutable to Kueue's webhook), is a new JobSet
    assert opts.replace_on_changes == ["spec", "metadata.labels"] and opts.delete_before_replace


def test_create_cluster_builds_a_private_workload_identity_cluster_in_the_stack_vpc(project_root):
    mocks, outputs = run_program(
        gke_config(gke={"create_cluster": True, "image": IMAGE}), project_root)
    cluster = mocks.one(CLUSTER)
    cluster.expect("location", "us-central1")
    cluster.expect("workloadIdentityConfig", {"workloadPool": "my-proj.svc.id.goog"})
    assert cluster.inputs["privateClusterConfig"]["enablePrivateNodes"] is True
    cluster.expect("removeDefaultNodePool", True)
    assert mocks.one(NETWORK).inputs["mtu"] == 8896
    pools = {p.name: p for p in mocks.of_type(NODE_POOL)}
    assert set(pools) == {"ms-exp-cpu", "ms-exp-s0", "ms-exp-s1"}
    assert pools["ms-exp-cpu"].inputs["nodeConfig"]["machineType"] == "e2-standard-4"
    # one controller node, not one per zone of the regional cluster
    assert (pools["ms-exp-cpu"].inputs["nodeCount"],
            pools["ms-exp-cpu"].inputs["nodeLocations"]) == (1, ["us-central1-a"])
    assert outputs["cluster"] == "ms-exp-gke"
    # IAM refuses the Workload Identity member until the project's first such cluster exists
    binding = next(name for name in mocks.options if name.endswith("-workload-identity"))
    waits_for = {getattr(d, "_name", None) for d in mocks.options[binding].depends_on}
    assert {"ms-exp-gke", "ms-exp-cpu"} <= waits_for


@pytest.mark.parametrize("queueing", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["jobset", "jobset and kueue"])  # the second renders for 10 s
def test_a_created_cluster_lets_its_control_plane_reach_the_installed_webhooks(project_root,
                                                                               queueing):
    mocks, _ = run_program(gke_config(gke={"create_cluster": True, "image": IMAGE,
                                           "queueing": queueing}), project_root)
    cluster = mocks.one(CLUSTER)
    control_plane = cluster.inputs["privateClusterConfig"]["masterIpv4CidrBlock"]
    rules = [r for r in mocks.of_type("gcp:compute/firewall:Firewall")
             if r.name.endswith("-webhooks")]
    (rule,) = rules
    manifests = [controllers.JOBSET_MANIFEST, *([controllers.KUEUE_MANIFEST] if queueing else [])]
    expected = control_plane_ports(PROJECT_ROOT / m for m in manifests)
    assert expected == ((8082, 9443) if queueing else (9443,))  # JobSet's and Kueue's webhooks
    assert rule.inputs["allows"] == [{"protocol": "tcp", "ports": [str(p) for p in expected]}]
    assert rule.inputs["sourceRanges"] == [control_plane] and rule.inputs["direction"] == "INGRESS"
    cpu_pool = next(p for p in mocks.of_type(NODE_POOL) if p.name == "ms-exp-cpu")
    assert rule.inputs["targetTags"] == cpu_pool.inputs["nodeConfig"]["tags"] == ["ms-exp-cpu"]


def test_an_existing_cluster_gets_no_webhook_rule_and_a_created_one_no_overlapping_subnet(
        project_root):
    mocks, _ = run_program(gke_config(), project_root)
    assert not [r for r in mocks.of_type("gcp:compute/firewall:Firewall")
                if r.name.endswith("-webhooks")]
    assert problems_of(gke={"create_cluster": True, "image": IMAGE},
                       subnet_cidr="172.16.0.0/12") == [
        "subnet_cidr: '172.16.0.0/12' overlaps 172.16.0.0/28, the control plane range of the "
        "cluster create_cluster makes; use a range outside it, such as the default "
        "10.128.0.0/20"]


def test_control_plane_ports_resolve_named_target_ports_and_name_a_missing_service(tmp_path):
    manifest = tmp_path / "m.yaml"
    manifest.write_text("""
kind: ValidatingWebhookConfiguration
metadata: {name: v}
webhooks: [{name: a, clientConfig: {service: {namespace: ns, name: hooks}}}]
---
kind: Service
metadata: {name: hooks, namespace: ns}
spec: {selector: {app: c}, ports: [{port: 443, targetPort: webhook}]}
---
kind: Deployment
metadata: {name: c, namespace: ns}
spec:
  selector: {matchLabels: {app: c}}
  template:
    metadata: {labels: {app: c}}
    spec: {containers: [{name: m, ports: [{name: webhook, containerPort: 7443}]}]}
""")
    assert control_plane_ports([manifest]) == (7443,)
    manifest.write_text(manifest.read_text().replace("name: hooks, namespace", "name: x, namespace"))
    with pytest.raises(ManifestError, match="Service ns/hooks, which the manifests do not define"):
        control_plane_ports([manifest])


def test_a_queued_jobset_gets_a_flavor_a_cluster_queue_for_its_chips_and_a_local_queue(
        project_root):
    mocks, _ = run_program(gke_config(gke={"cluster": CLUSTER_NAME, "image": IMAGE,
                                           "queueing": True, "install_kueue": True}),
                           project_root)
    kinds = {r.typ.rsplit(":", 1)[-1]: r for r in mocks.resources
             if r.typ.startswith("kubernetes:kueue.x-k8s.io/v1beta2:")}
    assert set(kinds) == {"ResourceFlavor", "ClusterQueue", "LocalQueue"}
    assert kinds["ResourceFlavor"].inputs["spec"]["nodeLabels"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
        "cloud.google.com/gke-tpu-topology": "4x4", "multislice-stack": "exp"}
    (group,) = kinds["ClusterQueue"].inputs["spec"]["resourceGroups"]
    assert group["flavors"] == [{"name": "ms-exp-tpu", "resources": [
        {"name": "google.com/tpu", "nominalQuota": 32}]}]  # 2 slices x 4 nodes x 4 chips
    assert kinds["LocalQueue"].inputs["metadata"]["namespace"] == "ms-exp"
    assert kinds["LocalQueue"].inputs["spec"] == {"clusterQueue": "ms-exp"}
    jobset = mocks.one(JOBSET)
    assert jobset.inputs["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "ms-exp"
    depends = {getattr(d, "_name", None) for d in mocks.options["ms-exp"].depends_on}
    assert {"ms-exp-gke-slices-kueue-controller", "localqueue-ms-exp",
            "clusterqueue-ms-exp", "resourceflavor-ms-exp-tpu"} <= depends


def test_an_existing_cluster_gets_no_controllers_unless_the_stack_asks(project_root):
    # Another team's cluster: its JobSet and Kueue are the admin's, cluster-wide.
    mocks, _ = run_program(gke_config(gke={"cluster": CLUSTER_NAME, "image": IMAGE,
                                           "queueing": True}), project_root)
    assert not mocks.of_type("kubernetes:yaml/v2:ConfigFile")
    assert "kueue.x-k8s.io/queue-name" in mocks.one(JOBSET).inputs["metadata"]["labels"]
    mocks, _ = run_program(gke_config(gke={"cluster": CLUSTER_NAME, "image": IMAGE,
                                           "install_jobset": True}), project_root)
    (controller,) = mocks.of_type("kubernetes:yaml/v2:ConfigFile")
    assert controller.inputs["file"] == "infra/k8s/jobset-v0.12.0.yaml"
    # Relative to the project root, where Pulumi starts the provider: the repository's root.
    assert (Path(__file__).resolve().parents[2] / controller.inputs["file"]).is_file()
    assert mocks.options[controller.name].retain_on_delete is True
    assert "kueue.x-k8s.io/queue-name" not in mocks.one(JOBSET).inputs["metadata"]["labels"]


def test_a_created_cluster_gets_its_controllers_retained_on_destroy(project_root):
    mocks, _ = run_program(gke_config(gke={"create_cluster": True, "image": IMAGE,
                                           "queueing": True}), project_root)
    controllers = mocks.of_type("kubernetes:yaml/v2:ConfigFile")
    # Kept in the repo like JobSet's: nothing is fetched from the network while `pulumi up` runs.
    assert {c.inputs["file"] for c in controllers} == {
        "infra/k8s/jobset-v0.12.0.yaml", "infra/k8s/kueue-v0.19.2.yaml"}
    assert all((Path(__file__).resolve().parents[2] / c.inputs["file"]).is_file()
               for c in controllers)
    assert all(mocks.options[c.name].retain_on_delete is True for c in controllers)
    # nothing else is retained but the bucket (kept by default): the stack's own objects go
    assert {name for name, opts in mocks.options.items() if opts.retain_on_delete} == {
        *(c.name for c in controllers), "my-proj-ms-exp"}
    # (install_jobset: false on a created cluster is refused at preview: nothing would run the
    # JobSet; test_bad_gke_settings_get_one_line_naming_the_key_and_what_is_allowed)


GOOD_IMAGE_TAIL = "@sha256:" + "a" * 64
BAD_GKE_INPUTS = {
    "image with whitespace": ({"gke": {"cluster": CLUSTER_NAME, "image": " " + IMAGE}},
                              "gke.image: ' us-docker", "is not an image reference"),
    "image with a scheme": ({"gke": {"cluster": CLUSTER_NAME, "image": "https://" + IMAGE}},
                            "gke.image: 'https://", "is not an image reference"),
    "image without a name": ({"gke": {"cluster": CLUSTER_NAME, "image": GOOD_IMAGE_TAIL}},
                             "gke.image: '@sha256:", "is not an image reference"),
    "image by tag": ({"gke": {"cluster": CLUSTER_NAME, "image": "python:3.11"}},
                     "gke.image: 'python:3.11'", "is not pinned by digest"),
    "label value": ({"labels": {"team": "-ml-"}}, "labels: team='-ml-'",
                    "Kubernetes label of the GKE nodes"),
    "label key": ({"labels": {"team_": "ml"}}, "labels: team_='ml'",
                  "Kubernetes label of the GKE nodes"),
    "reservation in the TPU API's form": (
        {"capacity": "reserved",
         "reservation_name": "projects/my-proj/locations/us-central1-a/reservations/r"},
        "reservation_name: 'projects/my-proj/locations/us-central1-a/reservations/r'",
        "projects/PROJECT/reservations/NAME"),
    "kube namespace": ({"gke": {"cluster": CLUSTER_NAME, "image": IMAGE,
                                "namespace": "kube-system"}},
                       "gke.namespace: 'kube-system' is reserved", "ms-STACK"),
    "a controller's namespace": ({"gke": {"cluster": CLUSTER_NAME, "image": IMAGE,
                                          "namespace": "kueue-system"}},
                                 "gke.namespace: 'kueue-system' is reserved", "ms-STACK"),
    "cluster name": ({"gke": {"cluster": "projects/my-proj/locations/us-central1/clusters/My_C",
                              "image": IMAGE}},
                     "gke.cluster: name 'My_C' is not a GKE cluster name", "lowercase"),
    "release channel of an existing cluster": (
        {"gke": {"cluster": CLUSTER_NAME, "image": IMAGE, "release_channel": "RAPID"}},
        "gke.release_channel: 'RAPID' has no effect on an existing cluster", "remove it"),
    "the admin's queue and the stack's own": (
        {"gke": {"cluster": CLUSTER_NAME, "image": IMAGE, "local_queue": "team-q",
                 "namespace": "team-a", "queueing": True}},
        "gke.local_queue: 'team-q' joins the cluster admin's queue", "choose one"),
    "the admin's queue without its namespace": (
        {"gke": {"cluster": CLUSTER_NAME, "image": IMAGE, "local_queue": "team-q"}},
        "gke.local_queue: 'team-q' is a LocalQueue of a namespace", "set gke.namespace"),
    "a priority without a queue": (
        {"gke": {"cluster": CLUSTER_NAME, "image": IMAGE, "priority_class": "high"}},
        "gke.priority_class: 'high' is a Kueue WorkloadPriorityClass", "gke.local_queue"),
    "a priority on a created cluster": (
        {"gke": {"create_cluster": True, "image": IMAGE, "queueing": True,
                 "priority_class": "high"}},
        "gke.priority_class: 'high' names a WorkloadPriorityClass", "has none"),
}


@pytest.mark.parametrize("overrides,starts,says", BAD_GKE_INPUTS.values(), ids=BAD_GKE_INPUTS)
def test_bad_gke_input_gets_one_line_naming_the_value(overrides, starts, says):
    (problem,) = problems_of(**overrides)
    assert problem.startswith(starts) and says in problem


@pytest.mark.parametrize("overrides", [
    {"gke": {"cluster": CLUSTER_NAME, "image": "python:3.11" + GOOD_IMAGE_TAIL}},
    {"gke": {"cluster": CLUSTER_NAME}},  # the default image
    {"capacity": "reserved", "reservation_name": "projects/other/reservations/shared-v5e"},
    {"gke": {"create_cluster": True, "image": IMAGE, "release_channel": "RAPID"}},
    {"labels": {"team": "ml_infra"}},
], ids=["docker hub short name", "default image", "shared reservation",
        "release channel of a created cluster", "label"])
def test_good_gke_input_passes(overrides):
    assert problems_of(**overrides) == []


def test_the_reserved_controller_namespaces_are_the_kept_manifests_own():
    import yaml

    from infra.gke.checks import CONTROLLER_NAMESPACES

    kept = sorted(d["metadata"]["name"]
                  for m in (controllers.JOBSET_MANIFEST, controllers.KUEUE_MANIFEST)
                  for d in yaml.safe_load_all((PROJECT_ROOT / m).read_text())
                  if d and d["kind"] == "Namespace")
    assert kept == sorted(CONTROLLER_NAMESPACES)


SA = "gcp:serviceaccount/account:Account"
PROJECT_IAM = "gcp:projects/iAMMember:IAMMember"
AR_IAM = "gcp:artifactregistry/repositoryIamMember:RepositoryIamMember"


@pytest.mark.parametrize("create_cluster", [False, True], ids=["existing", "created"])
def test_nodes_run_as_their_own_minimal_account_apart_from_the_trainers(project_root,
                                                                        create_cluster):
    where = {"create_cluster": True} if create_cluster else {"cluster": CLUSTER_NAME}
    mocks, _ = run_program(gke_config(gke={**where, "image": IMAGE},
                                      deployer="user:me@example.com"), project_root)
    node_account = "ms-exp-node@my-proj.iam.gserviceaccount.com"
    assert {p.name: p.inputs["nodeConfig"]["serviceAccount"]
            for p in mocks.of_type(NODE_POOL)} == dict.fromkeys(
        ["ms-exp-s0", "ms-exp-s1", *(["ms-exp-cpu"] if create_cluster else [])], node_account)
    assert {a.inputs["accountId"] for a in mocks.of_type(SA)} == {"ms-exp-tpu", "ms-exp-node"}
    node_roles = sorted(m.inputs["role"] for m in mocks.of_type(PROJECT_IAM)
                        if m.inputs["member"] == f"serviceAccount:{node_account}")
    assert node_roles == ["roles/container.defaultNodeServiceAccount"]
    (reader,) = mocks.of_type(AR_IAM)  # IMAGE is in Artifact Registry: us-docker.pkg.dev/p/r
    assert (reader.inputs["project"], reader.inputs["location"], reader.inputs["repository"],
            reader.inputs["role"], reader.inputs["member"]) == (
        "p", "us", "r", "roles/artifactregistry.reader", f"serviceAccount:{node_account}")
    act_as = [m for m in mocks.of_type("gcp:serviceaccount/iAMMember:IAMMember")
              if m.inputs["role"] == "roles/iam.serviceAccountUser"
              and "ms-exp-node" in m.inputs["serviceAccountId"]]
    assert [m.inputs["member"] for m in act_as] == ["user:me@example.com"]


def test_a_public_image_needs_no_registry_grant(project_root):
    mocks, _ = run_program(gke_config(gke={"cluster": CLUSTER_NAME}), project_root)
    assert mocks.of_type(AR_IAM) == []
    assert gke_manifest.image_repository(IMAGE) == "projects/p/locations/us/repositories/r"
    assert gke_manifest.image_repository(DEFAULT_GKE_IMAGE) is None


def test_a_stack_joins_the_admins_local_queue_in_their_namespace_without_creating_it(
        project_root):
    mocks, _ = run_program(gke_config(gke={
        "cluster": CLUSTER_NAME, "image": IMAGE, "local_queue": "team-q", "namespace": "team-a",
        "priority_class": "high"}), project_root)
    labels = mocks.one(JOBSET).inputs["metadata"]["labels"]
    assert labels["kueue.x-k8s.io/queue-name"] == "team-q"
    assert labels["kueue.x-k8s.io/priority-class"] == "high"
    # the admin's namespace and queue: nothing of Kueue's is created or installed
    assert not mocks.of_type("kubernetes:core/v1:Namespace")
    assert not [r for r in mocks.resources if r.typ.startswith("kubernetes:kueue.x-k8s.io")]
    assert not mocks.of_type("kubernetes:yaml/v2:ConfigFile")
    assert mocks.one("kubernetes:core/v1:ServiceAccount").inputs["metadata"]["namespace"] == \
        "team-a"


def test_the_kept_kueue_touches_nothing_but_jobsets_and_its_own_objects():
    from infra.gke.kueue_limits import KEPT_WEBHOOKS, dump, frameworks, limit, load, webhook_names

    path = PROJECT_ROOT / controllers.KUEUE_MANIFEST
    docs = load(path)
    assert frameworks(docs) == ["jobset.x-k8s.io/jobset"]
    assert webhook_names(docs) == KEPT_WEBHOOKS
    # the file is exactly what the limiting step writes (infra/k8s/README.md's recipe)
    assert dump(limit(docs)) == path.read_text()
    # and the release's webhooks on other teams' pods and Deployments are gone
    assert not {"mpod.kb.io", "vpod.kb.io", "mdeployment.kb.io", "mjob.kb.io"} & \
        webhook_names(docs)


def test_the_default_namespace_is_used_but_never_declared(project_root):
    # every cluster has it: declaring it would make `pulumi destroy` delete it
    mocks, _ = run_program(gke_config(gke={"cluster": CLUSTER_NAME, "image": IMAGE,
                                           "namespace": "default"}), project_root)
    assert not mocks.of_type("kubernetes:core/v1:Namespace")
    assert mocks.one(JOBSET).inputs["metadata"]["namespace"] == "default"


# ---- least privilege in the pods and on the nodes (issue: no host changes what others run) --


@pytest.mark.parametrize("run_as, added", [
    ("root", []),
    ("trainer", ["CHOWN", "DAC_OVERRIDE", "FOWNER", "SETUID", "SETGID"])])
def test_the_pods_drop_every_capability_but_what_they_need_and_mount_no_token(run_as, added):
    cfg = StackConfig.model_validate({"stack": "exp", **gke_config(
        trainer={"config": "tiny", "steps": 20, "run_as": run_as})})
    pod = gke_manifest.jobset(cfg, SPEC_SHA256)["spec"]["replicatedJobs"][0]["template"][
        "spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    (container,) = pod["containers"]
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"], "add": added},
        "seccompProfile": {"type": "RuntimeDefault"}}
    assert "privileged" not in json.dumps(pod)


def test_a_stacks_own_pools_are_tainted_for_it_alone_and_its_node_cache_is_its_own(project_root):
    mocks, _ = run_program(gke_config(), project_root)
    taint = {"key": "multislice.dev/stack", "value": "ms-exp", "effect": "NO_SCHEDULE"}
    pools = mocks.of_type(NODE_POOL)
    assert pools and all(p.inputs["nodeConfig"]["taints"] == [taint] for p in pools)
    cfg = StackConfig.model_validate({"stack": "exp", **gke_config()})
    pod = gke_manifest.jobset(cfg, SPEC_SHA256)["spec"]["replicatedJobs"][0]["template"][
        "spec"]["template"]["spec"]
    assert {"key": "multislice.dev/stack", "operator": "Equal", "value": "ms-exp",
            "effect": "NoSchedule"} in pod["tolerations"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["node-cache"]["hostPath"]["path"] == \
        "/var/lib/kubelet/multislice/ms-exp/ms-exp/cache"
    assert volumes["node-envs"]["hostPath"]["path"] == \
        "/var/lib/kubelet/multislice/ms-exp/ms-exp/envs"
    other = StackConfig.model_validate({"stack": "exp2", **gke_config()})
    assert gke_manifest.node_cache_path(other) != gke_manifest.node_cache_path(cfg)
    (container,) = pod["containers"]
    (init,) = pod["initContainers"]
    # The init container installs the environment onto the node (read-write there); the
    # trainer's container reads it read-only, and writes only the compile cache and local
    # checkpoints: no trainer changes what a later pod of the stack runs.
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert set(mounts) == {"/etc/multislice/boot", "/dev/shm", gke_manifest.NODE_CACHE_MOUNT,
                           gke_manifest.NODE_ENVS_MOUNT}
    assert mounts[gke_manifest.NODE_ENVS_MOUNT] == {
        "name": "node-envs", "mountPath": gke_manifest.NODE_ENVS_MOUNT, "readOnly": True}
    assert not mounts[gke_manifest.NODE_CACHE_MOUNT].get("readOnly")
    assert [m["name"] for m in init["volumeMounts"]] == ["boot", "node-envs"]
    assert not init["volumeMounts"][1].get("readOnly")
    assert {"name": "MULTISLICE_POD_STAGE", "value": "environment"} in init["env"]
    assert init["command"] == container["command"] and "resources" not in init
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": []}
    for path in (gke_manifest.NODE_CACHE_MOUNT, gke_manifest.NODE_ENVS_MOUNT):
        assert not path.startswith("/opt/multislice")  # the pod's own, where it installs


def test_a_workload_stack_keeps_nothing_on_the_admins_shared_nodes():
    from tests.infra.test_gke_kinds import workload_config

    cfg = StackConfig.model_validate({"stack": "exp", **workload_config()})
    pod = gke_manifest.jobset(cfg, SPEC_SHA256)["spec"]["replicatedJobs"][0]["template"][
        "spec"]["template"]["spec"]
    assert not [v for v in pod["volumes"] if "hostPath" in v]
    assert all(t["key"] != "multislice.dev/stack" for t in pod["tolerations"])
    assert gke_manifest.NODE_CACHE_MOUNT not in json.dumps(pod)
    assert "MULTISLICE_NODE" not in json.dumps(pod) and "initContainers" not in pod
    assert "taints" not in gke_capacity.node_pool(cfg, 0)["node_config"]


def test_a_jobset_is_removed_after_its_ttl_and_its_pods_carry_the_cost_labels_and_its_uid():
    from tests.infra.test_gke_kinds import workload_config

    cfg = StackConfig.model_validate({"stack": "exp", **workload_config(), "run_name": "lr3"})
    jobset = gke_manifest.jobset(cfg, SPEC_SHA256)
    assert jobset["spec"]["ttlSecondsAfterFinished"] == 12 * 3600  # xpk's default
    template = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    # GKE cost allocation reports by the pods' namespace and labels
    assert template["metadata"]["labels"] == {
        "multislice-stack": "exp", "multislice-team": cfg.gke.namespace,
        "multislice-experiment": "exp-lr3"}
    (container,) = template["spec"]["containers"]
    assert {"name": "MULTISLICE_JOBSET_UID", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.labels['jobset.sigs.k8s.io/jobset-uid']"}}} in container["env"]
    short = StackConfig.model_validate({"stack": "exp", **workload_config(
        ttl_after_finished_s=0)})
    assert gke_manifest.jobset(short, SPEC_SHA256)["spec"]["ttlSecondsAfterFinished"] == 0
    with pytest.raises(ValueError, match="ttl_after_finished_s"):
        StackConfig.model_validate({"stack": "exp", **workload_config(
            ttl_after_finished_s=-1)})


# ---- Pod Security Standards: what a namespace's admission controller lets the pods be ----


def _pod(cfg_raw: dict) -> dict:
    cfg = StackConfig.model_validate({"stack": "exp", **cfg_raw})
    return gke_manifest.jobset(cfg, SPEC_SHA256)["spec"]["replicatedJobs"][0]["template"][
        "spec"]["template"]["spec"]


@pytest.mark.parametrize("run_as", ["root", "trainer"])
def test_a_workload_stacks_pods_fit_pod_security_baseline_on_the_admins_shared_pools(run_as):
    from tests.infra.test_gke_kinds import workload_config
    from tests.support.pod_security import admitted

    raw = workload_config()
    raw["trainer"]["run_as"] = run_as
    pod = _pod(raw)
    assert admitted(pod, "baseline") == []
    # not restricted: the start-up script runs as root (it installs the environment)
    assert "container trainer runAsNonRoot not true" in admitted(pod, "restricted")
    cfg = StackConfig.model_validate({"stack": "exp", **raw})
    assert gke_manifest.pod_security_level(cfg) == "baseline"


def test_a_stack_of_its_own_pools_needs_privileged_only_for_its_node_cache():
    from tests.support.pod_security import admitted

    pod = _pod(gke_config())
    assert admitted(pod, "baseline") == ["hostPath volume node-cache", "hostPath volume node-envs"]
    cfg = StackConfig.model_validate({"stack": "exp", **gke_config()})
    assert gke_manifest.pod_security_level(cfg) == "privileged"
    assert gke_manifest.namespace_labels(cfg) == {
        "pod-security.kubernetes.io/enforce": "privileged"}


def test_the_pod_security_oracle_refuses_what_baseline_refuses():
    from tests.support.pod_security import admitted

    ok = {"containers": [{"name": "c", "securityContext": {
        "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]}}}]}
    assert admitted(ok, "baseline") == []
    for bad, why in [
            ({"hostPID": True}, "hostPID: true"),
            ({"hostNetwork": True}, "hostNetwork: true"),
            ({"volumes": [{"name": "h", "hostPath": {"path": "/"}}]}, "hostPath volume h"),
            ({"containers": [{"name": "c", "securityContext": {"privileged": True}}]},
             "container c privileged"),
            ({"containers": [{"name": "c", "securityContext": {
                "capabilities": {"add": ["IPC_LOCK"]}}}]},
             "container c adds capabilities ['IPC_LOCK']"),
            ({"containers": [{"name": "c", "ports": [{"containerPort": 1, "hostPort": 1}]}]},
             "container c uses a hostPort")]:
        assert why in admitted({**ok, **bad}, "baseline"), bad
        assert admitted({**ok, **bad}, "privileged") == []
