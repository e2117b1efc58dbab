"""What a GKE stack applies, as plain data: each slice's node pool, and the JobSet.

Pure (no pulumi import), like infra/stack_config/manifest.py, so the program, the offline render
and the tests build the same objects. The field names are the Kubernetes and JobSet API's own (JobSet
v1alpha2, jobset.sigs.k8s.io); infra/gke/resources.py hands them to pulumi-kubernetes unchanged.

Semantics kept from the sources:
  - JobSet's exclusive placement: the annotation alpha.jobset.sigs.k8s.io/exclusive-topology on
    the node pool label gives each child Job (one slice) a node pool of its own.
  - GKE injects TPU_WORKER_ID and TPU_WORKER_HOSTNAMES into the pods of an Indexed Job with a
    subdomain, parallelism > 1 and a google.com/tpu request (GKE's TPU docs); JobSet gives every
    Job the subdomain of its headless service. JAX's GKE cluster detection reads those variables,
    and for a multislice job MEGASCALE_COORDINATOR_ADDRESS, MEGASCALE_NUM_SLICES and
    MEGASCALE_SLICE_ID (jax/_src/clusters/cloud_tpu_cluster.py, GkeTpuCluster). No GKE page says
    GKE sets those, so the pod spec does, from what JobSet documents it puts on every pod: the
    labels jobset.sigs.k8s.io/replicatedjob-replicas (the slices) and jobset.sigs.k8s.io/job-index
    (this slice), read through the downward API, and the DNS name of the first pod of the first
    Job in the headless service (JOBSET-RJOB-0-0.JOBSET), as xpk's and Pathways' JobSets do.
  - The trainer's exit-code contract (docs/CONTRACTS.md): 2 (bad config) and 3 (diverged) are
    deterministic, so the Job's podFailurePolicy fails the Job with reason PodFailurePolicy and a
    JobSet failure rule on that reason and rule's message fails the whole JobSet at once. A pod
    disrupted by the platform (spot preemption, maintenance, a node upgrade or failure: the
    DisruptionTarget condition) fails its Job by another rule, and the JobSet restarts with
    RestartJobSetAndIgnoreMaxRestarts: disruptions never use up the restart budget (JobSet
    v0.10+ onJobFailureMessagePatterns; the Configurable Failure Policy KEP's example). Any other
    failure (a crash, a peer that died) falls through to JobSet's default action, which
    restarts every Job, bounded by failurePolicy.maxRestarts = trainer.max_restarts.
  - A pod's container filesystem dies with it, and JobSet recreates every pod on a restart;
    the node outlives them. On a stack's own node pools (kind all, tainted for it alone) a
    hostPath directory of the stack's own (startup.sh's /opt/multislice) keeps the unpacked
    Python environment and the trainer's compile cache across its pods; a pod uses the
    environment there only when every file's content (bytecode included) matches the digest the
    deployer pinned in the launch spec, and installs it again otherwise (GKE Standard allows
    hostPath; Autopilot does not, and TPU multislice needs Standard). Its place is under
    /var/lib/kubelet: Container-Optimized OS mounts /var noexec ("Disks and file system
    overview"), and the node set-up remounts /var/lib/kubelet exec for the kubelet's own volumes
    (kubernetes cluster/gce/gci/configure-helper.sh, setup-kubelet-dir), so an interpreter
    unpacked there runs. On an admin's pools (kind workload), which other teams' pods share,
    nothing is kept on the node.
  - The JobSet webhook refuses a JobSet whose generated Job or pod names (JOBSET-RJOB-J and
    JOBSET-RJOB-J-P plus a 5-character suffix) are not DNS-1035 labels of at most 63 characters.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from infra.gke.names import REPLICATED_JOB
from infra.gke.topology import (
    ACCELERATOR_LABEL,
    NODE_POOL_LABEL,
    TOPOLOGY_LABEL,
    TPU_RESOURCE,
    gke_slice,
)
from infra.stack_config.manifest import LAUNCH_PY_PATH, STARTUP_SCRIPT_PATH

if TYPE_CHECKING:
    from infra.stack_config.schema import StackConfig

JOBSET_API_VERSION = "jobset.x-k8s.io/v1alpha2"
KUEUE_API_VERSION = "kueue.x-k8s.io/v1beta2"  # Kueue v0.19's storage version
QUEUE_NAME_LABEL = "kueue.x-k8s.io/queue-name"  # on a JobSet: the LocalQueue that admits it
PRIORITY_CLASS_LABEL = "kueue.x-k8s.io/priority-class"  # a WorkloadPriorityClass's name
EXCLUSIVE_TOPOLOGY = "alpha.jobset.sigs.k8s.io/exclusive-topology"
WORKLOAD_IDENTITY_ANNOTATION = "iam.gke.io/gcp-service-account"
# On the pods' template: the launch spec this JobSet runs. A run ends (its pods exit 0, the Job
# and the JobSet complete, the nodes are free), so nothing watches the spec afterwards: a new
# spec changes the JobSet's spec, and `pulumi up` replaces it (a new run on the same node pools).
LAUNCH_SPEC_ANNOTATION = "multislice.dev/launch-spec-sha256"
CONTAINER = "trainer"
BOOT_DIR = "/etc/multislice/boot"  # where the ConfigMap of infra/boot/ is mounted in every pod
NODE_CACHE_ROOT = "/var/lib/kubelet/multislice"  # on the node: outlives the pods (module docstring)
NODE_CACHE_MOUNT = "/opt/multislice"  # startup.sh's OPT_DIR: the environment, the compile cache
# On a stack's own TPU node pools (kind all): a NoSchedule taint only its JobSet tolerates, so no
# other stack's pod is scheduled on them, beside its pods or between its runs.
STACK_TAINT_KEY = "multislice.dev/stack"
# The start-up script runs as root in the container (it installs the environment, makes the
# trainer's user); what it keeps of root's capabilities: none, and for a trainer.run_as user what
# making that user and dropping to it takes, all within Pod Security "baseline"'s list. TPU
# access needs neither privileged mode nor a capability from GKE 1.28 (GKE's TPU manifests mark
# `privileged: true` "Required for GKE versions earlier than 1.28 to access TPUs" and add no
# capability; Autopilot, which refuses privileged pods, runs TPU workloads): no CAP_IPC_LOCK.
ROOT_CAPABILITIES: tuple[str, ...] = ()
RUN_AS_CAPABILITIES = ("CHOWN", "DAC_OVERRIDE", "FOWNER", "SETUID", "SETGID")
DETERMINISTIC_EXIT_CODES = (2, 3)  # docs/CONTRACTS.md: not restartable
# Indexes of the Job's podFailurePolicy rules (jobset() below).
DISRUPTION_RULE, DETERMINISTIC_EXIT_RULE = 0, 1


def _rule_message(index: int) -> str:
    """The end of the Job failure message the Job controller writes when podFailurePolicy rule
    `index` failed the Job ("... matching FailJob rule at index N", Kubernetes' Pod failure
    policy docs), as a JobSet onJobFailureMessagePatterns regex."""
    return f"matching FailJob rule at index {index}$"
# Spot and reservations as GKE node pools spell them (node_config.spot, reservation_affinity).
RESERVATION_KEY = "compute.googleapis.com/reservation-name"


def namespace(cfg: StackConfig) -> str:
    return (cfg.gke.namespace if cfg.gke and cfg.gke.namespace else None) or cfg.names.jobset


_ARTIFACT_REGISTRY = re.compile(
    r"^(?P<location>[a-z0-9-]+)-docker\.pkg\.dev/(?P<project>[^/]+)/(?P<repository>[^/]+)/")


def image_repository(image: str) -> str | None:
    """The Artifact Registry repository an image is pulled from (whose reader role the nodes
    need), as projects/P/locations/L/repositories/R; None for an image elsewhere (Docker Hub's
    are public)."""
    match = _ARTIFACT_REGISTRY.match(image)
    if match is None:
        return None
    return (f"projects/{match['project']}/locations/{match['location']}/repositories/"
            f"{match['repository']}")


def cluster_project(cfg: StackConfig) -> str:
    """The cluster's project: the named cluster's (a workload stack's may be a platform team's
    project), else the stack's."""
    assert cfg.gke is not None
    return cfg.gke.cluster.split("/")[1] if cfg.gke.cluster else cfg.project


