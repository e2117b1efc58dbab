"""What every kind of GKE stack shares, as plain data (its namespace, cluster, taint and Pod Security
level, the node labels of its pools), and the workload's JobSet; what a capacity owns (pools,
flavors, queues, team isolation) is infra/gke/capacity.py.

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
    the node outlives them. On a stack's own node pools (kind all, tainted for it alone) two
    hostPath directories of the stack's own: `envs`, where the pod's init container (the same
    start-up script, MULTISLICE_POD_STAGE=environment) installs the environment from the
    deployer's archive (checked by the launch spec's sha256) once per node and lock, mounted
    read-only in the trainer's container, which links it where the venv's paths point after a
    marker check; and `cache`, the trainer's compile cache and local checkpoints. No trainer
    can change what a later pod runs, and a restarted pod pays a marker check, not an unpack
    (GKE Standard allows hostPath; Autopilot does not, and TPU multislice needs Standard). Their
    place is under /var/lib/kubelet, which the node set-up keeps for the kubelet's volumes
    (kubernetes cluster/gce/gci/configure-helper.sh). On an admin's pools (kind workload),
    which other teams' pods share, there is no init container and nothing is kept on the node:
    each pod installs the published environment into its own filesystem (/opt/multislice) and
    never builds one: it stops with the command that publishes it.
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
# On the pods' template: the launch spec this JobSet's run started with. Its pods watch the spec
# object as TPU VMs do and restart their trainers on a new one in place (a step boundary, no new
# pod, the Workload stays admitted), so a later spec leaves this as it was while the JobSet runs
# (infra/gke/live_run.py reads it); a run that has ended (its pods exit 0, the Job and the JobSet
# complete, the nodes are free) watches nothing, and a new spec then takes this annotation with
# it: `pulumi up` replaces the JobSet (a new run on the same node pools).
LAUNCH_SPEC_ANNOTATION = "multislice.dev/launch-spec-sha256"
CONTAINER = "trainer"
BOOT_DIR = "/etc/multislice/boot"  # where the ConfigMap of infra/boot/ is mounted in every pod
NODE_CACHE_ROOT = "/var/lib/kubelet/multislice"  # on the node: outlives the pods (module docstring)
# In the pod: startup.sh's NODE_DIR (MULTISLICE_NODE_CACHE): the compile cache and the local
# checkpoint tier; and NODE_ENVS (MULTISLICE_NODE_ENVS): the environments the pods' init
# container installs, read-only in the trainer's container.
NODE_CACHE_MOUNT = "/var/cache/multislice-node"
NODE_ENVS_MOUNT = "/var/cache/multislice-envs"
INIT_CONTAINER = "environment"
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


def capacity_toleration(cfg: StackConfig) -> dict[str, str]:
    """What tolerates the stack's taint (the pod spec's spelling)."""
    return {"key": STACK_TAINT_KEY, "operator": "Equal", "value": cfg.names.jobset,
            "effect": "NoSchedule"}


JOBSET_REPLICAS_LABEL = "jobset.sigs.k8s.io/replicatedjob-replicas"
JOBSET_JOB_INDEX_LABEL = "jobset.sigs.k8s.io/job-index"
JOBSET_RESTART_ATTEMPT_LABEL = "jobset.sigs.k8s.io/restart-attempt"
JOBSET_UID_LABEL = "jobset.sigs.k8s.io/jobset-uid"  # JobSet's docs: on its Jobs and pods
# GKE cost allocation reports a pod's cost by its namespace and its Kubernetes labels (the
# billing export's k8s-namespace and k8s-label/KEY): who ran it, in which stack and experiment.
TEAM_LABEL = "multislice-team"
EXPERIMENT_LABEL = "multislice-experiment"


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
        # not JAX's: the start-up script's attempt number, in its log lines and log objects,
        # and the JobSet object's UID, so a replaced or recreated JobSet's attempts are named
        # apart (HOST.run-UID.attempt-N.log) and none overwrites another's
        {"name": "MULTISLICE_ATTEMPT", "valueFrom": label(JOBSET_RESTART_ATTEMPT_LABEL)},
        {"name": "MULTISLICE_JOBSET_UID", "valueFrom": label(JOBSET_UID_LABEL)},
    ]


SHAPE_LABEL = "multislice-shape"  # on the nodes of a capacity stack's shape (gke.shapes)


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


def queue_labels(cfg: StackConfig) -> dict[str, str]:
    """The JobSet's Kueue labels: the LocalQueue that admits it (the stack's own with
    gke.queueing, the admin's with gke.local_queue) and its WorkloadPriorityClass."""
    assert cfg.gke is not None
    queue = cfg.names.jobset if cfg.gke.queueing else cfg.gke.local_queue
    return {**({QUEUE_NAME_LABEL: queue} if queue else {}),
            **({PRIORITY_CLASS_LABEL: cfg.gke.priority_class} if cfg.gke.priority_class else {})}


def cost_labels(cfg: StackConfig) -> dict[str, str]:
    """The labels GKE cost allocation reports the JobSet's pods by: the stack, the team (the
    namespace the pods run in: a team's own on shared capacity) and the experiment (the run
    directory's name: the stack, or STACK-RUN_NAME)."""
    return {**cfg.toolkit_labels(), TEAM_LABEL: namespace(cfg),
            EXPERIMENT_LABEL: cfg.names.run_dir.rsplit("/", 1)[-1]}


def launch_spec_sha256(text: str) -> str:
    """The launch spec object's digest, as the JobSet's pods carry it."""
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()


