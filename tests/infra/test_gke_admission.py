"""The GKE stack's Kubernetes objects as a real API server takes them, and the JobSet's contract.

Every object the program hands pulumi-kubernetes is created against the pinned CRDs (strict
fields, schema defaults, the JobSet webhook, OpenAPI and CEL validation:
scripts/emulators/crd_admission.py) or, for built-in kinds, against the Kubernetes API's own
schemas. The JobSet's contract (one Job per slice, one pod per node, placement, chips, identity,
the exit-code failure policy) is a list of checks; a mutation of each field it depends on must
make the admission or the contract fail.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from infra.gke import capacity as gke_capacity
from infra.gke import controllers
from infra.gke import manifest as gke_manifest
from infra.gke.topology import gke_slice
from infra.stack_config.schema import StackConfig
from scripts.emulators import crd_admission, jobset_policy
from tests.infra.pulumi_mocks import run_program
from tests.infra.test_gke import (
    CLUSTER_NAME,
    IMAGE,
    KUBERNETES_VERSION,
    SPEC_SHA256,
    gke_config,
)
from tests.support.examples import EXAMPLE_STACKS

ROOT = Path(__file__).resolve().parents[2]
CRDS = Path(__file__).resolve().parent / "crds"
# apiVersions the Kubernetes API serves itself (kubernetes-validate's schemas)
BUILT_IN = {"v1", "networking.k8s.io/v1", "admissionregistration.k8s.io/v1"}

VARIANTS = {
    "existing cluster, on-demand": gke_config(),
    "spot": gke_config(capacity="spot"),
    "reservation": gke_config(capacity="reserved", reservation_name="tpu-res"),
    "flex-start": gke_config(capacity="flex-start"),
    "queued with Kueue": gke_config(gke={"cluster": CLUSTER_NAME, "image": IMAGE,
                                         "queueing": True}),
    "created cluster": gke_config(gke={"create_cluster": True, "image": IMAGE}),
    "own named namespace": gke_config(gke={"cluster": CLUSTER_NAME, "image": IMAGE,
                                           "namespace": "team-a"}),
}  # the workload and capacity kinds: their example stacks (example_gke_stacks)


def example_gke_stacks() -> dict[str, dict[str, Any]]:
    stacks = {}
    for path in EXAMPLE_STACKS:
        raw = yaml.safe_load(path.read_text())["config"]
        config = {k.removeprefix("multislice:"): v for k, v in raw.items()}
        if config.get("orchestration") == "gke":
            stacks[path.name] = config if "experiment_dir" not in config else {
                **config, "experiment_dir": "experiments/demo"}  # project_root's
    return stacks


def kubernetes_objects(config: dict[str, Any], project_root: Path) -> list[dict[str, Any]]:
    """Every Kubernetes object the program declares for this stack, as pulumi-kubernetes gets it."""
    mocks, _ = run_program(config, project_root)
    objects = []
    for resource in mocks.resources:
        if resource.typ.startswith("kubernetes:") and not resource.typ.startswith(
                ("kubernetes:yaml/", "pulumi:providers:")):
            group_version, kind = resource.typ.split(":")[1:]
            api_version = group_version.removeprefix("core/")
            objects.append(as_json({"apiVersion": api_version, "kind": kind, **resource.inputs}))
        elif resource.typ == "kubernetes:yaml/v2:ConfigGroup":  # objects without a spec
            objects += [as_json(obj) for obj in resource.inputs["objs"]]
    return objects


def as_json(value: Any) -> Any:
    """Pulumi's wire format carries every number as a float64; pulumi-kubernetes writes one that
    is integral as a JSON integer, which is what the API server reads."""
    if isinstance(value, dict):
        return {k: as_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [as_json(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def creation_problems(obj: dict[str, Any]) -> list[str]:
    if obj["apiVersion"] in BUILT_IN:
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            return [str(error)]
        return []
    return crd_admission.admit(obj)[1]


# ---- the pinned CRDs ----------------------------------------------------------------------------


def test_the_pinned_crds_are_the_released_files_of_the_versions_the_program_installs():
    readme = (CRDS / "README.md").read_text()
    pinned = dict(re.findall(r"^([0-9a-f]{64})  (\S+)$", readme, re.M)[i][::-1]
                  for i in range(4))
    assert set(pinned) == {p.name for p in CRDS.glob("*.yaml")}
    for name, digest in pinned.items():
        assert hashlib.sha256((CRDS / name).read_bytes()).hexdigest() == digest, name
    assert f"| {controllers.JOBSET_VERSION} (`infra.gke.controllers.JOBSET_VERSION`)" in readme
    assert f"| {controllers.KUEUE_VERSION} (`infra.gke.controllers.KUEUE_VERSION`)" in readme
    served = crd_admission.schemas()
    assert (gke_manifest.JOBSET_API_VERSION, "JobSet") in served
    for kind in ("ResourceFlavor", "ClusterQueue", "LocalQueue"):
        assert (gke_manifest.KUEUE_API_VERSION, kind) in served


@dataclass(frozen=True)
class KeptController:
    """A controller's release manifest kept in infra/k8s/, and what its build must contain."""

    manifest: str
    heading: str
    """How infra/k8s/README.md names it: the project and version its section starts with."""
    image: str
    """The release's controller image, pinned by digest (infra/k8s/README.md)."""
    namespace: str
    labels: dict[str, str]
    """What kustomize adds to every object's labels (the CRDs' included)."""
    pinned_crds: tuple[str, ...]
    """Files of tests/infra/crds/ whose CRD the manifest must carry unchanged but for kustomize's
    additions."""