def workload_identity_member(cfg: StackConfig) -> str:
    """The IAM member of the workload's Kubernetes service account (Workload Identity): the
    workload pool is the cluster's project's, wherever the Google service account lives (GKE's
    "Authenticate to Google Cloud APIs from GKE workloads", other projects' resources)."""
    return (f"serviceAccount:{cluster_project(cfg)}.svc.id.goog"
            f"[{namespace(cfg)}/{cfg.names.k8s_service_account}]")


def cluster_location(cfg: StackConfig) -> str:
    """The cluster's location: the named cluster's, or the stack's region for a created one."""
    assert cfg.gke is not None
    if cfg.gke.cluster:
        return cfg.gke.cluster.split("/")[3]
    return cfg.region


def cluster_name(cfg: StackConfig) -> str:
    assert cfg.gke is not None
    return cfg.gke.cluster.split("/")[5] if cfg.gke.cluster else cfg.names.gke_cluster


def stack_taint(cfg: StackConfig) -> dict[str, str]:
    """The taint of a stack's own node pools (GKE's node_config.taint spelling)."""
    return {"key": STACK_TAINT_KEY, "value": cfg.names.jobset, "effect": "NO_SCHEDULE"}


def node_cache_path(cfg: StackConfig) -> str:
    """The stack's own directory on a node: no two stacks share one."""
    return f"{NODE_CACHE_ROOT}/{namespace(cfg)}/{cfg.names.jobset}"


def owns_pools(cfg: StackConfig) -> bool:
    """A stack of kind all runs on node pools of its own; a workload stack on an admin's, which
    other teams' pods share."""
    return cfg.gke is None or cfg.gke.kind == "all"


