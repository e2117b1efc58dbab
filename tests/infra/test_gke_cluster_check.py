"""An existing cluster is checked before the stack creates anything: what the GKE API says of it
(pure), and the CRDs its API server serves (the real REST protocol against kmock's in-memory
Kubernetes API server over loopback, as `multislice status` is tested)."""

from __future__ import annotations

import os
from pathlib import Path

import kmock
import pytest
import yaml

from infra.gke.cluster_check import (
    JOBSET_CRDS,
    KUEUE_CRDS,
    ClusterCheckProvider,
    description_problems,
    gke_version,
    min_version,
)
from infra.stack_config.schema import StackConfig
from infra.stack_config.validation import stack_problems
from tests.infra.pulumi_mocks import run_program
from tests.infra.test_gke import CLUSTER_NAME, IMAGE, gke_config
from tests.scripts.test_gke_status import KubeApi

CRDS = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
NAMESPACES = kmock.resource("", "v1", "namespaces")
PINNED_CRDS = Path(__file__).resolve().parent / "crds"


def released_jobset_crd() -> dict:
    """JobSet v0.12.0's CRD as its release ships it (tests/infra/crds)."""
    return yaml.safe_load((PINNED_CRDS / "jobset.x-k8s.io_jobsets.yaml").read_text())


def jobset_crd_before_v0_10() -> dict:
    """The same CRD without the failure rules' message patterns (JobSet v0.6-v0.9 had none)."""
    crd = released_jobset_crd()
    for version in crd["spec"]["versions"]:
        spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        del spec["failurePolicy"]["properties"]["rules"]["items"]["properties"][
            "onJobFailureMessagePatterns"]
    return crd
NODE_POOL = "gcp:container/nodePool:NodePool"
LOCAL_QUEUES = kmock.resource("kueue.x-k8s.io", "v1beta1", "localqueues")


def props(**changes) -> dict:
    return {"cluster": CLUSTER_NAME, "project": "my-proj", "autopilot": False,
            "workload_pool": "my-proj.svc.id.goog", "master_version": "1.33.5-gke.1162000",
            "min_version": min_version("spot", "v5litepod"), "why_version": "multislice, v5litepod",
            "endpoint": "cluster-endpoint.invalid", "ca_certificate": "", "crds": [],
            **changes}


def test_a_capacity_cluster_that_enforces_network_policy_passes():
    assert description_problems(props(needs_network_policy=True,
                                      network_policy_enforced=True)) == []


def test_network_policy_enforcement_is_read_from_dataplane_v2_or_calico():
    from types import SimpleNamespace

    from infra.gke.cluster_check import network_policy_enforced

    assert network_policy_enforced(SimpleNamespace(datapath_provider="ADVANCED_DATAPATH"))
    assert network_policy_enforced(SimpleNamespace(
        datapath_provider="LEGACY_DATAPATH", network_policies=[SimpleNamespace(enabled=True)]))
    assert not network_policy_enforced(SimpleNamespace(
        datapath_provider="LEGACY_DATAPATH", network_policies=[SimpleNamespace(enabled=False)]))


def test_gke_versions_order_by_patch_and_gke_build():
    assert gke_version("1.33.0-gke.1712000") > gke_version("1.33.0-gke.900")
    assert gke_version("1.33.5-gke.1162000") > gke_version("1.33.0-gke.1712000")
    assert gke_version("1.27.4-gke.900") < gke_version("1.28.0-gke.1")
    assert gke_version("") is None and gke_version("latest") is None


def test_the_oldest_version_is_the_newest_that_any_part_of_the_stack_needs():
    # multislice on Standard from 1.27.4-gke.900; TPUs without privileged mode from 1.28
    assert min_version("spot", "v5litepod") == "1.28.0"
    assert min_version("flex-start", "v5litepod") == "1.33.0-gke.1712000"
    assert min_version("on-demand", "v6e") == "1.31.2-gke.1115000"


def test_a_standard_workload_identity_cluster_of_a_recent_version_passes():
    assert description_problems(props()) == []


