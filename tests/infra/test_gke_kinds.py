"""GKE stacks by what they own: a workload stack on a platform team's capacity, a capacity stack,
and the stack that owns both. The program under Pulumi's mock runtime, and the stack checks."""

from __future__ import annotations

import pytest

from infra.gke.controllers import retain_on_delete_everywhere
from infra.stack_config.schema import StackConfig
from infra.stack_config.validation import stack_problems
from tests.infra.conftest import base_config
from tests.infra.pulumi_mocks import DYNAMIC, AlreadyExists, RecordingMocks, run_program

IMAGE = "us-docker.pkg.dev/p/r/boot:1@sha256:" + "a" * 64
PLATFORM_CLUSTER = "projects/platform-proj/locations/us-central1/clusters/shared"
NODE_POOL = "gcp:container/nodePool:NodePool"
CLUSTER = "gcp:container/cluster:Cluster"
JOBSET = "kubernetes:jobset.x-k8s.io/v1alpha2:JobSet"
# Kubernetes objects with no namespace (pulumi-kubernetes types), and the ConfigFiles that hold
# the controllers' cluster-wide objects.
CLUSTER_SCOPED = ("kubernetes:core/v1:Namespace", "kubernetes:yaml/v2:ConfigFile",
                  "kubernetes:kueue.x-k8s.io/v1beta2:ClusterQueue",
                  "kubernetes:kueue.x-k8s.io/v1beta2:ResourceFlavor")


def workload_config(**gke):
    return base_config(
        region="us-central1", zone="us-central1-a", accelerator_type="v5litepod-16", slices=2,
        orchestration="gke",
        gke={"kind": "workload", "cluster": PLATFORM_CLUSTER, "image": IMAGE,
             "namespace": "team-a", "local_queue": "tpu", **gke},
        trainer={"config": "tiny", "steps": 20, "mesh": {"ici_fsdp": 16},
                 "overrides": {"train.global_batch_size": 32}})


def capacity_config(**gke):
    cfg = base_config(
        region="us-central1", zone="us-central1-a", accelerator_type="v5litepod-16", slices=4,
        capacity="spot", orchestration="gke",
        gke={"kind": "capacity", "create_cluster": True,
             "team_namespaces": ["team-a", "team-b"],
             "priority_classes": {"high": 1000, "low": 100},
             "authorized_networks": ["203.0.113.0/24"], **gke})
    del cfg["experiment_dir"], cfg["trainer"]
    return cfg


def problems_of(cfg: dict) -> list[str]:
    return stack_problems(StackConfig.model_validate({"stack": "exp", **cfg}))[0]


