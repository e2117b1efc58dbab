"""The checks of orchestration gke: the ``multislice:gke`` keys, and the stack's other keys as GKE
node pools and a JobSet take them."""

from __future__ import annotations

import contextlib
import ipaddress
import re

from infra.gke.k8s_names import (
    CLUSTER_NAMESPACES,
    is_label_key_name,
    is_label_value,
    is_namespace_name,
)
from infra.gke.manifest import image_repository
from infra.gke.names import name_problems
from infra.gke.topology import GkeTopologyError, gke_slice
from infra.stack_config.schema import SHAPE_NAME, StackConfig
from infra.stack_config.topology import SliceTopology

# GKE "About flex-start provisioning mode" (cloud.google.com/kubernetes-engine/docs/concepts/
# provisioning-model, read 2026-12): TPUs need GKE 1.33.0-gke.1712000 or later, in the zones it
# lists; TPU v3 and v4 are not supported.
FLEX_START_UNSUPPORTED_FAMILIES = ("v4",)
# A container image pinned by digest: a tag can move under a running job, a digest cannot.
# An image reference as the distribution spec's grammar has it (docker/distribution reference):
# an optional registry host[:port]/, path components of lowercase alphanumerics joined by
# separators, an optional tag, and the digest this toolkit requires.
_REGISTRY = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*(?::[0-9]+)?/)?"
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_PINNED_IMAGE_RE = re.compile(rf"^{_REGISTRY}{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
                              r"(?::[\w][\w.-]{0,127})?@sha256:[0-9a-f]{64}\Z")
# A GKE cluster name (GKE's own rule: a lowercase letter, then at most 39 lowercase letters,
# digits or hyphens, not ending in a hyphen).
_GKE_CLUSTER_NAME_RE = re.compile(r"^[a-z](?:[-a-z0-9]{0,38}[a-z0-9])?\Z")
# Namespaces a stack's workload may not take: Kubernetes reserves kube-*, GKE manages gke-*
# (and gmp-* for its managed Prometheus), and the controllers this toolkit installs own theirs
# (the Namespace objects of infra/k8s/*.yaml; tests/infra/test_gke.py checks the list).
RESERVED_NAMESPACE_PREFIXES = ("kube-", "gke-", "gmp-")
CONTROLLER_NAMESPACES = ("jobset-system", "kueue-system")
# A created GKE cluster's control plane range (private_cluster_config.master_ipv4_cidr_block):
# fixed, so that the firewall rule for the webhooks (infra/gke/webhooks.py) names it at preview.
GKE_CONTROL_PLANE_CIDR = "172.16.0.0/28"
_CLUSTER_RE = re.compile(
    r"^projects/(?P<project>[^/]+)/locations/(?P<location>[^/]+)/clusters/(?P<name>[^/]+)\Z")

# Keys of a TPU-VM stack that mean nothing to GKE node pools: refused by name, not ignored.
_TPU_VM_ONLY = {
    "runtime_version": "GKE chooses the TPU node image",
    "valid_until": "a queueing window is a queued-resource setting",
    "valid_after": "a queueing window is a queued-resource setting",
    "wait_for_active_s": "node pools are created by GKE, not waited for by this toolkit",
    "ssh_from_iap": "GKE nodes are reached with kubectl, not SSH",
    "network": "a GKE stack's nodes use its cluster's network",
    "secure_boot": "a created cluster's node pools always boot with Secure Boot; an existing "
                   "cluster's are its admin's",
    "external_ips": "GKE nodes get no external IP from this toolkit: a created cluster's are "
                    "private behind the stack's Cloud NAT; an existing cluster's egress is its "
                    "admin's",
}