@pytest.mark.parametrize(("changes", "field", "words"), [
    ({"autopilot": True}, "autopilot", "is an Autopilot cluster"),
    ({"needs_network_policy": True, "network_policy_enforced": False}, "network_policy",
     "does not enforce NetworkPolicy"),
    ({"workload_pool": ""}, "workload_pool", "has Workload Identity off"),
    ({"workload_pool": "other.svc.id.goog"}, "workload_pool", "pool 'other.svc.id.goog'"),
    ({"master_version": "1.30.1-gke.100", "min_version": min_version("flex-start", "v5litepod"),
      "why_version": "multislice, v5litepod, flex-start"}, "master_version",
     "runs GKE '1.30.1-gke.100'; this stack (multislice, v5litepod, flex-start) needs "
     "1.33.0-gke.1712000 or later"),
])
def test_a_cluster_that_cannot_run_the_stack_is_one_line_naming_it(changes, field, words):
    [(prop, line)] = description_problems(props(**changes))
    assert prop == field and words in line and CLUSTER_NAME in line and "\n" not in line


def test_a_missing_controller_is_refused_at_check_with_the_key_that_installs_it(monkeypatch):
    provider = ClusterCheckProvider()
    with KubeApi() as api:
        monkeypatch.setenv("MULTISLICE_KUBERNETES_API", api.url)
        result = provider.check({}, props(crds=[*JOBSET_CRDS]))
        [failure] = result.failures
        assert failure.property == "crds"
        assert "does not serve jobsets.jobset.x-k8s.io" in failure.reason
        assert "gke.install_jobset: true" in failure.reason
        for crd in KUEUE_CRDS:
            api.put(CRDS, crd, {"apiVersion": "apiextensions.k8s.io/v1",
                                "kind": "CustomResourceDefinition", "metadata": {"name": crd}},
                    namespace=None)
        api.put(CRDS, JOBSET_CRDS[0], released_jobset_crd(), namespace=None)
        assert provider.check({}, props(crds=[*JOBSET_CRDS, *KUEUE_CRDS])).failures == []
    # An API server that cannot be reached is one line too, not a traceback.
    [failure] = provider.check({}, props(crds=[*JOBSET_CRDS])).failures
    assert failure.property == "crds" and failure.reason.startswith("cannot ask http://")


def test_the_description_is_checked_before_the_crds_are_asked_for(monkeypatch):
    monkeypatch.setenv("MULTISLICE_KUBERNETES_API", "http://127.0.0.1:9")  # nothing listens
    [failure] = ClusterCheckProvider().check({}, props(autopilot=True, crds=[*JOBSET_CRDS])
                                             ).failures
    assert failure.property == "autopilot"


def _check(mocks):
    return [r for r in mocks.of_type("pulumi-python:dynamic:Resource")
            if r.name.endswith("-cluster-check")]


def test_an_existing_cluster_is_checked_for_what_the_stack_does_not_install(project_root):
    mocks, _ = run_program(gke_config(gke={"cluster": CLUSTER_NAME, "image": IMAGE,
                                           "queueing": True}), project_root)
    [check] = _check(mocks)
    assert check.inputs["crds"] == [*JOBSET_CRDS, *KUEUE_CRDS]
    assert check.inputs["workload_pool"] == "my-proj.svc.id.goog"  # the getCluster answer
    assert check.inputs["min_version"] == "1.28.0" and check.inputs["autopilot"] is False
    # what it creates under names of its stack's: its own, or absent (another team's refused)
    owner = {"multislice-stack": "exp", "multislice-project": "my-proj"}
    assert [(o["what"], o["owned_by"]) for o in check.inputs["objects"]] == [
        ("namespace ms-exp", owner), ("ResourceFlavor ms-exp-tpu", owner),
        ("ClusterQueue ms-exp", owner)]
    # nothing in the cluster before it passes
    for pool in mocks.of_type(NODE_POOL):
        assert "ms-exp-cluster-check" in {getattr(d, "_name", None)
                                          for d in mocks.options[pool.name].depends_on}
    mocks, _ = run_program(gke_config(gke={"cluster": CLUSTER_NAME, "image": IMAGE,
                                           "install_jobset": True}), project_root)
    [check] = _check(mocks)
    assert check.inputs["crds"] == [] and [o["what"] for o in check.inputs["objects"]] == [
        "namespace ms-exp"]
    mocks, _ = run_program(gke_config(gke={"create_cluster": True, "image": IMAGE}),
                           project_root)
    assert not _check(mocks)