def pools_tainted(cfg: StackConfig) -> bool:
    """A stack's own pools (kind all) and a capacity stack's pools carry the stack's taint."""
    return owns_pools(cfg) or (cfg.gke is not None and cfg.gke.kind == "capacity")


def capacity_toleration(cfg: StackConfig) -> dict[str, str]:
    """What tolerates the stack's taint (the pod spec's spelling)."""
    return {"key": STACK_TAINT_KEY, "operator": "Equal", "value": cfg.names.jobset,
            "effect": "NoSchedule"}


SHAPE_LABEL = "multislice-shape"  # on the nodes of a capacity stack's shape (gke.shapes)


def capacity_shapes(cfg: StackConfig) -> list[tuple[str | None, StackConfig]]:
    """The slice shapes of a stack, each as the stack with that shape's keys: a capacity stack's
    gke.shapes by name, or the stack's own shape (name None)."""
    if cfg.gke is None or cfg.gke.kind != "capacity" or not cfg.gke.shapes:
        return [(None, cfg)]
    return [(name, cfg.model_copy(update={
        "accelerator_type": s.accelerator_type, "slices": s.slices, "capacity": s.capacity,
        "reservation_name": s.reservation_name})) for name, s in cfg.gke.shapes.items()]


def shape_chips(cfg: StackConfig) -> int:
    shape = gke_slice(cfg.topology)
    return cfg.slices * shape.nodes * shape.chips_per_node


def node_pools(cfg: StackConfig) -> list[dict[str, Any]]:
    """Every TPU node pool of the stack, one a slice of each shape, in shape and slice order."""
    return [node_pool(shaped, i, name) for name, shaped in capacity_shapes(cfg)
            for i in range(shaped.slices)]


def node_pool(cfg: StackConfig, index: int, shape_name: str | None = None) -> dict[str, Any]:
    """One slice's node pool: the inputs of gcp.container.NodePool, in its Python names."""
    shape = gke_slice(cfg.topology)
    node_config: dict[str, Any] = {
        "machine_type": shape.machine_type,
        # The nodes' own minimal account: the trainer's is reached only through Workload
        # Identity (resources.py), so no other process on a node has its bucket access.
        "service_account": cfg.names.gke_node_account_email,
        "oauth_scopes": ["https://www.googleapis.com/auth/cloud-platform"],
        "labels": {**cfg.all_labels(), **({SHAPE_LABEL: shape_name} if shape_name else {})},
        "resource_labels": cfg.all_labels(),
        "tags": [cfg.names.slice_tag, *[t for t in cfg.tags if t != cfg.names.slice_tag]],
        "gvnic": {"enabled": True},
        "workload_metadata_config": {"mode": "GKE_METADATA"},
        "shielded_instance_config": {"enable_secure_boot": True,
                                     "enable_integrity_monitoring": True},
        # Only the stack's own JobSet (kind all) or workloads its queue admitted (kind capacity:
        # the ResourceFlavor's tolerations) tolerate it: no other pod is scheduled there.
        **({"taints": [stack_taint(cfg)]} if pools_tainted(cfg) else {}),
    }
    size: dict[str, Any] = {"node_count": shape.nodes}
    auto_repair = True
    if cfg.capacity == "spot":
        node_config["spot"] = True
    elif cfg.capacity == "reserved":
        node_config["reservation_affinity"] = (
            {"consume_reservation_type": "SPECIFIC_RESERVATION", "key": RESERVATION_KEY,
             "values": [cfg.reservation_name]}
            if cfg.reservation_name else {"consume_reservation_type": "ANY_RESERVATION"})
    elif cfg.capacity == "flex-start":
        # GKE's flex-start (Dynamic Workload Scheduler): the pool starts empty and the autoscaler
        # provisions the whole slice when the JobSet's pods wait for it; it takes no reservation
        # and no auto-repair (GoogleCloudPlatform/cluster-toolkit, modules/compute/gke-node-pool:
        # its flex-start preconditions; examples/gke-consumption-options/dws-flex-start). Nodes
        # live at most 7 days (GKE's default max run duration); the JobSet then restarts and
        # resumes from the latest checkpoint, as after a preemption.
        node_config["flex_start"] = True
        node_config["reservation_affinity"] = {"consume_reservation_type": "NO_RESERVATION"}
        auto_repair = False
    if cfg.gke is not None and cfg.gke.pools_scale_to_zero(cfg.capacity):
        # GKE's cluster autoscaler adds a multi-host TPU slice pool's nodes all at once when a
        # pod waits for them and removes them once none runs ("Autoscale TPU slice node pools"):
        # zero to the whole slice, nothing in between. A finished run stops billing.
        size = {"autoscaling": {"total_min_node_count": 0, "total_max_node_count": shape.nodes,
                                "location_policy": "ANY"}}
    return {
        "name": (f"{cfg.names.prefix}-{shape_name}-s{index}" if shape_name
                 else cfg.names.node_pools[index]),
        "project": cfg.project,
        "location": cluster_location(cfg),
        "cluster": cluster_name(cfg),
        "node_locations": [cfg.zone],
        **size,
        "placement_policy": {"type": "COMPACT", "tpu_topology": shape.topology},
        "management": {"auto_repair": auto_repair, "auto_upgrade": True},
        "node_config": node_config,
    }