# What each kind of GKE stack does not own, refused by name (StackConfig keys, then gke keys).
_NOT_A_WORKLOADS = {
    "capacity": "the admin's node pools decide it",
    "reservation_name": "the admin's node pools consume reservations",
}
_NOT_A_WORKLOADS_GKE = {
    "create_cluster": "a workload stack runs on an existing cluster",
    "release_channel": "the cluster is the admin's",
    "install_jobset": "the controllers are cluster-wide, the admin's",
    "install_kueue": "the controllers are cluster-wide, the admin's",
    "queueing": "queues are the admin's: join one with gke.local_queue",
    "team_namespaces": "a capacity stack's key",
    "priority_classes": "a capacity stack's key",
    "scale_to_zero": "the node pools are the admin's",
    "authorized_networks": "the cluster is the admin's",
    "private_endpoint": "the cluster is the admin's",
    "deletion_protection": "the cluster is the admin's",
}
_NOT_CAPACITYS = ("experiment_dir", "trainer", "bucket_name", "data_buckets", "run_name",
                  "delete_bucket_on_destroy", "adopt_bucket", "soft_delete_days",
                  "storage_retry_s", "spec_poll_s", "python_version")
_NOT_CAPACITYS_GKE = ("namespace", "priority_class", "queueing", "image")


def kind_problems(cfg: StackConfig) -> list[str]:
    """Keys a GKE stack of its kind does not use, refused by name, and what each kind needs."""
    gke = cfg.gke
    assert gke is not None
    problems = []
    if gke.kind == "workload":
        problems += [f"{key}: does not apply to gke.kind 'workload' ({why}); remove it"
                     for key, why in _NOT_A_WORKLOADS.items() if key in cfg.model_fields_set]
        problems += [f"gke.{key}: does not apply to gke.kind 'workload' ({why}); remove it"
                     for key, why in _NOT_A_WORKLOADS_GKE.items()
                     if key in gke.model_fields_set]
        if gke.cluster is None:
            problems.append("gke.cluster: required with gke.kind 'workload': the cluster the "
                            "admin runs, projects/P/locations/L/clusters/NAME")
        if gke.namespace is None:
            problems.append("gke.namespace: required with gke.kind 'workload': the admin's "
                            "namespace the JobSet runs in (a workload stack creates none)")
        if gke.local_queue is None:
            problems.append("gke.local_queue: required with gke.kind 'workload': shared pools "
                            "take only the workloads their queue admitted (they are tainted, "
                            "and only the queue's flavor tolerates the taint), so a JobSet "
                            "without one would never get a node; name your namespace's "
                            "LocalQueue (a capacity stack of this toolkit makes one per "
                            "slice shape, named by it, or one named 'tpu')")
    elif gke.kind == "capacity":
        problems += [f"{key}: does not apply to gke.kind 'capacity' (it runs no experiment: a "
                     "workload stack does); remove it"
                     for key in _NOT_CAPACITYS if key in cfg.model_fields_set]
        problems += [f"gke.{key}: does not apply to gke.kind 'capacity' (a workload stack's "
                     "key); remove it" for key in _NOT_CAPACITYS_GKE if key in gke.model_fields_set]
        if not gke.team_names:
            problems.append("gke.team_namespaces: a capacity stack needs at least one team "
                            "namespace (or gke.teams, with quotas), whose LocalQueue the "
                            "workload stacks join")
        if gke.teams and gke.team_namespaces:
            problems.append("gke.team_namespaces: give the teams once: gke.teams (with "
                            "quotas) or gke.team_namespaces (sharing every chip), not both")
        problems += shape_problems(cfg) + team_problems(cfg)
    else:
        for key in ("team_namespaces", "priority_classes", "shapes", "teams"):
            if key in gke.model_fields_set:
                problems.append(f"gke.{key}: a key of gke.kind 'capacity' (a platform team's "
                                "stack); remove it, or set gke.kind: capacity")
    for ns in gke.team_names:
        if not is_namespace_name(ns) or ns.startswith(RESERVED_NAMESPACE_PREFIXES) or \
                ns in CONTROLLER_NAMESPACES or ns in CLUSTER_NAMESPACES:
            problems.append(f"gke.team_namespaces: {ns!r} is not a namespace a team's jobs may "
                            "have (a DNS label of at most 63 characters, not kube-*, gke-*, "
                            "gmp-*, default or a controller's)")
    for name, value in gke.priority_classes.items():
        if not is_namespace_name(name) or not -(2**31) <= value < 2**31:
            problems.append(f"gke.priority_classes: {name}={value} is not a WorkloadPriorityClass "
                            "(a lowercase DNS name and a 32-bit integer value)")
    if gke.scale_to_zero is False and cfg.capacity == "flex-start":
        problems.append("gke.scale_to_zero: false with capacity 'flex-start': flex-start pools "
                        "always start empty and scale to their whole slice (GKE's flex-start "
                        "mode); remove gke.scale_to_zero")
    if (gke.authorized_networks or gke.private_endpoint) and not gke.create_cluster:
        problems.append("gke.authorized_networks / private_endpoint: settings of a cluster "
                        "create_cluster makes; an existing cluster keeps its own")
    for cidr in gke.authorized_networks:
        try:
            ipaddress.ip_network(cidr, strict=True)
        except ValueError:
            problems.append(f"gke.authorized_networks: {cidr!r} is not a CIDR range (such as "
                            "203.0.113.0/24)")
    if "deletion_protection" in gke.model_fields_set and not gke.create_cluster:
        problems.append("gke.deletion_protection: a setting of a cluster create_cluster makes; "
                        "an existing cluster keeps its own; remove it")
    return problems