def test_the_admins_queue_namespace_and_priority_class_are_checked_too(project_root):
    mocks, _ = run_program(gke_config(gke={
        "cluster": CLUSTER_NAME, "image": IMAGE, "local_queue": "team-q", "namespace": "team-a",
        "priority_class": "high"}), project_root)
    [check] = _check(mocks)
    assert check.inputs["crds"] == [*JOBSET_CRDS, *KUEUE_CRDS]
    assert [o["what"] for o in check.inputs["objects"]] == [
        "namespace team-a", "LocalQueue team-a/team-q", "WorkloadPriorityClass high"]
    # and what the deployer may do in the admin's namespace
    assert {(a["verb"], a["resource"], a["namespace"]) for a in check.inputs["access"]} == {
        ("create", "jobsets", "team-a"), ("create", "configmaps", "team-a"),
        ("create", "serviceaccounts", "team-a")}


def test_a_missing_local_queue_is_one_line_once_its_controller_is_there(monkeypatch):
    from infra.gke.cluster_check import admin_objects

    objects = admin_objects("team-a", "team-q", None)
    provider = ClusterCheckProvider()
    with KubeApi() as api:
        monkeypatch.setenv("MULTISLICE_KUBERNETES_API", api.url)
        for crd in KUEUE_CRDS:
            api.put(CRDS, crd, {"apiVersion": "apiextensions.k8s.io/v1",
                                "kind": "CustomResourceDefinition", "metadata": {"name": crd}},
                    namespace=None)
        [failure] = provider.check({}, props(crds=[*KUEUE_CRDS], objects=objects)).failures
        assert failure.property == "objects"
        assert failure.reason == (f"{CLUSTER_NAME} has no LocalQueue team-a/team-q: check "
                                  "gke.local_queue and gke.namespace with `kubectl get "
                                  "localqueues -A`")
        api.put(LOCAL_QUEUES, "team-q", {"apiVersion": "kueue.x-k8s.io/v1beta1",
                                         "kind": "LocalQueue", "metadata": {
                                             "name": "team-q", "namespace": "team-a"}},
                namespace="team-a")
        assert provider.check({}, props(crds=[*KUEUE_CRDS], objects=objects)).failures == []


def test_a_jobset_controller_older_than_v0_10_is_refused_not_pruned_silently(monkeypatch):
    # Its CRD has no onJobFailureMessagePatterns: the API server would prune the field, the
    # disruption rule would match every failure, and a bad config would restart forever.
    provider = ClusterCheckProvider()
    with KubeApi() as api:
        monkeypatch.setenv("MULTISLICE_KUBERNETES_API", api.url)
        api.put(CRDS, JOBSET_CRDS[0], jobset_crd_before_v0_10(), namespace=None)
        [failure] = provider.check({}, props(crds=[*JOBSET_CRDS])).failures
        assert failure.property == "crds"
        assert "older than v0.10" in failure.reason and "onJobFailureMessagePatterns" in \
            failure.reason and "\n" not in failure.reason
        api.put(CRDS, JOBSET_CRDS[0], released_jobset_crd(), namespace=None)
        assert provider.check({}, props(crds=[*JOBSET_CRDS])).failures == []


def _namespace(name: str, level: str) -> dict:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {
        "name": name, "labels": {"pod-security.kubernetes.io/enforce": level}}}