JOBSET_REPLICAS_LABEL = "jobset.sigs.k8s.io/replicatedjob-replicas"
JOBSET_JOB_INDEX_LABEL = "jobset.sigs.k8s.io/job-index"
JOBSET_RESTART_ATTEMPT_LABEL = "jobset.sigs.k8s.io/restart-attempt"


def megascale_env(jobset_name: str) -> list[dict[str, Any]]:
    """The multislice variables JAX's GKE cluster code reads, from JobSet's own pod labels (see
    the module docstring)."""
    def label(key: str) -> dict[str, Any]:
        return {"fieldRef": {"fieldPath": f"metadata.labels['{key}']"}}

    return [
        {"name": "MEGASCALE_COORDINATOR_ADDRESS",
         "value": f"{jobset_name}-{REPLICATED_JOB}-0-0.{jobset_name}"},
        {"name": "MEGASCALE_NUM_SLICES", "valueFrom": label(JOBSET_REPLICAS_LABEL)},
        {"name": "MEGASCALE_SLICE_ID", "valueFrom": label(JOBSET_JOB_INDEX_LABEL)},
        # not JAX's: the start-up script's attempt number, in its log lines and log objects
        {"name": "MULTISLICE_ATTEMPT", "valueFrom": label(JOBSET_RESTART_ATTEMPT_LABEL)},
    ]


def pool_selector(cfg: StackConfig, shape_name: str | None = None) -> dict[str, str]:
    """The node labels that only this stack's node pools carry, besides the slice shape: its
    stack label (node_config.labels), and a capacity stack's shape name when it has several.
    Pool names hold the stack name and GKE refuses a second pool of a name in a cluster, so no
    other stack's pools have it; without it the pods could land on another stack's pools of the
    same shape (or a reservation's) while this stack's sat billed."""
    shape = {ACCELERATOR_LABEL: gke_slice(cfg.topology).accelerator,
             TOPOLOGY_LABEL: gke_slice(cfg.topology).topology}
    if cfg.gke is not None and cfg.gke.kind == "workload":
        # The admin's pools: the slice shape, and the queue's ResourceFlavor adds its node
        # labels when Kueue admits the JobSet.
        return shape
    return {**shape, **cfg.toolkit_labels(), **({SHAPE_LABEL: shape_name} if shape_name else {})}


def boot_files() -> dict[str, str]:
    """The ConfigMap's data: the same boot files a TPU VM gets in its metadata."""
    return {"startup.sh": STARTUP_SCRIPT_PATH.read_text(), "launch.py": LAUNCH_PY_PATH.read_text()}


DEFAULT_TEAM_QUEUE = "tpu"  # a capacity stack's LocalQueue in each team namespace
POD_SECURITY_ENFORCE = "pod-security.kubernetes.io/enforce"
POD_SECURITY_LEVELS = ("restricted", "baseline", "privileged")  # strictest first


def pod_security_level(cfg: StackConfig) -> str:
    """The strictest Pod Security Standards level that admits the stack's pods: "baseline" (the
    capabilities they add are on its list, no host namespace, port or privilege), unless they
    mount the node cache, a hostPath volume, which only "privileged" admits: a stack of kind all,
    on node pools of its own. Not "restricted": the start-up script runs as root."""
    return "privileged" if owns_pools(cfg) else "baseline"


def namespace_labels(cfg: StackConfig) -> dict[str, str]:
    """On a namespace a stack of kind all creates: the Pod Security level its pods need,
    enforced by the admission controller."""
    return {POD_SECURITY_ENFORCE: pod_security_level(cfg)}


NETWORK_POLICY_API_VERSION = "networking.k8s.io/v1"
TEAM_NETWORK_POLICY = "multislice-team-isolation"
# Addresses a pod may reach outside its namespace, and why:
# - cluster DNS: kube-dns' pods (kube-system, k8s-app=kube-dns), or NodeLocal DNSCache's
#   address on the node, port 53;
# - the GKE metadata server, where Workload Identity's tokens come from: 169.254.169.254 on TCP
#   80 and 8080 with Dataplane V2, 169.254.169.252 on TCP 987 and 988 otherwise (GKE from
#   1.21); both are listed, so the policy holds on either dataplane;
# - Google APIs (the bucket: launch spec, archive, environment, checkpoints, logs) on TCP 443
#   at any address outside the private ranges, where other teams' pods, nodes and services are.
DNS_SELECTOR = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name":
                                                      "kube-system"}},
                "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}
NODE_LOCAL_DNS = "169.254.20.10/32"
METADATA_SERVERS = {"169.254.169.254/32": (80, 8080), "169.254.169.252/32": (987, 988)}
PRIVATE_RANGES = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10",
                  "169.254.0.0/16")