def test_a_workload_stack_creates_only_what_the_experiment_owns(project_root):
    mocks, outputs = run_program(workload_config(), project_root)
    assert not mocks.of_type(NODE_POOL) and not mocks.of_type(CLUSTER)
    assert not [r for r in mocks.resources if r.typ in CLUSTER_SCOPED], \
        [r.typ for r in mocks.resources if r.typ in CLUSTER_SCOPED]
    assert not [r for r in mocks.resources if r.typ.startswith("gcp:compute/")]
    # no grant at all in the cluster's project, and no project-level grant anywhere
    assert not mocks.of_type("gcp:projects/iAMMember:IAMMember")
    assert all(r.inputs.get("project") != "platform-proj" for r in mocks.resources
               if r.typ.startswith("gcp:"))
    jobset = mocks.one(JOBSET)
    assert jobset.inputs["metadata"]["namespace"] == "team-a"
    assert jobset.inputs["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "tpu"
    pod = jobset.inputs["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    # the admin's pools: the slice shape, not this stack's label (Kueue's flavor adds theirs)
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
                                   "cloud.google.com/gke-tpu-topology": "4x4"}
    # Workload Identity across projects: the pool is the cluster's project's
    (binding,) = [b for b in mocks.of_type("gcp:serviceaccount/iAMMember:IAMMember")
                  if "workload-identity" in b.name]
    binding.expect("member", "serviceAccount:platform-proj.svc.id.goog[team-a/ms-exp-trainer]")
    # its own project enables what it uses: no container, compute or TPU API
    apis = {s.inputs["service"] for s in mocks.of_type("gcp:projects/service:Service")}
    assert apis == {"iam.googleapis.com", "cloudresourcemanager.googleapis.com",
                    "storage.googleapis.com"}
    assert "the admin's" in outputs["billing"] and "node_pools" not in outputs


def test_a_capacity_stack_is_pools_controllers_and_a_queue_no_experiment(project_root):
    mocks, outputs = run_program(capacity_config(), project_root)
    tpu_pools = [p for p in mocks.of_type(NODE_POOL) if p.name != "ms-exp-cpu"]
    assert len(tpu_pools) == 4
    for pool in tpu_pools:  # scale to zero between runs: a capacity default
        assert "nodeCount" not in pool.inputs
        pool.expect("autoscaling", {"totalMinNodeCount": 0, "totalMaxNodeCount": 4,
                                    "locationPolicy": "ANY"})
        assert pool.inputs["nodeConfig"]["spot"] is True
    assert not mocks.of_type(JOBSET) and not mocks.of_type("gcp:storage/bucket:Bucket")
    assert not [r for r in mocks.resources if "trainer" in r.name or r.name.endswith("-tpu")
                and r.typ == "gcp:serviceaccount/account:Account"]
    kueue = {(r.typ.rsplit(":", 1)[1], r.name): r for r in mocks.resources
             if r.typ.startswith("kubernetes:kueue.x-k8s.io")}
    queue = kueue[("ClusterQueue", "clusterqueue-ms-exp")].inputs["spec"]
    # the quota is every pool's chips: 4 slices x 16
    assert queue["resourceGroups"][0]["flavors"][0]["resources"] == [
        {"name": "google.com/tpu", "nominalQuota": 64}]
    assert queue["preemption"] == {"withinClusterQueue": "LowerPriority"}
    assert queue["namespaceSelector"]["matchExpressions"][0]["values"] == ["team-a", "team-b"]
    assert {("LocalQueue", "localqueue-team-a-tpu"), ("LocalQueue", "localqueue-team-b-tpu")} \
        <= set(kueue)
    priorities = [o for g in mocks.of_type("kubernetes:yaml/v2:ConfigGroup")
                  for o in g.inputs["objs"]]
    assert {(o["kind"], o["metadata"]["name"], o["value"]) for o in priorities} == {
        ("WorkloadPriorityClass", "high", 1000), ("WorkloadPriorityClass", "low", 100)}
    namespaces = {n.inputs["metadata"]["name"]: n.inputs["metadata"]["labels"]
                  for n in mocks.of_type("kubernetes:core/v1:Namespace")}
    assert set(namespaces) == {"team-a", "team-b"}
    assert all(labels["pod-security.kubernetes.io/enforce"] == "baseline"
               for labels in namespaces.values())
    policies = {p.inputs["metadata"]["namespace"]: p.inputs["spec"]["policyTypes"]
                for p in mocks.of_type("kubernetes:networking.k8s.io/v1:NetworkPolicy")}
    assert policies == {"team-a": ["Ingress", "Egress"], "team-b": ["Ingress", "Egress"]}
    assert mocks.one(CLUSTER).inputs["datapathProvider"] == "ADVANCED_DATAPATH"  # enforced
    controllers = {c.inputs["file"] for c in mocks.of_type("kubernetes:yaml/v2:ConfigFile")}
    assert controllers == {"infra/k8s/jobset-v0.12.0.yaml", "infra/k8s/kueue-v0.19.2.yaml"}
    # secure defaults of the cluster it creates
    cluster = mocks.one(CLUSTER)
    assert cluster.inputs["deletionProtection"] is True
    assert cluster.inputs["masterAuthorizedNetworksConfig"]["cidrBlocks"][0]["cidrBlock"] == \
        "203.0.113.0/24"
    (exclusion,) = cluster.inputs["maintenancePolicy"]["maintenanceExclusions"]
    assert exclusion["exclusionOptions"] == {"scope": "NO_MINOR_OR_NODE_UPGRADES",
                                             "endTimeBehavior": "UNTIL_END_OF_SUPPORT"}
    assert outputs["local_queues"] == ["team-a/tpu", "team-b/tpu"]
    assert outputs["control_plane"] == "reachable only from 203.0.113.0/24 " \
        "(gke.authorized_networks)"
    assert "scale to zero" in outputs["billing"]


def test_the_controllers_are_upserted_and_every_object_of_them_retained(project_root):
    mocks, _ = run_program(capacity_config(), project_root)
    providers = {p.name: p.inputs for p in mocks.of_type("pulumi:providers:kubernetes")}
    assert providers["ms-exp-gke-capacity-k8s-shared"]["upsertExistingObjects"] in (True, "true")
    assert "upsertExistingObjects" not in providers["ms-exp-gke-capacity-k8s"]
    for controller in mocks.of_type("kubernetes:yaml/v2:ConfigFile"):
        opts = mocks.options[controller.name]
        assert opts.retain_on_delete is True
        assert retain_on_delete_everywhere in (opts.transforms or [])
        assert getattr(opts.provider, "_name", "") == "ms-exp-gke-capacity-k8s-shared"
    # the transform itself: any child, whatever its own options said
    import pulumi

    child = pulumi.ResourceTransformArgs(
        custom=True, type_="kubernetes:apiextensions.k8s.io/v1:CustomResourceDefinition",
        name="jobsets", props={}, opts=pulumi.ResourceOptions(retain_on_delete=False))
    assert retain_on_delete_everywhere(child).opts.retain_on_delete is True


def test_a_stack_of_kind_all_leaves_pools_billed_and_says_so(project_root):
    cfg = base_config(region="us-central1", zone="us-central1-a", accelerator_type="v5litepod-16",
                      orchestration="gke",
                      gke={"cluster": "projects/my-proj/locations/us-central1/clusters/c",
                           "image": IMAGE},
                      trainer={"config": "tiny", "steps": 20, "mesh": {"ici_fsdp": 16},
                               "overrides": {"train.global_batch_size": 32}})
    _, outputs = run_program(cfg, project_root)
    assert "stay up and billed" in outputs["billing"] and "scale_to_zero" in outputs["billing"]
    cfg["gke"]["scale_to_zero"] = True
    mocks, outputs = run_program(cfg, project_root)
    assert "scale to zero" in outputs["billing"]
    assert all("autoscaling" in p.inputs for p in mocks.of_type(NODE_POOL))


@pytest.mark.parametrize("cfg, says", [
    (workload_config(create_cluster=True), "gke.create_cluster: does not apply to gke.kind "
                                           "'workload'"),
    (workload_config(queueing=True), "gke.queueing: does not apply to gke.kind 'workload'"),
    (workload_config(install_jobset=True), "gke.install_jobset: does not apply"),
    ({**workload_config(), "capacity": "spot"}, "capacity: does not apply to gke.kind "
                                                "'workload'"),
    (workload_config(namespace=None), "gke.namespace: required with gke.kind 'workload'"),
    (capacity_config(team_namespaces=[]), "gke.team_namespaces: a capacity stack needs"),
    (capacity_config(team_namespaces=["kube-system"]), "gke.team_namespaces: 'kube-system' is "
                                                      "not a namespace"),
    (capacity_config(priority_classes={"High": 1}), "gke.priority_classes: High=1 is not"),
    (capacity_config(authorized_networks=["10.0.0.0/33"]), "gke.authorized_networks: "
                                                          "'10.0.0.0/33' is not a CIDR"),
    ({**capacity_config(), "experiment_dir": "experiments/x"}, "experiment_dir: does not apply "
                                                               "to gke.kind 'capacity'"),
    (capacity_config(image=IMAGE), "gke.image: does not apply to gke.kind 'capacity'"),
    ({**capacity_config(scale_to_zero=False), "capacity": "flex-start"},
     "gke.scale_to_zero: false with capacity 'flex-start'"),
    ({k: v for k, v in workload_config().items() if k != "experiment_dir"},
     "experiment_dir: required but not set"),
    (base_config(region="us-central1", zone="us-central1-a", accelerator_type="v5litepod-16",
                 orchestration="gke", gke={"cluster": PLATFORM_CLUSTER, "image": IMAGE},
                 trainer={"config": "tiny", "mesh": {"ici_fsdp": 16}}),
     "a stack of gke.kind 'workload' runs on a cluster of any project"),
    (base_config(region="us-central1", zone="us-central1-a", accelerator_type="v5litepod-16",
                 orchestration="gke", gke={"cluster": PLATFORM_CLUSTER.replace(
                     "platform-proj", "my-proj"), "image": IMAGE, "team_namespaces": ["a"]},
                 trainer={"config": "tiny", "mesh": {"ici_fsdp": 16}}),
     "gke.team_namespaces: a key of gke.kind 'capacity'"),
], ids=["workload create_cluster", "workload queueing", "workload install", "workload capacity",
        "workload no namespace", "capacity no teams", "capacity reserved namespace",
        "capacity bad priority", "bad cidr", "capacity experiment", "capacity image",
        "flex-start fixed size",
        "no experiment_dir", "other project", "teams on all"])
def test_each_kind_refuses_what_it_does_not_own_in_one_line(cfg, says):
    cfg = {k: v for k, v in cfg.items()}
    if "gke" in cfg:
        cfg["gke"] = {k: v for k, v in cfg["gke"].items() if v is not None}
    problems = problems_of(cfg)
    assert any(says in p for p in problems), problems


def test_good_stacks_of_each_kind_pass():
    assert problems_of(workload_config()) == []
    assert problems_of(capacity_config()) == []


def test_a_named_namespace_of_a_stack_of_kind_all_is_its_own_and_outlives_a_destroy(
        project_root):
    cfg = base_config(region="us-central1", zone="us-central1-a", accelerator_type="v5litepod-16",
                      orchestration="gke",
                      gke={"cluster": "projects/my-proj/locations/us-central1/clusters/c",
                           "image": IMAGE, "namespace": "team-a"},
                      trainer={"config": "tiny", "steps": 20, "mesh": {"ici_fsdp": 16},
                               "overrides": {"train.global_batch_size": 32}})
    mocks, _ = run_program(cfg, project_root)
    (namespace,) = mocks.of_type("kubernetes:core/v1:Namespace")
    assert namespace.inputs["metadata"]["labels"]["multislice-stack"] == "exp"
    assert mocks.options[namespace.name].retain_on_delete is True
    [check] = [r for r in mocks.of_type("pulumi-python:dynamic:Resource")
               if r.name.endswith("-cluster-check")]
    # absent, or this stack's (of this project)
    assert check.inputs["objects"][0]["owned_by"] == {"multislice-stack": "exp",
                                                      "multislice-project": "my-proj"}
    del cfg["gke"]["namespace"]
    mocks, _ = run_program(cfg, project_root)
    (namespace,) = mocks.of_type("kubernetes:core/v1:Namespace")
    assert not mocks.options[namespace.name].retain_on_delete  # ms-exp goes with the stack


# ---- the team namespaces' NetworkPolicy, by Kubernetes' own semantics (tests/support) ----


def _team_pod(team: str, ip: str, **labels: str):
    from tests.support.network_policy import Endpoint

    return Endpoint(ip, team, {"jobset.sigs.k8s.io/jobset-name": f"ms-{team}", **labels},
                    {"kubernetes.io/metadata.name": team})


def test_a_team_namespace_talks_to_itself_dns_the_metadata_server_and_google_apis_only():
    from infra.gke.capacity import capacity_objects
    from tests.support.network_policy import Endpoint, allowed

    cfg = StackConfig.model_validate({"stack": "plat", **capacity_config()})
    policies = [o for o in capacity_objects(cfg) if o["kind"] == "NetworkPolicy"]
    assert {p["metadata"]["namespace"] for p in policies} == {"team-a", "team-b"}
    a0, a1 = _team_pod("team-a", "10.8.0.5"), _team_pod("team-a", "10.8.1.7")
    b0 = _team_pod("team-b", "10.8.2.9")
    dns = Endpoint("10.8.3.3", "kube-system", {"k8s-app": "kube-dns"},
                   {"kubernetes.io/metadata.name": "kube-system"})
    # the JobSet's own pods: the coordinator, megascale, gloo, whatever port a JAX release uses
    for port in (8476, 8482, 8471, 8080, 34567):
        assert allowed(policies, a0, a1, "TCP", port), port
    assert allowed(policies, a0, dns, "UDP", 53) and allowed(policies, a0, dns, "TCP", 53)
    assert not allowed(policies, a0, dns, "TCP", 8080)
    for address, port in (("169.254.169.254", 80), ("169.254.169.254", 8080),
                          ("169.254.169.252", 988), ("169.254.169.252", 987)):
        assert allowed(policies, a0, Endpoint(address), "TCP", port), (address, port)
    assert allowed(policies, a0, Endpoint("142.250.64.91"), "TCP", 443)  # a Google API
    assert allowed(policies, a0, Endpoint("199.36.153.9"), "TCP", 443)  # private.googleapis
    # nothing else: no other team, no node, no private address, no other port
    for port in (8476, 8080, 443):
        assert not allowed(policies, a0, b0, "TCP", port)
        assert not allowed(policies, b0, a0, "TCP", port)
    assert not allowed(policies, a0, Endpoint("10.128.0.4"), "TCP", 10250)  # a node's kubelet
    assert not allowed(policies, a0, Endpoint("10.128.0.4"), "TCP", 443)
    assert not allowed(policies, a0, Endpoint("169.254.169.254"), "TCP", 22)
    assert not allowed(policies, a0, Endpoint("142.250.64.91"), "TCP", 80)
    # and it is a valid NetworkPolicy of the Kubernetes API
    import kubernetes_validate

    for policy in policies:
        kubernetes_validate.validate(policy, "1.30", strict=True)


def test_the_network_policy_oracle_refuses_by_default_only_what_a_policy_isolates():
    from tests.support.network_policy import allowed

    a, b = _team_pod("team-a", "10.8.0.5"), _team_pod("team-b", "10.8.2.9")
    assert allowed([], a, b, "TCP", 80)  # no policy: nothing is isolated
    deny_ingress = {"metadata": {"namespace": "team-b"},
                    "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}}
    assert not allowed([deny_ingress], a, b, "TCP", 80)
    assert allowed([deny_ingress], b, a, "TCP", 80)  # b's egress is not isolated
    allow_a = {"metadata": {"namespace": "team-b"}, "spec": {
        "podSelector": {}, "policyTypes": ["Ingress"], "ingress": [{"from": [{
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "team-a"}}}],
            "ports": [{"protocol": "TCP", "port": 8000, "endPort": 8100}]}]}}
    assert allowed([deny_ingress, allow_a], a, b, "TCP", 8080)  # rules add up
    assert not allowed([deny_ingress, allow_a], a, b, "TCP", 9000)