def test_the_admins_namespace_must_exist_and_admit_the_pods(monkeypatch):
    # A workload stack's pods fit baseline (infra/gke/manifest.py pod_security_level): a
    # namespace enforcing baseline admits them, one enforcing restricted does not.
    from infra.gke.cluster_check import admin_objects

    objects = admin_objects("team-a", None, None, named_namespace=True, pod_security="baseline")
    provider = ClusterCheckProvider()
    with KubeApi() as api:
        monkeypatch.setenv("MULTISLICE_KUBERNETES_API", api.url)
        [failure] = provider.check({}, props(objects=objects)).failures
        assert failure.reason.startswith(f"{CLUSTER_NAME} has no namespace team-a: a stack "
                                         "creates no namespace it names")
        api.put(NAMESPACES, "team-a", _namespace("team-a", "restricted"), namespace=None)
        [failure] = provider.check({}, props(objects=objects)).failures
        assert "enforces Pod Security 'restricted'" in failure.reason
        assert "they need 'baseline'" in failure.reason and "enforce=baseline" in failure.reason
        for admits in ("baseline", "privileged"):
            api.put(NAMESPACES, "team-a", _namespace("team-a", admits), namespace=None)
            assert provider.check({}, props(objects=objects)).failures == []


def test_a_namespace_named_by_a_stack_of_its_own_pools_must_admit_its_node_cache(monkeypatch):
    from infra.gke.cluster_check import admin_objects

    objects = admin_objects("ml", None, None, named_namespace=True, pod_security="privileged")
    provider = ClusterCheckProvider()
    with KubeApi() as api:
        monkeypatch.setenv("MULTISLICE_KUBERNETES_API", api.url)
        api.put(NAMESPACES, "ml", _namespace("ml", "baseline"), namespace=None)
        [failure] = provider.check({}, props(objects=objects)).failures
        assert "enforces Pod Security 'baseline'" in failure.reason
        assert "hostPath" in failure.reason and "enforce=privileged" in failure.reason


def test_a_deployer_without_the_namespace_rights_is_one_line_naming_each(monkeypatch):
    from infra.gke.cluster_check import workload_access

    provider = ClusterCheckProvider()
    access = workload_access("team-a", queued_by_stack=False)
    with KubeApi() as api:
        monkeypatch.setenv("MULTISLICE_KUBERNETES_API", api.url)
        api.emulator.denied = {("create", "configmaps", "team-a"),
                               ("create", "jobsets", "team-a")}
        [failure] = provider.check({}, props(access=access)).failures
        assert failure.property == "access"
        assert failure.reason == (
            f"{CLUSTER_NAME}: the deployer may not create jobsets.jobset.x-k8s.io, create "
            "configmaps in namespace team-a (SelfSubjectAccessReview); ask the cluster's admin "
            "for the namespace role README lists for a workload deployer")
        api.emulator.denied = set()
        assert provider.check({}, props(access=access)).failures == []


def test_a_workload_stack_needs_pools_of_its_slice_shape_on_the_cluster():
    need = {"machine_type": "ct5lp-hightpu-4t", "topology": "4x4", "count": 2}
    pool = {"machine_type": "ct5lp-hightpu-4t", "topology": "4x4"}
    [(field, line)] = description_problems(props(need_pools=need, tpu_pools=[pool]))
    assert field == "tpu_pools" and "has 1 node pool(s) of ct5lp-hightpu-4t" in line
    assert description_problems(props(need_pools=need, tpu_pools=[pool, pool])) == []
    assert description_problems(props(need_pools=need, tpu_pools=[],
                                      autoprovisioning=True)) == []


def test_a_named_namespace_a_stack_declares_may_be_absent_but_never_someone_elses(monkeypatch):
    # gke.kind all with gke.namespace: the stack creates it (labelled with its stack); one that
    # exists with another stack's label, or none, would fail AlreadyExists at `pulumi up`.
    from infra.gke.cluster_check import owned_objects

    objects = owned_objects("team-a", [], {"multislice-stack": "exp",
                                          "multislice-project": "my-proj"})
    provider = ClusterCheckProvider()
    with KubeApi() as api:
        monkeypatch.setenv("MULTISLICE_KUBERNETES_API", api.url)
        assert provider.check({}, props(objects=objects)).failures == []  # absent: created
        api.put(NAMESPACES, "team-a", {"apiVersion": "v1", "kind": "Namespace", "metadata": {
            "name": "team-a", "labels": {"multislice-stack": "other"}}}, namespace=None)
        [failure] = provider.check({}, props(objects=objects)).failures
        assert "namespace team-a exists and is not this stack's" in failure.reason
        assert "gke.kind: workload" in failure.reason
        api.put(NAMESPACES, "team-a", {"apiVersion": "v1", "kind": "Namespace", "metadata": {
            "name": "team-a", "labels": {"multislice-stack": "exp",
                                         "pod-security.kubernetes.io/enforce": "privileged"}}},
            namespace=None)
        assert provider.check({}, props(objects=objects)).failures == []  # its own, upgraded


