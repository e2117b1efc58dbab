"""What a capacity owns, as plain data: its slice shapes and their TPU node pools (tainted for
it), a Kueue ResourceFlavor per shape, the queues (a ClusterQueue per team and shape in the
stack's cohort, or one of every chip; a LocalQueue in each team namespace), and each team
namespace's isolation (a default-deny NetworkPolicy, and the admission policy that lets only
Kueue give a workload the pools' toleration). A stack of kind all owns its capacity too: its
pools, and with gke.queueing its own queue (kueue_objects).

Pure (no pulumi import), like infra/gke/manifest.py (the vocabulary every kind shares and the
workload's JobSet), so the program, the offline render and the tests build the same objects;
infra/gke/resources.py hands them to pulumi-gcp and pulumi-kubernetes unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from infra.gke.manifest import (
    KUEUE_API_VERSION,
    RESERVATION_KEY,
    SHAPE_LABEL,
    STACK_TAINT_KEY,
    capacity_toleration,
    cluster_location,
    cluster_name,
    namespace,
    owns_pools,
    pool_selector,
    stack_taint,
)
from infra.gke.topology import TPU_RESOURCE, gke_slice

if TYPE_CHECKING:
    from infra.stack_config.schema import StackConfig


def pools_tainted(cfg: StackConfig) -> bool:
    """A stack's own pools (kind all) and a capacity stack's pools carry the stack's taint."""
    return owns_pools(cfg) or (cfg.gke is not None and cfg.gke.kind == "capacity")



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


def workload_policy_name(cfg: StackConfig, shape_name: str | None = None) -> str:
    """The workload policy of a shape's slices (one per topology, as xpk makes them)."""
    return f"{cfg.names.prefix}-{shape_name}-wp" if shape_name else f"{cfg.names.prefix}-wp"


def workload_policies(cfg: StackConfig) -> list[dict[str, Any]]:
    """The workload policies of the stack's shapes that are placed by one (TPU7x): the inputs
    of gcp.compute.ResourcePolicy, in its Python names. GKE's "About Ironwood (TPU7x) in GKE":
    a High throughput workload policy with the slice's accelerator topology, in the node pool's
    project and region, named by the pool's placement policy."""
    out = []
    for name, shaped in capacity_shapes(cfg):
        shape = gke_slice(shaped.topology)
        if shape.workload_policy:
            out.append({"name": workload_policy_name(cfg, name), "project": cfg.project,
                        "region": cfg.region,
                        "description": f"the {shape.topology} TPU slices of {cfg.stack}",
                        "workload_policy": {"type": "HIGH_THROUGHPUT",
                                            "accelerator_topology": shape.topology}})
    return out


def placement_policy(cfg: StackConfig, shape_name: str | None = None) -> dict[str, Any]:
    """A slice pool's placement: COMPACT on the slice's topology, or, for a family placed by a
    workload policy (TPU7x), that policy by name, which replaces the topology."""
    shape = gke_slice(cfg.topology)
    if shape.workload_policy:
        return {"type": "COMPACT", "policy_name": workload_policy_name(cfg, shape_name)}
    return {"type": "COMPACT", "tpu_topology": shape.topology}


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
        "placement_policy": placement_policy(cfg, shape_name),
        "management": {"auto_repair": auto_repair, "auto_upgrade": True},
        "node_config": node_config,
    }



DEFAULT_TEAM_QUEUE = "tpu"  # a capacity stack's LocalQueue in each team namespace

NETWORK_POLICY_API_VERSION = "networking.k8s.io/v1"
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


def team_network_policy(name: str, namespace: str, labels: dict[str, str]) -> dict[str, Any]:
    """A team namespace's default deny: its pods take connections only from pods of the same
    namespace (a JobSet's coordinator, megascale and collective ports, whichever a JAX release
    uses), and reach only those, cluster DNS, the metadata server and Google APIs. Kubernetes
    allows a connection only when the source's egress and the destination's ingress both do."""
    dns_ports = [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]
    return {
        "apiVersion": NETWORK_POLICY_API_VERSION, "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
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
        # named by the stack: two capacity stacks may serve one team (their policies add up)
        *(team_network_policy(f"{n.jobset}-team-isolation", team, labels)
          for team in cfg.gke.team_names),
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