KEPT_CONTROLLERS = {
    "jobset": KeptController(
        manifest=controllers.JOBSET_MANIFEST, heading=f"JobSet {controllers.JOBSET_VERSION} (kubernetes-sigs/jobset",
        image=f"registry.k8s.io/jobset/jobset:{controllers.JOBSET_VERSION}@sha256:"
              "e75536f1135b7bb2f19f8c3b620782fbdd9091d73398e3a272f9a5fed322980d",
        namespace="jobset-system",
        labels={"app.kubernetes.io/name": "jobset", "app.kubernetes.io/instance": "jobset",
                "app.kubernetes.io/managed-by": "kustomize"},
        pinned_crds=("jobset.x-k8s.io_jobsets.yaml",)),
    "kueue": KeptController(
        manifest=controllers.KUEUE_MANIFEST, heading=f"Kueue {controllers.KUEUE_VERSION} (kubernetes-sigs/kueue",
        image=f"registry.k8s.io/kueue/kueue:{controllers.KUEUE_VERSION}@sha256:"
              "8a77be2df3d441d1a99b60eb1625c835b5f4feda5db02ece26818cf2a30c4d86",
        namespace="kueue-system",
        labels={"app.kubernetes.io/name": "kueue", "control-plane": "controller-manager"},
        pinned_crds=("kueue.x-k8s.io_resourceflavors.yaml", "kueue.x-k8s.io_clusterqueues.yaml",
                     "kueue.x-k8s.io_localqueues.yaml")),
}


@functools.cache
def kept_objects(manifest: str) -> tuple[dict[str, Any], ...]:
    # libyaml: the pure-Python loader takes seconds on Kueue's 1.7 MB of CRDs
    text = (ROOT / manifest).read_text()
    return tuple(d for d in yaml.load_all(text, Loader=yaml.CSafeLoader) if d)


@pytest.mark.parametrize("kept", KEPT_CONTROLLERS.values(), ids=KEPT_CONTROLLERS)
def test_a_kept_controller_manifest_is_the_hashed_build_of_the_pinned_tag(kept):
    readme = (ROOT / "infra" / "k8s" / "README.md").read_text()
    name = Path(kept.manifest).name
    [digest] = re.findall(rf"^([0-9a-f]{{64}})  {re.escape(name)}$", readme, re.M)
    assert hashlib.sha256((ROOT / kept.manifest).read_bytes()).hexdigest() == digest
    assert kept.heading in readme
    objects = kept_objects(kept.manifest)
    [deployment] = [o for o in objects if o["kind"] == "Deployment"]
    [manager] = deployment["spec"]["template"]["spec"]["containers"]
    assert manager["image"] == kept.image

    # Its CRDs are the pinned ones (the schemas every object here is admitted against) plus only
    # what kustomize adds to them: labels, the conversion webhook and the CA injection.
    crds = {o["metadata"]["name"]: o for o in objects if o["kind"] == "CustomResourceDefinition"}
    for file in kept.pinned_crds:
        pinned = yaml.safe_load((CRDS / file).read_text())
        crd = copy.deepcopy(crds[pinned["metadata"]["name"]])
        assert crd["metadata"].pop("labels") == kept.labels
        crd["metadata"]["annotations"].pop("cert-manager.io/inject-ca-from", None)
        conversion = crd["spec"].pop("conversion", None)
        if conversion is not None:
            service = conversion["webhook"]["clientConfig"]["service"]
            assert (service["namespace"], service["name"]) in {
                (o["metadata"].get("namespace"), o["metadata"]["name"])
                for o in objects if o["kind"] == "Service"}, file
        assert crd == pinned, file