def test_a_stack_of_the_same_name_from_another_teams_project_is_refused_naming_the_owner(
        monkeypatch):
    """Names on a shared cluster derive from the stack name (ms-STACK namespace, ClusterQueue and
    ResourceFlavor): one another project's stack of that name holds is refused at preview."""
    from infra.gke import capacity as gke_capacity
    from infra.gke.cluster_check import owned_objects
    from infra.stack_config.schema import StackConfig

    cfg = StackConfig.model_validate({"stack": "exp", **gke_config(gke={
        "cluster": f"projects/my-proj/locations/us-central1/clusters/{CLUSTER_NAME}",
        "image": IMAGE, "queueing": True})})
    cluster_scoped = [o for o in gke_capacity.kueue_objects(cfg) if "namespace" not in
                      o["metadata"]]
    assert {o["kind"] for o in cluster_scoped} == {"ResourceFlavor", "ClusterQueue"}
    assert all(o["metadata"]["labels"]["multislice-project"] == "my-proj"
               for o in cluster_scoped)
    objects = owned_objects("ms-exp", cluster_scoped, cfg.owner_labels())
    provider = ClusterCheckProvider()
    queues = kmock.resource("kueue.x-k8s.io", "v1beta1", "clusterqueues")
    with KubeApi() as api:
        monkeypatch.setenv("MULTISLICE_KUBERNETES_API", api.url)
        assert provider.check({}, props(objects=objects)).failures == []  # none yet
        theirs = {"multislice-stack": "exp", "multislice-project": "team-b-proj"}
        api.put(queues, "ms-exp", {"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "ClusterQueue",
                                  "metadata": {"name": "ms-exp", "labels": theirs}},
                namespace=None)
        [failure] = provider.check({}, props(objects=objects)).failures
        assert failure.reason.startswith(
            f"{CLUSTER_NAME}: ClusterQueue ms-exp exists and is not this stack's (stack 'exp' of "
            "project 'team-b-proj'; this is stack 'exp' of project 'my-proj')"), failure.reason
        assert "choose another stack name" in failure.reason
        # its own, and one an older toolkit made (no project label), pass
        for labels in (cfg.owner_labels(), {"multislice-stack": "exp"}):
            api.put(queues, "ms-exp", {"apiVersion": "kueue.x-k8s.io/v1beta1",
                                      "kind": "ClusterQueue",
                                      "metadata": {"name": "ms-exp", "labels": labels}},
                    namespace=None)
            assert provider.check({}, props(objects=objects)).failures == []


def test_a_capacitys_team_namespaces_must_exist_and_enforce_exactly_baseline(monkeypatch):
    from infra.gke.cluster_check import team_namespace_objects

    objects = team_namespace_objects(["team-a"])
    provider = ClusterCheckProvider()
    with KubeApi() as api:
        monkeypatch.setenv("MULTISLICE_KUBERNETES_API", api.url)
        [failure] = provider.check({}, props(objects=objects)).failures
        assert "has no namespace team-a" in failure.reason
        assert "kubectl create namespace team-a && kubectl label namespace team-a " \
            "pod-security.kubernetes.io/enforce=baseline" in failure.reason
        unlabelled = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team-a"}}
        for namespace, words in ((unlabelled, "enforces no Pod Security level"),
                                 (_namespace("team-a", "privileged"), "could run a privileged"),
                                 (_namespace("team-a", "restricted"), "refuses the workloads'")):
            api.put(NAMESPACES, "team-a", namespace, namespace=None)
            [failure] = provider.check({}, props(objects=objects)).failures
            assert words in failure.reason and "\n" not in failure.reason
            assert "kubectl label --overwrite namespace team-a " \
                "pod-security.kubernetes.io/enforce=baseline" in failure.reason
        api.put(NAMESPACES, "team-a", _namespace("team-a", "baseline"), namespace=None)
        assert provider.check({}, props(objects=objects)).failures == []