def team_network_policy(namespace: str, labels: dict[str, str]) -> dict[str, Any]:
    """A team namespace's default deny: its pods take connections only from pods of the same
    namespace (a JobSet's coordinator, megascale and collective ports, whichever a JAX release
    uses), and reach only those, cluster DNS, the metadata server and Google APIs. Kubernetes
    allows a connection only when the source's egress and the destination's ingress both do."""
    dns_ports = [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]
    return {
        "apiVersion": NETWORK_POLICY_API_VERSION, "kind": "NetworkPolicy",
        "metadata": {"name": TEAM_NETWORK_POLICY, "namespace": namespace, "labels": labels},
        "spec": {
            "podSelector": {},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": [{"podSelector": {}}]}],
            "egress": [
                {"to": [{"podSelector": {}}]},
                {"to": [DNS_SELECTOR, {"ipBlock": {"cidr": NODE_LOCAL_DNS}}],
                 "ports": dns_ports},
                *({"to": [{"ipBlock": {"cidr": cidr}}],
                   "ports": [{"protocol": "TCP", "port": port} for port in ports]}
                  for cidr, ports in METADATA_SERVERS.items()),
                {"to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": list(PRIVATE_RANGES)}}],
                 "ports": [{"protocol": "TCP", "port": 443}]},
            ],
        },
    }


def team_queue(cfg: StackConfig) -> str:
    assert cfg.gke is not None
    return cfg.gke.local_queue or DEFAULT_TEAM_QUEUE


def _flavor(cfg: StackConfig, name: str, shape_name: str | None) -> dict[str, Any]:
    """The ResourceFlavor of a shape's TPU nodes: their node labels, and on a capacity stack's
    pools (tainted: pools_tainted) the taint, which Kueue admits onto only pod sets that
    tolerate it or that its own tolerations cover, and the toleration it adds to the pods of
    what it admitted, and only to those."""
    taints = ({"nodeTaints": [{"key": STACK_TAINT_KEY, "value": cfg.names.jobset,
                               "effect": "NoSchedule"}],
               "tolerations": [capacity_toleration(cfg)]}
              if cfg.gke is not None and cfg.gke.kind == "capacity" else {})
    return {"apiVersion": KUEUE_API_VERSION, "kind": "ResourceFlavor",
            "metadata": {"name": name, "labels": cfg.owner_labels()},
            "spec": {"nodeLabels": pool_selector(cfg, shape_name), **taints}}


def _cluster_queue(cfg: StackConfig, name: str, namespaces: dict[str, Any],
                   quotas: list[dict[str, Any]], **policy: Any) -> dict[str, Any]:
    """A ClusterQueue of google.com/tpu: `quotas` are its flavors' ({name, resources})."""
    return {"apiVersion": KUEUE_API_VERSION, "kind": "ClusterQueue",
            "metadata": {"name": name, "labels": cfg.owner_labels()},
            "spec": {"namespaceSelector": namespaces, **policy, "resourceGroups": [
                {"coveredResources": [TPU_RESOURCE], "flavors": quotas}]}}


def _tpu(chips: int, **limits: int | None) -> list[dict[str, Any]]:
    return [{"name": TPU_RESOURCE, "nominalQuota": chips,
             **{k: v for k, v in limits.items() if v is not None}}]


def _namespaces(*names: str) -> dict[str, Any]:
    return {"matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "In",
                                  "values": list(names)}]}


ADMISSION_API_VERSION = "admissionregistration.k8s.io/v1"  # ValidatingAdmissionPolicy: GA, 1.30
# Who may write a toleration of the capacity's taint into a team namespace's workloads: Kueue
# (it injects the flavor's tolerations into an admitted JobSet), and the controllers that copy
# a template into what they create (JobSet's into Jobs; kube-system's Job, ReplicaSet and others
# into Pods). Their service accounts as the kept manifests (infra/k8s/) install them.
KUEUE_CONTROLLER = "system:serviceaccount:kueue-system:kueue-controller-manager"
JOBSET_CONTROLLER = "system:serviceaccount:jobset-system:jobset-controller-manager"
KUBE_SYSTEM_ACCOUNTS = "system:serviceaccount:kube-system:"
# Every built-in kind with a pod template, and JobSet, with where its pod specs are (CEL).
_POD_SPECS = (
    "object.kind == 'Pod' ? [object.spec] : "
    "object.kind == 'PodTemplate' ? [object.template.spec] : "
    "object.kind == 'CronJob' ? [object.spec.jobTemplate.spec.template.spec] : "
    "object.kind == 'JobSet' ? object.spec.replicatedJobs.map(r, r.template.spec.template.spec) : "
    "[object.spec.template.spec]")
_WORKLOAD_RULES = (("", ("pods", "podtemplates", "replicationcontrollers")),
                   ("apps", ("deployments", "replicasets", "statefulsets", "daemonsets")),
                   ("batch", ("jobs", "cronjobs")), ("jobset.x-k8s.io", ("jobsets",)))