# ---- namespaces the platform owns (issue: a capacity stack never creates or deletes one) ----


def test_a_capacity_stack_on_an_existing_cluster_declares_no_namespace_and_checks_each(
        project_root):
    cfg = capacity_config(create_cluster=False,
                          cluster="projects/my-proj/locations/us-central1/clusters/shared")
    del cfg["gke"]["authorized_networks"]
    # the team namespaces exist (the normal case): the program must not create them again
    existing = {("Namespace", None, "team-a"), ("Namespace", None, "team-b")}
    mocks, _ = run_program(cfg, project_root, stack="plat", cluster_objects=existing)
    assert not mocks.of_type("kubernetes:core/v1:Namespace")
    assert {p.inputs["metadata"]["namespace"]
            for p in mocks.of_type("kubernetes:networking.k8s.io/v1:NetworkPolicy")} == \
        {"team-a", "team-b"}
    check = [r for r in mocks.of_type(DYNAMIC) if "need_pools" in r.inputs][0]
    teams = {o["what"]: o for o in check.inputs["objects"] if o.get("team")}
    assert set(teams) == {"namespace team-a", "namespace team-b"}
    assert "kubectl create namespace team-a" in teams["namespace team-a"]["fix"]


def test_a_created_clusters_team_namespaces_are_retained_on_destroy(project_root):
    mocks, _ = run_program(capacity_config(), project_root, stack="plat")
    namespaces = mocks.of_type("kubernetes:core/v1:Namespace")
    assert {n.name for n in namespaces} == {"team-a", "team-b"}
    assert all(mocks.options[n.name].retain_on_delete for n in namespaces)