@pytest.mark.parametrize("kept", KEPT_CONTROLLERS.values(), ids=KEPT_CONTROLLERS)
def test_every_object_of_a_kept_controller_manifest_is_valid_and_refers_to_objects_in_it(kept):
    objects = kept_objects(kept.manifest)
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            raise AssertionError((obj["kind"], obj["metadata"]["name"], str(error))) from None
        assert obj["metadata"].get("labels", {}).items() >= kept.labels.items(), obj["metadata"]
    named = {(o["kind"], o["metadata"]["name"]) for o in objects}
    # Only its own namespace, and kube-system where a binding lets it read the API server's
    # authentication config (Kueue's visibility server).
    namespaced = {o["metadata"].get("namespace") for o in objects} - {None}
    assert namespaced <= {kept.namespace, "kube-system"} and ("Namespace", kept.namespace) in named
    assert all(o["kind"] == "RoleBinding" for o in objects
               if o["metadata"].get("namespace") == "kube-system")
    for binding in (o for o in objects if o["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        role = binding["roleRef"]
        assert (role["kind"], role["name"]) in named or role["name"].startswith(
            "extension-apiserver-"), binding
        for subject in binding["subjects"]:
            assert (subject["kind"], subject["name"]) in named, binding
    [deployment] = [o for o in objects if o["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert ("ServiceAccount", pod["spec"]["serviceAccountName"]) in named
    secrets = {v["secret"]["secretName"] for v in pod["spec"]["volumes"] if "secret" in v}
    assert secrets and all(("Secret", s) in named for s in secrets)
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    hooked = [hook["clientConfig"]["service"]
              for config in objects if config["kind"].endswith("WebhookConfiguration")
              for hook in config["webhooks"]]
    hooked += [o["spec"]["service"] for o in objects if o["kind"] == "APIService"]
    assert hooked
    for service in hooked:
        assert service["namespace"] == kept.namespace, service
        assert services[service["name"]]["spec"]["selector"].items() <= \
            pod["metadata"]["labels"].items(), service


def test_the_kept_kueue_manifest_manages_jobsets():
    # Kueue admits only the kinds its configuration integrates; a queued JobSet of a Kueue that
    # does not integrate JobSet would start at once, past the quota.
    [config_map] = [o for o in kept_objects(controllers.KUEUE_MANIFEST) if o["kind"] == "ConfigMap"]
    config = yaml.safe_load(config_map["data"]["controller_manager_config.yaml"])
    assert "jobset.x-k8s.io/jobset" in config["integrations"]["frameworks"]


# ---- every object of every variant is created --------------------------------------------------


@pytest.mark.parametrize("config", [*VARIANTS.values(), *example_gke_stacks().values()],
                         ids=[*VARIANTS, *example_gke_stacks()])
def test_every_kubernetes_object_of_a_gke_stack_is_created_by_the_api_server(config, project_root):
    objects = kubernetes_objects(config, project_root)
    kinds = {obj["kind"] for obj in objects}
    kind = config["gke"].get("kind", "all")
    if kind == "capacity":
        assert {"Namespace", "ResourceFlavor", "ClusterQueue", "LocalQueue",
                "WorkloadPriorityClass"} <= kinds and "JobSet" not in kinds
    else:
        assert {"JobSet", "ServiceAccount", "ConfigMap"} <= kinds
        # a stack of kind all declares its namespace (the default, or one it names); a workload
        # stack, or one joining the admin's queue, runs in the admin's
        owns = kind == "all" and "local_queue" not in config["gke"] and \
            config["gke"].get("namespace") != "default"
        assert ("Namespace" in kinds) == owns
    if config["gke"].get("queueing"):
        assert {"ResourceFlavor", "ClusterQueue", "LocalQueue"} <= kinds
    for obj in objects:
        assert creation_problems(obj) == [], (obj["kind"], obj["metadata"].get("name"))


def test_the_stored_jobset_keeps_what_the_contract_needs_after_the_webhook_defaults():
    cfg, js = rendered()
    stored, problems = crd_admission.admit(js)
    assert problems == []
    job = stored["spec"]["replicatedJobs"][0]["template"]["spec"]
    # the webhook fills restartPolicy OnFailure only when none is set; podFailurePolicy needs Never
    assert job["template"]["spec"]["restartPolicy"] == "Never"
    assert stored["spec"]["failurePolicy"]["restartStrategy"] == "Recreate"  # the schema default
    assert stored["spec"]["network"] == {"enableDNSHostnames": True,
                                         "publishNotReadyAddresses": True}
    assert stored["spec"]["replicatedJobs"][0]["groupName"] == "default"
    assert contract_problems(cfg, stored) == []


# ---- the contract and its mutations -------------------------------------------------------------


def rendered(**overrides) -> tuple[StackConfig, dict[str, Any]]:
    cfg = StackConfig.model_validate({"stack": "exp", **gke_config(
        trainer={"config": "tiny", "steps": 20, "mesh": {"ici_fsdp": 16}, "max_restarts": 7,
                 "overrides": {"train.global_batch_size": 32}}, **overrides)})
    return cfg, gke_manifest.jobset(cfg, SPEC_SHA256)


def contract_problems(cfg: StackConfig, js: dict[str, Any]) -> list[str]:
    """What the JobSet must say for this stack, each a line when it does not."""
    shape = gke_slice(cfg.topology)
    rjobs = js["spec"].get("replicatedJobs", [{}])
    rjob = rjobs[0]
    job = rjob.get("template", {}).get("spec", {})
    pod = job.get("template", {}).get("spec", {})
    (container,) = pod.get("containers", [{}])
    env = {e.get("name"): e.get("value") for e in container.get("env", [])}
    policy = js["spec"].get("failurePolicy", {})
    checks = {
        "one replicated job": len(rjobs) == 1,
        "a Job per slice": rjob.get("replicas") == cfg.slices,
        "a pod per node": job.get("parallelism") == job.get("completions") == shape.nodes,
        # GKE injects TPU_WORKER_ID and TPU_WORKER_HOSTNAMES into pods of Indexed Jobs only
        "Indexed completion": job.get("completionMode") == "Indexed",
        "one slice a node pool": js["metadata"].get("annotations", {}).get(
            "alpha.jobset.sigs.k8s.io/exclusive-topology") == "cloud.google.com/gke-nodepool",
        "the slice's accelerator and topology, on this stack's pools only":
        pod.get("nodeSelector") == {
            "cloud.google.com/gke-tpu-accelerator": shape.accelerator,
            "cloud.google.com/gke-tpu-topology": shape.topology, "multislice-stack": cfg.stack},
        "every chip of a node": container.get("resources", {}).get("limits") == {
            "google.com/tpu": shape.chips_per_node} == container.get("resources", {}).get(
            "requests"),
        "the image pinned by digest": container.get("image") == cfg.gke.image
        and "@sha256:" in container.get("image", ""),
        "the trainer's identity": pod.get("serviceAccountName") == cfg.names.k8s_service_account,
        "the launch spec": env.get("MULTISLICE_LAUNCH_SPEC_URI") == cfg.names.launch_spec_uri,
        # JAX's GkeTpuCluster reads these; JobSet's own pod labels give them (manifest.py)
        "the multislice variables from JobSet's pod labels": {
            e.get("name"): e.get("value") or e.get("valueFrom", {}).get("fieldRef", {}).get(
                "fieldPath") for e in container.get("env", [])
            if e.get("name", "").startswith("MEGASCALE_")} == {
            "MEGASCALE_COORDINATOR_ADDRESS":
                f"{js['metadata']['name']}-{rjob.get('name')}-0-0.{js['metadata']['name']}",
            "MEGASCALE_NUM_SLICES": "metadata.labels['jobset.sigs.k8s.io/replicatedjob-replicas']",
            "MEGASCALE_SLICE_ID": "metadata.labels['jobset.sigs.k8s.io/job-index']"},
        "the grace period of a save": pod.get("terminationGracePeriodSeconds", 30) >= 300,
        "a pod failure is the Job's failure": job.get("backoffLimit") == 0,
        "pods are not restarted in place": pod.get("restartPolicy") == "Never",
        # what the Job and JobSet controllers do with each kind of pod failure
        "exit 2 and 3 fail the JobSet at once": [
            failure_action(job, policy, container, exit_code=code) for code in (2, 3)
        ] == ["FailJobSet", "FailJobSet"],
        "a crash restarts the JobSet within maxRestarts": [
            failure_action(job, policy, container, exit_code=code) for code in (1, 42, 134, 137)
        ] == ["RestartJobSet"] * 4,
        "a disruption restarts it outside maxRestarts": failure_action(
            job, policy, container, exit_code=None, conditions=("DisruptionTarget",))
        == failure_action(job, policy, container, exit_code=143, conditions=("DisruptionTarget",))
        == "RestartJobSetAndIgnoreMaxRestarts",
        "restarts bounded by trainer.max_restarts": policy.get("maxRestarts")
        == cfg.trainer.max_restarts,
    }
    return [what for what, ok in checks.items() if not ok]


def failure_action(job: dict[str, Any], policy: dict[str, Any], container: dict[str, Any], *,
                   exit_code: int | None, conditions: tuple[str, ...] = ()) -> str:
    """What JobSet does when one pod of `job` fails so (scripts/emulators/jobset_policy.py)."""
    try:
        failure = jobset_policy.job_failure(job.get("podFailurePolicy"), jobset_policy.PodFailure(
            "ns", "pod", container.get("name", ""), exit_code, conditions))
        return jobset_policy.jobset_action(policy, failure)
    except (KeyError, TypeError, AttributeError) as err:  # a mutation that breaks the shape
        return f"unreadable: {err!r}"


DELETE = object()


def path(dotted: str, *more: str | int) -> tuple[str | int, ...]:
    return (*(int(p) if p.isdigit() else p for p in dotted.split(".")), *more)


def _set(at: tuple[str | int, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    """A mutation that sets (or, with DELETE, removes) the field at a path."""
    def mutate(js: dict[str, Any]) -> None:
        node: Any = js
        for part in at[:-1]:
            node = node[part]
        if value is DELETE:
            del node[at[-1]]
        else:
            node[at[-1]] = value
    return mutate


RJOB = "spec.replicatedJobs.0"
JOB = f"{RJOB}.template.spec"
POD = f"{JOB}.template.spec"
CONTAINER = f"{POD}.containers.0"
MUTATIONS = {
    "replicas": _set(path(f"{RJOB}.replicas"), 3),
    "replicas as a string": _set(path(f"{RJOB}.replicas"), "2"),
    "parallelism": _set(path(f"{JOB}.parallelism"), 3),
    "completions": _set(path(f"{JOB}.completions"), DELETE),
    "completion mode": _set(path(f"{JOB}.completionMode"), "NonIndexed"),
    "completion mode misspelt": _set(path(f"{JOB}.completionMode"), "indexed"),
    "exclusive topology": _set(path("metadata.annotations"), {}),
    "node selector accelerator": _set(
        path(f"{POD}.nodeSelector", "cloud.google.com/gke-tpu-accelerator"), "x"),
    "node selector topology": _set(path(f"{POD}.nodeSelector"), {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice"}),
    "any pools of the shape": lambda js: js["spec"]["replicatedJobs"][0]["template"]["spec"][
        "template"]["spec"]["nodeSelector"].pop("multislice-stack"),
    "chips": _set(path(f"{CONTAINER}.resources.limits"), {"google.com/tpu": 8}),
    "chips as a bad quantity": _set(path(f"{CONTAINER}.resources.limits"),
                                    {"google.com/tpu": "4 chips"}),
    "image tag without digest": _set(path(f"{CONTAINER}.image"), "python:3.11"),
    "service account": _set(path(f"{POD}.serviceAccountName"), DELETE),
    "launch spec": _set(path(f"{CONTAINER}.env"), []),
    "slice id from the wrong label": _set(
        path(f"{CONTAINER}.env.4.valueFrom.fieldRef.fieldPath"),
        "metadata.labels['jobset.sigs.k8s.io/job-global-index']"),
    "grace period": _set(path(f"{POD}.terminationGracePeriodSeconds"), DELETE),
    "backoff limit": _set(path(f"{JOB}.backoffLimit"), DELETE),
    "restart policy": _set(path(f"{POD}.restartPolicy"), DELETE),
    "pod failure policy": _set(path(f"{JOB}.podFailurePolicy.rules.1.onExitCodes.values"), [3]),
    "pod failure operator": _set(
        path(f"{JOB}.podFailurePolicy.rules.1.onExitCodes.operator"), "Is"),
    "pod failure rules swapped": lambda js: js["spec"]["replicatedJobs"][0]["template"]["spec"][
        "podFailurePolicy"]["rules"].reverse(),
    "disruption condition": _set(
        path(f"{JOB}.podFailurePolicy.rules.0.onPodConditions.0.type"), "Disrupted"),
    "disruption rule counted": _set(path("spec.failurePolicy.rules.0.action"), "RestartJobSet"),
    "disruption rule dropped": lambda js: js["spec"]["failurePolicy"]["rules"].pop(0),
    "failure rule action": _set(path("spec.failurePolicy.rules.1.action"), "Fail"),
    "failure rule name with a hyphen": _set(path("spec.failurePolicy.rules.1.name"),
                                            "deterministic-exit"),
    "failure rule reason": _set(path("spec.failurePolicy.rules.1.onJobFailureReasons"),
                                ["PodFailurePolicies"]),
    "failure rule message": _set(path("spec.failurePolicy.rules.1.onJobFailureMessagePatterns"),
                                 ["exit code 2$"]),
    "max restarts": _set(path("spec.failurePolicy.maxRestarts"), DELETE),
    "an unknown field": _set(path(f"{RJOB}.replica"), 2),
    "a misplaced pod field": _set(path(f"{JOB}.nodeSelector"), {"a": "b"}),
    "a JobSet name past 63 characters of pod name": _set(path("metadata.name"), "ms-" + "x" * 45),
    "a label value": _set(path("metadata.labels"), {"multislice-stack": "not a value"}),
    "no namespace": _set(path("metadata.namespace"), DELETE),
}


@pytest.mark.parametrize("mutation", MUTATIONS.values(), ids=MUTATIONS)
def test_a_mutation_of_any_field_the_jobset_needs_is_caught(mutation):
    cfg, js = rendered()
    assert crd_admission.admit(js)[1] == [] and contract_problems(cfg, js) == []
    broken = copy.deepcopy(js)
    mutation(broken)
    stored, problems = crd_admission.admit(broken)
    assert problems or contract_problems(cfg, stored), "the mutation went unnoticed"


def test_kueue_refuses_a_cluster_queue_whose_flavors_do_not_cover_its_resources():
    cfg = StackConfig.model_validate({"stack": "exp", **VARIANTS["queued with Kueue"]})
    flavor, queue, local = gke_capacity.kueue_objects(cfg)
    assert [crd_admission.admit(o)[1] for o in (flavor, queue, local)] == [[], [], []]
    broken = copy.deepcopy(queue)
    broken["spec"]["resourceGroups"][0]["coveredResources"].append("cpu")  # a CEL rule's
    (problem,) = crd_admission.admit(broken)[1]
    assert problem.startswith("spec.resourceGroups[0]: ")
    broken = copy.deepcopy(local)
    broken["spec"]["clusterQueues"] = broken["spec"].pop("clusterQueue")
    assert crd_admission.admit(broken)[1] == ["spec.clusterQueues: unknown field"]
    assert crd_admission.admit({**flavor, "metadata": {**flavor["metadata"], "namespace": "x"}}
                               )[1] == ["metadata.namespace: a cluster-scoped object takes no "
                                        "namespace"]