def toleration_guard(cfg: StackConfig) -> list[dict[str, Any]]:
    """A ValidatingAdmissionPolicy and its binding to the team namespaces: no one but Kueue and
    the controllers that copy templates may add a toleration of the capacity's taint (or one
    that tolerates every taint) to a workload there, so only what Kueue admitted gets a node of
    the shared pools. An update may keep what Kueue added; it may not add one."""
    assert cfg.gke is not None
    name = f"{cfg.names.jobset}-queue-only-tolerations"
    matches = ("(has(t.key) && t.key == '" + STACK_TAINT_KEY + "') || "
               "((!has(t.key) || t.key == '') && has(t.operator) && t.operator == 'Exists')")
    old_specs = _POD_SPECS.replace("object", "oldObject")
    return [
        {"apiVersion": ADMISSION_API_VERSION, "kind": "ValidatingAdmissionPolicy",
         "metadata": {"name": name, "labels": cfg.owner_labels()},
         "spec": {
             "failurePolicy": "Fail",
             "matchConstraints": {"resourceRules": [
                 {"apiGroups": [group], "apiVersions": ["*"], "resources": list(resources),
                  "operations": ["CREATE", "UPDATE"]} for group, resources in _WORKLOAD_RULES]},
             "matchConditions": [{
                 "name": "not-a-controller-that-copies-an-admitted-template",
                 "expression": f"!(request.userInfo.username in ['{KUEUE_CONTROLLER}', "
                               f"'{JOBSET_CONTROLLER}']) && !request.userInfo.username."
                               f"startsWith('{KUBE_SYSTEM_ACCOUNTS}')"}],
             "variables": [
                 {"name": "specs", "expression": _POD_SPECS},
                 {"name": "oldSpecs",
                  "expression": f"oldObject == null ? [] : ({old_specs})"}],
             "validations": [{
                 "expression": f"variables.specs.all(s, !has(s.tolerations) || "
                               f"s.tolerations.all(t, !({matches}) || variables.oldSpecs.exists("
                               f"o, has(o.tolerations) && t in o.tolerations)))",
                 "message": f"only workloads that Kueue admitted may tolerate the taint "
                            f"{STACK_TAINT_KEY} of {cfg.names.jobset}'s shared TPU pools (or "
                            "tolerate every taint): remove the toleration and name your "
                            "namespace's LocalQueue (label kueue.x-k8s.io/queue-name)",
                 "reason": "Forbidden"}]}},
        {"apiVersion": ADMISSION_API_VERSION, "kind": "ValidatingAdmissionPolicyBinding",
         "metadata": {"name": name, "labels": cfg.owner_labels()},
         "spec": {"policyName": name, "validationActions": ["Deny"],
                  "matchResources": {"namespaceSelector": _namespaces(*cfg.gke.team_names)}}},
    ]


def flavor_name(cfg: StackConfig, shape_name: str | None) -> str:
    return f"{cfg.names.jobset}-{shape_name}" if shape_name else f"{cfg.names.jobset}-tpu"


def shape_queue(cfg: StackConfig, shape_name: str | None) -> str:
    """A team's LocalQueue of a shape: named by the shape, or `team_queue` for the one shape."""
    return shape_name or team_queue(cfg)


def team_cluster_queue(cfg: StackConfig, team: str, shape_name: str | None) -> str:
    return f"{cfg.names.jobset}-{team}-{shape_queue(cfg, shape_name)}"


def capacity_objects(cfg: StackConfig) -> list[dict[str, Any]]:
    """A capacity stack's Kueue objects (Kueue's "Administer cluster quotas", "Cohort",
    "Preemption" and "Workload priority"): a ResourceFlavor per shape; with `gke.teams`, a
    ClusterQueue per team and shape in the stack's cohort, whose nominal quota is the team's,
    borrowing and lending within the limits it sets, reclaiming its quota from borrowers and
    preempting lower priorities within it, and a LocalQueue per shape in the team's namespace;
    without, one ClusterQueue of every chip open to `team_namespaces` and a LocalQueue in each.
    Then a default-deny NetworkPolicy per team namespace and the priority classes."""
    assert cfg.gke is not None
    n = cfg.names
    labels = cfg.toolkit_labels()
    shapes = capacity_shapes(cfg)
    objects = [_flavor(shaped, flavor_name(cfg, name), name) for name, shaped in shapes]
    if cfg.gke.teams:
        for team, quota in cfg.gke.teams.items():
            for name, _ in shapes:
                key = name or shape_queue(cfg, None)
                if key not in quota.quota:
                    continue
                queue = team_cluster_queue(cfg, team, name)
                objects.append(_cluster_queue(
                    cfg, queue, _namespaces(team), [{"name": flavor_name(cfg, name),
                                                      "resources": _tpu(
                        quota.quota[key], borrowingLimit=quota.borrowing_limit.get(key),
                        lendingLimit=quota.lending_limit.get(key))}],
                    cohortName=n.jobset, queueingStrategy="BestEffortFIFO",
                    preemption={"reclaimWithinCohort": "Any",
                                "withinClusterQueue": "LowerPriority"}))
                objects.append({"apiVersion": KUEUE_API_VERSION, "kind": "LocalQueue",
                                "metadata": {"name": shape_queue(cfg, name), "namespace": team,
                                             "labels": labels},
                                "spec": {"clusterQueue": queue}})
    else:
        objects.append(_cluster_queue(
            cfg, n.jobset, _namespaces(*cfg.gke.team_namespaces),
            [{"name": flavor_name(cfg, name), "resources": _tpu(shape_chips(shaped))}
             for name, shaped in shapes],
            queueingStrategy="BestEffortFIFO", preemption={"withinClusterQueue": "LowerPriority"}))
        objects += [{"apiVersion": KUEUE_API_VERSION, "kind": "LocalQueue",
                     "metadata": {"name": team_queue(cfg), "namespace": team, "labels": labels},
                     "spec": {"clusterQueue": n.jobset}} for team in cfg.gke.team_namespaces]
    # The guard names the controllers' accounts as the kept manifests install them: only where
    # this stack installs both (an admin's may run under other names, and would be refused).
    guard = toleration_guard(cfg) if all(cfg.gke.installs().values()) else []
    return [
        *objects,
        *guard,
        *(team_network_policy(team, labels) for team in cfg.gke.team_names),
        *({"apiVersion": KUEUE_API_VERSION, "kind": "WorkloadPriorityClass",
           "metadata": {"name": name, "labels": labels}, "value": value,
           "description": f"{name}: a team's jobs on {n.jobset}'s TPU pools"}
          for name, value in sorted(cfg.gke.priority_classes.items())),
    ]