def test_a_kind_all_stack_takes_back_its_own_namespace_after_destroy_then_up(project_root):
    from tests.infra.test_gke import CLUSTER_NAME, IMAGE, gke_config

    named = gke_config(gke={"cluster": CLUSTER_NAME, "image": IMAGE, "namespace": "ml"})
    # destroy retained "ml" (labelled as this stack's: preview lets it through); up again
    mocks, _ = run_program(named, project_root, cluster_objects={("Namespace", None, "ml")})
    (ns,) = mocks.of_type("kubernetes:core/v1:Namespace")
    assert mocks.options[ns.name].retain_on_delete
    # and the stack's other objects still refuse to take over one that exists
    with pytest.raises(AlreadyExists, match='configmaps "ms-exp-boot" already exists'):
        run_program(named, project_root, cluster_objects={
            ("Namespace", None, "ml"), ("ConfigMap", "ml", "ms-exp-boot")})


def test_the_stand_in_refuses_a_client_side_create_of_an_existing_object_as_the_api_does():
    import pulumi

    mocks = RecordingMocks({("Namespace", None, "team-a")})
    for name, inputs in (("own", {}), ("shared", {"upsertExistingObjects": "true"})):
        mocks.new_resource(pulumi.runtime.MockResourceArgs(
            typ="pulumi:providers:kubernetes", name=name, inputs=inputs))
    args = {"typ": "kubernetes:core/v1:Namespace", "name": "team-a",
            "inputs": {"metadata": {"name": "team-a"}}}
    with pytest.raises(AlreadyExists, match='namespaces "team-a" already exists'):
        mocks.new_resource(pulumi.runtime.MockResourceArgs(**args, provider="urn:p::own_id"))
    mocks.new_resource(pulumi.runtime.MockResourceArgs(**args, provider="urn:p::shared_id"))
    mocks.new_resource(pulumi.runtime.MockResourceArgs(  # not there yet: created
        **{**args, "name": "team-b", "inputs": {"metadata": {"name": "team-b"}}},
        provider="urn:p::own_id"))