_SHAPE_KEYS = ("accelerator_type", "slices", "capacity", "reservation_name")


def shape_problems(cfg: StackConfig) -> list[str]:
    """A capacity stack's gke.shapes: names that fit the pools' names, each a GKE TPU slice
    shape, and no shape key of the stack's own that differs from the first shape."""
    from infra.gke.capacity import capacity_shapes
    from infra.stack_config.topology import parse_accelerator_type

    gke = cfg.gke
    assert gke is not None
    if not gke.shapes:
        return []
    problems = [f"gke.shapes: {name!r} is not a shape name (a lowercase letter, then at most 7 "
                "lowercase letters or digits: it is part of the node pools' names)"
                for name in gke.shapes if not re.match(SHAPE_NAME, name)]
    first = next(iter(gke.shapes.values()))
    problems += [f"{key}: {getattr(cfg, key)!r} is set, but a capacity stack with gke.shapes "
                 f"gives it per shape (the first shape has {getattr(first, key)!r}); remove it"
                 for key in _SHAPE_KEYS if getattr(cfg, key) != getattr(first, key)]
    for name, shaped in capacity_shapes(cfg)[1:]:
        try:
            shape = gke_slice(parse_accelerator_type(shaped.accelerator_type))
        except (ValueError, GkeTopologyError) as exc:
            problems.append(f"gke.shapes.{name}: {exc}")
        else:
            problems += [f"gke.shapes.{name}: {line}" for line in name_problems(
                cfg.stack, cfg.names.jobset, shaped.slices, shape.nodes)]
    return problems


def team_problems(cfg: StackConfig) -> list[str]:
    """gke.teams: quotas of shapes the stack has, in chips that add up to each shape's, and
    limits that Kueue takes (a lending limit within the quota)."""
    from infra.gke.capacity import capacity_shapes, shape_chips, shape_queue

    gke = cfg.gke
    assert gke is not None
    if not gke.teams:
        return []
    shapes = {shape_queue(cfg, name): shaped for name, shaped in capacity_shapes(cfg)}
    problems = []
    for team, quota in gke.teams.items():
        for field in ("quota", "borrowing_limit", "lending_limit"):
            for shape, chips in getattr(quota, field).items():
                if shape not in shapes:
                    problems.append(f"gke.teams.{team}.{field}: shape {shape!r} is not one of "
                                    f"this stack's ({', '.join(shapes)})")
                elif chips < 0:
                    problems.append(f"gke.teams.{team}.{field}.{shape}: {chips} chips; give "
                                    "0 or more")
        for shape, chips in quota.lending_limit.items():
            if chips > quota.quota.get(shape, 0):
                problems.append(f"gke.teams.{team}.lending_limit.{shape}: {chips} chips is more "
                                f"than its quota of {quota.quota.get(shape, 0)}; a team lends "
                                "only what it has")
    for shape, shaped in shapes.items():
        given = sum(q.quota.get(shape, 0) for q in gke.teams.values())
        try:
            have = shape_chips(shaped)
        except (ValueError, GkeTopologyError):
            continue  # not a GKE slice shape: shape_problems says so
        if given != have:
            problems.append(
                f"gke.teams: the teams' quotas of shape {shape!r} add up to {given} chips, and "
                f"its pools have {have} ({shaped.slices} x {shaped.accelerator_type}); give "
                "every chip to a team (a chip no quota holds is never used)")
    return problems