# ---- an existing cluster as it is: its controllers, by whom and how they run ----


def _managed(crd: dict, *managers: str) -> dict:
    crd = dict(crd)
    crd["metadata"] = {**crd["metadata"], "managedFields": [
        {"manager": m, "operation": "Apply" if m.startswith("pulumi") else "Update"}
        for m in managers] + [{"manager": "kube-apiserver", "operation": "Update",
                               "subresource": "status"}]}
    return crd


def test_an_install_over_someone_elses_controller_is_refused_at_preview(monkeypatch):
    provider = ClusterCheckProvider()
    installs = {"JobSet": list(JOBSET_CRDS)}
    with KubeApi() as api:
        monkeypatch.setenv("MULTISLICE_KUBERNETES_API", api.url)
        assert provider.check({}, props(installs=installs)).failures == []  # none there yet
        api.put(CRDS, JOBSET_CRDS[0], _managed(released_jobset_crd(), "pulumi-kubernetes-1a2b"),
                namespace=None)  # another stack of this toolkit's: upserted, retained
        assert provider.check({}, props(installs=installs)).failures == []
        api.put(CRDS, JOBSET_CRDS[0], _managed(released_jobset_crd(), "helm"), namespace=None)
        [failure] = provider.check({}, props(installs=installs)).failures
        assert failure.property == "installs" and "\n" not in failure.reason
        assert "runs JobSet installed by someone else (jobsets.jobset.x-k8s.io is managed by " \
               "helm): gke.install_jobset: true would apply" in failure.reason


def _kueue_config(*frameworks: str) -> dict:
    body = yaml.safe_dump({"apiVersion": "config.kueue.x-k8s.io/v1beta2",
                           "kind": "Configuration",
                           "integrations": {"frameworks": list(frameworks)}})
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {
        "name": "kueue-manager-config", "namespace": "kueue-system"},
        "data": {"controller_manager_config.yaml": body}}


def test_the_clusters_kueue_must_manage_jobsets_and_serve_the_queue_objects_version(
        monkeypatch):
    from infra.gke.cluster_check import KUEUE_CONFIG_PATH

    configmaps = kmock.resource("", "v1", "configmaps")
    provider = ClusterCheckProvider()
    uses = props(uses_kueue=True, creates_queue_objects=True)
    with KubeApi() as api:
        monkeypatch.setenv("MULTISLICE_KUBERNETES_API", api.url)
        api.put(configmaps, "kueue-manager-config", _kueue_config("batch/job"), "kueue-system")
        [failure] = provider.check({}, uses).failures
        assert "runs Kueue without its JobSet integration (integrations.frameworks is " \
               "['batch/job'])" in failure.reason
        api.put(configmaps, "kueue-manager-config",
                _kueue_config("batch/job", "jobset.x-k8s.io/jobset"), "kueue-system")
        assert provider.check({}, uses).failures == []
        old = {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
               "metadata": {"name": "clusterqueues.kueue.x-k8s.io"},
               "spec": {"versions": [{"name": "v1beta1", "served": True}]}}
        api.put(CRDS, "clusterqueues.kueue.x-k8s.io", old, namespace=None)
        [failure] = provider.check({}, uses).failures
        assert "serve ['v1beta1'], not v1beta2" in failure.reason
        # a workload stack only labels its JobSet: the queue objects' version is not its concern
        assert provider.check({}, props(uses_kueue=True)).failures == []
        # a deployer with namespace rights only cannot read kueue-system: nothing to refuse
        api.emulator.forbidden_paths = {KUEUE_CONFIG_PATH}
        api.put(configmaps, "kueue-manager-config", _kueue_config("batch/job"), "kueue-system")
        assert provider.check({}, props(uses_kueue=True)).failures == []