def test_every_node_pool_of_a_created_cluster_boots_with_secure_boot(project_root):
    mocks, _ = run_program(capacity_config(), project_root, stack="plat")
    pools = mocks.of_type("gcp:container/nodePool:NodePool")
    assert len(pools) == 5  # four TPU slices and the controllers' CPU pool
    for pool in pools:
        assert pool.inputs["nodeConfig"]["shieldedInstanceConfig"] == {
            "enableSecureBoot": True, "enableIntegrityMonitoring": True}, pool.name


def test_two_capacity_stacks_serving_one_team_declare_policies_of_their_own_names():
    from infra.gke.capacity import capacity_objects

    names = set()
    for stack in ("plat1", "plat2"):
        cfg = StackConfig.model_validate({"stack": stack, **capacity_config()})
        names |= {(o["metadata"]["namespace"], o["metadata"]["name"])
                  for o in capacity_objects(cfg) if o["kind"] == "NetworkPolicy"}
    assert len(names) == 4  # team-a and team-b, once per stack: no AlreadyExists between them


def _shaped(**gke):
    cfg = capacity_config(**gke)
    for key in ("accelerator_type", "slices", "capacity"):
        cfg.pop(key)
    return cfg


@pytest.mark.parametrize("gke, words", [
    ({"shapes": {"V5E": {"accelerator_type": "v5litepod-16"}},
      "teams": {"team-a": {"quota": {"V5E": 16}}}, "team_namespaces": []},
     "gke.shapes: 'V5E' is not a shape name"),
    ({"shapes": {"v5e": {"accelerator_type": "v5litepod-16"}},
      "teams": {"team-a": {"quota": {"v5e": 8}}}, "team_namespaces": []},
     "gke.teams: the teams' quotas of shape 'v5e' add up to 8 chips, and its pools have 16"),
    ({"shapes": {"v5e": {"accelerator_type": "v5litepod-16"}},
      "teams": {"team-a": {"quota": {"v6e": 16}}}, "team_namespaces": []},
     "gke.teams.team-a.quota: shape 'v6e' is not one of this stack's (v5e)"),
    ({"shapes": {"v5e": {"accelerator_type": "v5litepod-16"}},
      "teams": {"team-a": {"quota": {"v5e": 16}, "lending_limit": {"v5e": 20}}},
      "team_namespaces": []},
     "gke.teams.team-a.lending_limit.v5e: 20 chips is more than its quota of 16"),
    ({"shapes": {"v5e": {"accelerator_type": "v5litepod-16"},
                 "odd": {"accelerator_type": "v5litepod-4"}},
      "teams": {"team-a": {"quota": {"v5e": 16, "odd": 4}}}, "team_namespaces": []},
     "gke.shapes.odd: "),
    ({"teams": {"team-a": {"quota": {"tpu": 64}}}},
     "gke.team_namespaces: give the teams once"),
])
def test_bad_shapes_and_teams_are_one_line_each_naming_the_key_and_value(gke, words):
    raw = _shaped(**gke) if "shapes" in gke else capacity_config(**gke)
    problems = problems_of(raw)
    assert any(words in p and "\n" not in p for p in problems), problems


def test_a_shape_key_of_the_stack_that_differs_from_the_first_shape_is_refused():
    raw = capacity_config(shapes={"v5e": {"accelerator_type": "v5litepod-16", "slices": 2}},
                          teams={"team-a": {"quota": {"v5e": 32}}}, team_namespaces=[])
    raw["accelerator_type"] = "v4-16"
    assert any(p.startswith("accelerator_type: 'v4-16' is set, but a capacity stack with "
                            "gke.shapes gives it per shape") for p in problems_of(raw))