def gke_problems(cfg: StackConfig, topo: SliceTopology | None) -> list[str]:
    """Problems of a stack whose orchestration is gke."""
    problems = [
        f"{key}: does not apply to orchestration 'gke' ({why}); remove it"
        for key, why in _TPU_VM_ONLY.items() if key in cfg.model_fields_set
    ]
    if cfg.capacity == "guaranteed":
        problems.append("capacity: 'guaranteed' is a queued-resource tier; with orchestration "
                        "'gke' use on-demand, spot, reserved or flex-start")
    gke = cfg.gke
    if gke is None:
        return [*problems, "gke: orchestration 'gke' needs multislice:gke with either cluster: "
                "projects/P/locations/L/clusters/NAME (an existing cluster) or create_cluster: "
                "true"]
    problems += kind_problems(cfg)
    if gke.kind == "workload" and gke.cluster is None:
        pass  # named by kind_problems
    elif (gke.cluster is None) == (not gke.create_cluster):
        problems.append(
            f"gke: give exactly one of cluster (an existing cluster) and create_cluster: true; "
            f"got cluster={gke.cluster!r}, create_cluster={gke.create_cluster}")
    elif gke.cluster is not None:
        match = _CLUSTER_RE.match(gke.cluster)
        if match is None:
            problems.append(
                f"gke.cluster: {gke.cluster!r} is not a full cluster resource name; use "
                "projects/PROJECT/locations/LOCATION/clusters/NAME")
        else:
            if not _GKE_CLUSTER_NAME_RE.match(match["name"]):
                problems.append(
                    f"gke.cluster: name {match['name']!r} is not a GKE cluster name (a "
                    "lowercase letter, then at most 39 lowercase letters, digits or hyphens, "
                    "not ending in one); check the name in the console")
            if match["project"] != cfg.project and gke.kind != "workload":
                problems.append(
                    f"gke.cluster: {gke.cluster!r} is in project {match['project']!r}, not the "
                    f"stack's project {cfg.project!r}; the node pools, bucket and service account "
                    "of a stack live in one project (a stack of gke.kind 'workload' runs on a "
                    "cluster of any project: its pools are the admin's)")
            if match["location"] not in (cfg.region, cfg.zone):
                problems.append(
                    f"gke.cluster: {gke.cluster!r} is in {match['location']!r}, but the stack's "
                    f"TPUs are in zone {cfg.zone!r}; use a cluster in region {cfg.region!r} or "
                    f"zone {cfg.zone!r}, or change multislice:zone")
        if "subnet_cidr" in cfg.model_fields_set:
            problems.append("subnet_cidr: does not apply to an existing cluster (its node pools "
                            "use the cluster's network); remove it")
    elif gke.create_cluster:
        with contextlib.suppress(ValueError):  # an unparsable subnet_cidr is named below
            if ipaddress.ip_network(cfg.subnet_cidr, strict=False).overlaps(
                    ipaddress.ip_network(GKE_CONTROL_PLANE_CIDR)):
                problems.append(
                    f"subnet_cidr: {cfg.subnet_cidr!r} overlaps {GKE_CONTROL_PLANE_CIDR}, the "
                    "control plane range of the cluster create_cluster makes; use a range "
                    "outside it, such as the default 10.128.0.0/20")
    if "install_kueue" in gke.model_fields_set and not gke.queueing and gke.kind != "capacity":
        problems.append(f"gke.install_kueue: {gke.install_kueue} is set but gke.queueing is "
                        "false; Kueue is installed only for a queued JobSet: set gke.queueing: "
                        "true, or remove gke.install_kueue")
    if gke.local_queue is not None and gke.queueing:
        problems.append(f"gke.local_queue: {gke.local_queue!r} joins the cluster admin's queue, "
                        "and gke.queueing: true creates the stack's own; choose one")
    if gke.local_queue is not None and gke.namespace is None and gke.kind != "capacity":
        problems.append(f"gke.local_queue: {gke.local_queue!r} is a LocalQueue of a namespace the "
                        "admin made; set gke.namespace to that namespace (the stack then does not "
                        "create it)")
    if gke.priority_class is not None and gke.create_cluster:
        problems.append(f"gke.priority_class: {gke.priority_class!r} names a WorkloadPriorityClass "
                        "the cluster's admin made; a cluster create_cluster makes has none; "
                        "remove it")
    elif gke.priority_class is not None and not gke.queued:
        problems.append(f"gke.priority_class: {gke.priority_class!r} is a Kueue "
                        "WorkloadPriorityClass, which orders queued jobs only; set gke.queueing: "
                        "true or gke.local_queue, or remove it")
    if not _PINNED_IMAGE_RE.fullmatch(gke.image):
        why = ("is not pinned by digest" if "@sha256:" not in gke.image
               else "is not an image reference (whitespace, a scheme, an empty or upper-case "
                    "name?)")
        problems.append(
            f"gke.image: {gke.image!r} {why}; use REGISTRY/NAME[:TAG]@sha256:<64 hex> so every "
            "restart runs the same image")
    if _PINNED_IMAGE_RE.fullmatch(gke.image) and gke.image.split("/", 1)[0].endswith(
            "-docker.pkg.dev") and image_repository(gke.image) is None:
        problems.append(
            f"gke.image: {gke.image!r} is in Artifact Registry but names no repository (the "
            "nodes' reader grant is on a repository); use "
            "LOCATION-docker.pkg.dev/PROJECT/REPOSITORY/IMAGE@sha256:...")
    for key, value, label in (("local_queue", gke.local_queue, "kueue.x-k8s.io/queue-name"),
                              ("priority_class", gke.priority_class,
                               "kueue.x-k8s.io/priority-class")):
        if value is not None and not is_label_value(value):
            problems.append(
                f"gke.{key}: {value[:80]!r} ({len(value)} characters) becomes the JobSet's "
                f"{label} label, whose value Kubernetes allows at most 63 characters of "
                "letters, digits, '-', '_' and '.'; use a shorter name")
    if gke.create_cluster and gke.install_jobset is False:
        problems.append(
            "gke.install_jobset: false on a cluster create_cluster makes: nothing else would "
            "install the JobSet controller, and the stack's JobSet would never run; remove "
            "gke.install_jobset (a created cluster gets it)")
    if gke.namespace is not None and (gke.namespace.startswith(RESERVED_NAMESPACE_PREFIXES)
                                      or gke.namespace in CONTROLLER_NAMESPACES):
        problems.append(
            f"gke.namespace: {gke.namespace!r} is reserved (kube-*, gke-* and gmp-* are the "
            f"cluster's own; {', '.join(CONTROLLER_NAMESPACES)} are the controllers'); use a "
            "namespace of the workload's own, such as the default ms-STACK")
    if gke.cluster is not None and "release_channel" in gke.model_fields_set:
        problems.append(
            f"gke.release_channel: {gke.release_channel!r} has no effect on an existing cluster "
            "(it keeps its own channel; only a cluster create_cluster makes gets this one); "
            "remove it")
    for key, value in cfg.all_labels().items():
        if not is_label_key_name(key) or not is_label_value(value):
            problems.append(
                f"labels: {key}={value!r} becomes a Kubernetes label of the GKE nodes, which "
                "must start and end with a letter or digit (between them letters, digits, '-', "
                "'_' and '.', at most 63); change it")
    if topo is not None:
        try:
            shape = gke_slice(topo)
        except GkeTopologyError as exc:
            problems.append(str(exc))
        else:
            problems += name_problems(cfg.stack, cfg.names.jobset, cfg.slices, shape.nodes)
        if cfg.capacity == "flex-start" and topo.family in FLEX_START_UNSUPPORTED_FAMILIES:
            problems.append(
                f"capacity: 'flex-start' does not run TPU {topo.family} on GKE (GKE's "
                "flex-start provisioning mode: TPU v3 and v4 are not supported); use on-demand, "
                "spot or reserved, or a v5e, v5p or v6e accelerator_type")
    return problems