def jobset(cfg: StackConfig, run_spec_sha256: str) -> dict[str, Any]:
    """The workload: one replicated job of `slices` Jobs, one pod per node of a slice, whose run
    started with the launch spec of digest `run_spec_sha256` (LAUNCH_SPEC_ANNOTATION); its pods
    follow the spec object from there."""
    assert cfg.gke is not None
    shape = gke_slice(cfg.topology)
    n = cfg.names
    labels = cost_labels(cfg)  # GCP label values need not be Kubernetes label values
    own_nodes = owns_pools(cfg)
    capabilities = ROOT_CAPABILITIES if cfg.trainer.run_as == "root" else RUN_AS_CAPABILITIES
    env = [
        {"name": "MULTISLICE_LAUNCH_SPEC_URI", "value": n.launch_spec_uri},
        {"name": "MULTISLICE_LAUNCH_PY", "value": f"{BOOT_DIR}/launch.py"},
        *megascale_env(n.jobset),
        *([{"name": "MULTISLICE_NODE_CACHE", "value": NODE_CACHE_MOUNT},
           {"name": "MULTISLICE_NODE_ENVS", "value": NODE_ENVS_MOUNT}] if own_nodes else []),
    ]
    # The TPU devices come with the google.com/tpu request (GKE's device plugin), with no
    # privilege and no capability (ROOT_CAPABILITIES). Every capability is dropped but a
    # run_as user's set-up's, no process gains privileges (setuid files), and the runtime's
    # seccomp filter applies: Pod Security "baseline" admits the pod.
    def security(added: tuple[str, ...]) -> dict[str, Any]:
        return {"allowPrivilegeEscalation": False,
                "capabilities": {"drop": ["ALL"], "add": list(added)},
                "seccompProfile": {"type": "RuntimeDefault"}}

    boot_mount = {"name": "boot", "mountPath": BOOT_DIR, "readOnly": True}
    # On a stack's own nodes, the init container installs the environment onto the node (from
    # the deployer's archive, checked by its sha256), where the trainer's container reads it
    # read-only: no trainer, whatever its dependencies do, changes what a later pod runs, and a
    # restarted pod only checks its marker. The compile cache and local checkpoints are the
    # trainer's, read-write. On an admin's nodes, which other teams' pods share, nothing is
    # kept: each pod fetches and checks the archive into its own filesystem.
    init_containers = [{
        "name": INIT_CONTAINER,
        "image": cfg.gke.image,
        "command": ["/bin/bash", f"{BOOT_DIR}/startup.sh"],
        "env": [*env, {"name": "MULTISLICE_POD_STAGE", "value": "environment"}],
        "securityContext": security(ROOT_CAPABILITIES),
        "volumeMounts": [boot_mount, {"name": "node-envs", "mountPath": NODE_ENVS_MOUNT}],
    }] if own_nodes else []
    pod_spec: dict[str, Any] = {
        "serviceAccountName": n.k8s_service_account,
        # Workload Identity's metadata server asks for the KSA's token itself: nothing in the
        # pod talks to the Kubernetes API, so no token is mounted for it to find.
        "automountServiceAccountToken": False,
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        "restartPolicy": "Never",  # a podFailurePolicy requires it; JobSet restarts the slices
        "nodeSelector": pool_selector(cfg),
        **({"initContainers": init_containers} if init_containers else {}),
        "containers": [{
            "name": CONTAINER,
            "image": cfg.gke.image,
            "command": ["/bin/bash", f"{BOOT_DIR}/startup.sh"],
            "env": env,
            "resources": {"limits": {TPU_RESOURCE: shape.chips_per_node},
                          "requests": {TPU_RESOURCE: shape.chips_per_node}},
            "securityContext": security(capabilities),
            "volumeMounts": [boot_mount,
                             {"name": "dshm", "mountPath": "/dev/shm"},
                             *([{"name": "node-cache", "mountPath": NODE_CACHE_MOUNT},
                                {"name": "node-envs", "mountPath": NODE_ENVS_MOUNT,
                                 "readOnly": True}] if own_nodes else [])],
        }],
        # A container's /dev/shm is 64 MiB unless a memory volume replaces it; data loader
        # workers and the runtime share memory through it (xpk mounts the same).
        # TPU nodes may carry a google.com/tpu taint: tolerate it whatever its effect; and the
        # stack's own pools carry its taint, which only its pods tolerate.
        "tolerations": [{"key": TPU_RESOURCE, "operator": "Exists"},
                        *([capacity_toleration(cfg)] if own_nodes else [])],
        "volumes": [{"name": "boot", "configMap": {"name": n.boot_config_map}},
                    {"name": "dshm", "emptyDir": {"medium": "Memory"}},
                    *([{"name": "node-cache",
                        "hostPath": {"path": f"{node_cache_path(cfg)}/cache",
                                     "type": "DirectoryOrCreate"}},
                       {"name": "node-envs",
                        "hostPath": {"path": f"{node_cache_path(cfg)}/envs",
                                     "type": "DirectoryOrCreate"}}] if own_nodes else [])],
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
                                  "annotations": {LAUNCH_SPEC_ANNOTATION: run_spec_sha256}},
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
            # A finished JobSet (Completed or Failed) is deleted this long after it finished:
            # its pods' logs stay in the bucket, and the next `pulumi up` of a new spec creates
            # the next run (infra/gke/live_run.py).
            "ttlSecondsAfterFinished": cfg.gke.ttl_after_finished_s,
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