def kueue_objects(cfg: StackConfig) -> list[dict[str, Any]]:
    """With gke.queueing: the ResourceFlavor of the slices' TPU nodes (their node labels), a
    ClusterQueue admitting exactly this job's chips of it, and the LocalQueue the JobSet names
    (Kueue's "Run a JobSet" and "Administer cluster quotas" docs)."""
    n = cfg.names
    return [
        _flavor(cfg, flavor_name(cfg, None), None),
        _cluster_queue(cfg, n.jobset,
                       {"matchLabels": {"kubernetes.io/metadata.name": namespace(cfg)}},
                       [{"name": flavor_name(cfg, None), "resources": _tpu(shape_chips(cfg))}]),
        {"apiVersion": KUEUE_API_VERSION, "kind": "LocalQueue",
         "metadata": {"name": n.jobset, "namespace": namespace(cfg),
                      "labels": cfg.toolkit_labels()},
         "spec": {"clusterQueue": n.jobset}},
    ]


def queue_labels(cfg: StackConfig) -> dict[str, str]:
    """The JobSet's Kueue labels: the LocalQueue that admits it (the stack's own with
    gke.queueing, the admin's with gke.local_queue) and its WorkloadPriorityClass."""
    assert cfg.gke is not None
    queue = cfg.names.jobset if cfg.gke.queueing else cfg.gke.local_queue
    return {**({QUEUE_NAME_LABEL: queue} if queue else {}),
            **({PRIORITY_CLASS_LABEL: cfg.gke.priority_class} if cfg.gke.priority_class else {})}


def launch_spec_sha256(text: str) -> str:
    """The launch spec object's digest, as the JobSet's pods carry it."""
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()