def test_an_existing_cluster_gets_no_controller_unless_the_stack_file_asks():
    from tests.infra.test_gke_kinds import capacity_config

    existing = {**capacity_config()["gke"], "create_cluster": False,
                "cluster": "projects/my-proj/locations/us-central1/clusters/shared"}
    del existing["authorized_networks"]
    for gke, want in ((existing, {"jobset": False, "kueue": False}),
                      ({**existing, "install_kueue": True}, {"jobset": False, "kueue": True}),
                      (capacity_config()["gke"], {"jobset": True, "kueue": True})):
        cfg = StackConfig.model_validate({"stack": "plat", **capacity_config(), "gke": gke})
        assert cfg.gke.installs() == want, gke
        assert stack_problems(cfg)[0] == []  # install_kueue: false is no longer refused either


def test_a_workload_stack_is_refused_when_its_queue_could_never_admit_its_shape_or_chips(
        monkeypatch):
    """The admin's objects as a capacity stack of two shapes and two teams makes them, served
    at kueue.x-k8s.io/v1beta1 (where ClusterQueue's cohortName reads cohort)."""
    from infra.gke.capacity import capacity_objects
    from tests.infra.test_kueue_emulator import two_team_capacity

    plurals = {"LocalQueue": "localqueues", "ClusterQueue": "clusterqueues",
               "ResourceFlavor": "resourceflavors"}
    provider = ClusterCheckProvider()
    v5e = {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
           "cloud.google.com/gke-tpu-topology": "4x4"}

    def fit(queue: str, slices: int, labels: dict = v5e) -> dict:
        return props(queue_fit={"namespace": "team-a", "queue": queue, "shape_labels": labels,
                                "chips": slices * 16, "slices": slices})

    with KubeApi() as api:
        monkeypatch.setenv("MULTISLICE_KUBERNETES_API", api.url)
        for obj in capacity_objects(two_team_capacity()):
            if obj["kind"] in plurals:
                obj = {**obj, "apiVersion": "kueue.x-k8s.io/v1beta1"}
                if "cohortName" in obj.get("spec", {}):
                    spec = dict(obj["spec"])
                    spec["cohort"] = spec.pop("cohortName")
                    obj["spec"] = spec
                api.put(kmock.resource("kueue.x-k8s.io", "v1beta1", plurals[obj["kind"]]),
                        obj["metadata"]["name"], obj, obj["metadata"].get("namespace"))
        assert provider.check({}, fit("v5e", 2)).failures == []  # 16 own + what B lends
        [failure] = provider.check({}, fit("v6e", 1, v5e)).failures
        assert "LocalQueue team-a/v6e feeds ClusterQueue ms-plat-team-a-v6e, which has no " \
               "flavor of this stack's slice shape" in failure.reason
        # a queue without a cohort holds its nominal quota only
        api.put(kmock.resource("kueue.x-k8s.io", "v1beta1", "clusterqueues"),
                "ms-plat-team-a-v5e", {"apiVersion": "kueue.x-k8s.io/v1beta1",
                                       "kind": "ClusterQueue",
                                       "metadata": {"name": "ms-plat-team-a-v5e"},
                                       "spec": {"resourceGroups": [{"flavors": [{
                                           "name": "ms-plat-v5e", "resources": [{
                                               "name": "google.com/tpu",
                                               "nominalQuota": 16}]}]}]}}, None)
        [failure] = provider.check({}, fit("v5e", 2)).failures
        assert "can hold at most 16 chips of this stack's shape" in failure.reason
        assert "2 slice(s) need 32 at once" in failure.reason


def test_the_cluster_check_reads_the_credentials_pulumi_gcp_and_gke_token_read(monkeypatch):
    """GOOGLE_CREDENTIALS set for pulumi-gcp is what the check uses too; one that does not work
    is one line of the preview, not a crash of its provider."""
    for key in [k for k in os.environ if k.startswith(("GOOGLE_", "CLOUDSDK_"))]:
        monkeypatch.delenv(key)
    monkeypatch.delenv("MULTISLICE_KUBERNETES_API", raising=False)
    monkeypatch.setenv("GOOGLE_CREDENTIALS", '{"type": "not-a-credential"}')
    [failure] = ClusterCheckProvider().check({}, props(crds=list(JOBSET_CRDS))).failures
    assert failure.property == "crds" and "\n" not in failure.reason
    assert failure.reason.startswith("cannot ask the cluster's API server: no usable Google "
                                     "credentials")
    assert "GOOGLE_CREDENTIALS" in failure.reason