def jobset(cfg: StackConfig, launch_spec_sha256: str) -> dict[str, Any]:
    """The workload: one replicated job of `slices` Jobs, one pod per node of a slice, running
    the launch spec whose digest is `launch_spec_sha256` (LAUNCH_SPEC_ANNOTATION)."""
    assert cfg.gke is not None
    shape = gke_slice(cfg.topology)
    n = cfg.names
    labels = cfg.toolkit_labels()  # GCP label values need not be Kubernetes label values
    own_nodes = owns_pools(cfg)
    capabilities = ROOT_CAPABILITIES if cfg.trainer.run_as == "root" else RUN_AS_CAPABILITIES
    pod_spec: dict[str, Any] = {
        "serviceAccountName": n.k8s_service_account,
        # Workload Identity's metadata server asks for the KSA's token itself: nothing in the
        # pod talks to the Kubernetes API, so no token is mounted for it to find.
        "automountServiceAccountToken": False,
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        "restartPolicy": "Never",  # a podFailurePolicy requires it; JobSet restarts the slices
        "nodeSelector": pool_selector(cfg),
        "containers": [{
            "name": CONTAINER,
            "image": cfg.gke.image,
            "command": ["/bin/bash", f"{BOOT_DIR}/startup.sh"],
            "env": [
                {"name": "MULTISLICE_LAUNCH_SPEC_URI", "value": n.launch_spec_uri},
                {"name": "MULTISLICE_LAUNCH_PY", "value": f"{BOOT_DIR}/launch.py"},
                *megascale_env(n.jobset),
            ],
            "resources": {"limits": {TPU_RESOURCE: shape.chips_per_node},
                          "requests": {TPU_RESOURCE: shape.chips_per_node}},
            # The TPU devices come with the google.com/tpu request (GKE's device plugin), with
            # no privilege and no capability (ROOT_CAPABILITIES). Every capability is dropped
            # but a run_as user's set-up's, no process gains privileges (setuid files), and the
            # runtime's seccomp filter applies: Pod Security "baseline" admits the pod.
            "securityContext": {
                "allowPrivilegeEscalation": False,
                "capabilities": {"drop": ["ALL"], "add": list(capabilities)},
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "volumeMounts": [{"name": "boot", "mountPath": BOOT_DIR, "readOnly": True},
                             {"name": "dshm", "mountPath": "/dev/shm"},
                             *([{"name": "node-cache", "mountPath": NODE_CACHE_MOUNT}]
                               if own_nodes else [])],
        }],
        # A container's /dev/shm is 64 MiB unless a memory volume replaces it; data loader
        # workers and the runtime share memory through it (xpk mounts the same).
        # TPU nodes may carry a google.com/tpu taint: tolerate it whatever its effect; and the
        # stack's own pools carry its taint, which only its pods tolerate.
        "tolerations": [{"key": TPU_RESOURCE, "operator": "Exists"},
                        *([capacity_toleration(cfg)] if own_nodes else [])],
        # On a stack's own nodes, its own directory keeps the unpacked environment (checked by
        # content against the spec's digest at every start) and the compile cache across its
        # pods; on an admin's nodes, which other teams' pods share, nothing is kept (the pod's
        # own filesystem: the environment is fetched and unpacked at every start).
        "volumes": [{"name": "boot", "configMap": {"name": n.boot_config_map}},
                    {"name": "dshm", "emptyDir": {"medium": "Memory"}},
                    *([{"name": "node-cache",
                        "hostPath": {"path": node_cache_path(cfg), "type": "DirectoryOrCreate"}}]
                      if own_nodes else [])],
        # The trainer saves at the next step boundary on SIGTERM (exit 42); give it the time the
        # TPU VMs' startup script gives it before a kill.
        "terminationGracePeriodSeconds": 900,
    }
    job_spec = {
        "parallelism": shape.nodes,
        "completions": shape.nodes,
        "completionMode": "Indexed",
        "backoffLimit": 0,  # one pod down is the slice down: JobSet restarts the whole job
        # The Job's failure message names the index of the rule that matched; the JobSet's
        # failure policy tells the two apart by it (DISRUPTION_RULE, DETERMINISTIC_EXIT_RULE).
        "podFailurePolicy": {"rules": [
            {"action": "FailJob",
             "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            {"action": "FailJob",
             "onExitCodes": {"containerName": CONTAINER, "operator": "In",
                             "values": list(DETERMINISTIC_EXIT_CODES)}},
        ]},
        "template": {"metadata": {"labels": labels,
                                  "annotations": {LAUNCH_SPEC_ANNOTATION: launch_spec_sha256}},
                     "spec": pod_spec},
    }
    return {
        "apiVersion": JOBSET_API_VERSION,
        "kind": "JobSet",
        "metadata": {
            "name": n.jobset,
            "namespace": namespace(cfg),
            "labels": {**labels, **queue_labels(cfg)},
            "annotations": {EXCLUSIVE_TOPOLOGY: NODE_POOL_LABEL},
        },
        "spec": {
            "failurePolicy": {
                "maxRestarts": cfg.trainer.max_restarts,
                # The webhook allows rule names of letters, digits and _,: only (no hyphen).
                "rules": [
                    {"name": "disruption", "action": "RestartJobSetAndIgnoreMaxRestarts",
                     "onJobFailureReasons": ["PodFailurePolicy"],
                     "onJobFailureMessagePatterns": [_rule_message(DISRUPTION_RULE)]},
                    {"name": "deterministic_exit", "action": "FailJobSet",
                     "onJobFailureReasons": ["PodFailurePolicy"],
                     "onJobFailureMessagePatterns": [_rule_message(DETERMINISTIC_EXIT_RULE)]},
                ],
            },
            "replicatedJobs": [{
                "name": REPLICATED_JOB,
                "replicas": cfg.slices,
                "template": {"metadata": {"labels": labels}, "spec": job_spec},
            }],
        },
    }


# ---- what the offline render and the tests answer for this orchestration's cloud reads ----


def mock_call_result(token: str, args: dict[str, Any]) -> dict[str, Any]:
    """What the offline render and the tests answer for the two data sources this module reads:
    an existing cluster (placeholder endpoint and CA) and the deployer's token (a placeholder)."""
    if token == "gcp:container/getCluster:getCluster":
        return {"name": args.get("name"), "location": args.get("location"),
                "endpoint": "cluster-endpoint.invalid",
                "masterAuths": [{"clusterCaCertificate": "<cluster CA>"}],
                "enableAutopilot": False,
                "workloadIdentityConfigs": [{"workloadPool": f"{args.get('project')}.svc.id.goog"}],
                "masterVersion": "<the cluster's GKE version>"}
    if token == "gcp:organizations/getClientConfig:getClientConfig":
        return {"accessToken": "<deployer access token>"}
    return {}


def mock_resource_outputs(typ: str, inputs: dict[str, Any]) -> dict[str, Any]:
    """The outputs a created cluster adds to its inputs, for the same mocks."""
    if typ == "gcp:container/cluster:Cluster":
        return {"endpoint": "cluster-endpoint.invalid",
                "masterAuth": {"clusterCaCertificate": "<cluster CA>"}}
    return {}
