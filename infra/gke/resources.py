"""Orchestration ``gke``: the three kinds of GKE stack, each composed of the same parts.

- ``GkeSlices`` (gke.kind ``all``, a team that owns its project): the cluster it creates or an
  existing one, the nodes' service account, one TPU node pool per slice, the controllers it
  installs, and the workload.
- ``GkeCapacity`` (gke.kind ``capacity``, a platform team): the cluster or an existing one, the
  nodes' account, the pools, the controllers, and the queue of the pools: a ClusterQueue whose
  quota is every pool's chips, a LocalQueue in each team namespace (created here, labelled with
  the Pod Security level the pods need), WorkloadPriorityClasses.
- ``GkeWorkload`` (gke.kind ``workload``, an experiment on someone else's capacity): only the
  workload, in the admin's namespace of a cluster in any project. No node pool, no namespace,
  nothing cluster-scoped, no grant in the cluster's project: its pods land on the admin's pools
  through the GKE TPU labels, JobSet's exclusive placement (one slice a pool) and the admin's
  Kueue ResourceFlavor when they join a queue.

The parts: infra/gke/cluster.py (the cluster), pools.py (the capacity), controllers.py (JobSet
and Kueue, retained), kube.py (the providers), workload.py (the experiment's objects); every
object's content comes from infra/gke/capacity.py and infra/gke/manifest.py (pure), and
infra/gke/kinds.py composes them by kind.

A code or trainer change rewrites the launch spec object: a running JobSet's pods restart their
trainers on it in place, and the JobSet (its Workload, its place in the queue) stays; once a run
has ended, the new spec replaces the JobSet (a new run on the same node pools, resumed from the
last checkpoint; infra/gke/live_run.py). A change of the slices' shape replaces the pools.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_gcp as gcp
import pulumi_kubernetes as k8s

from infra.gke import cluster as gke_cluster
from infra.gke import controllers
from infra.gke.kube import ClusterAccess, provider
from infra.gke.pools import node_identity, tpu_node_pools, workload_policies
from infra.gke.workload import WorkloadArgs, declare


@dataclass
class ClusterArgs:
    """The cluster of a stack that owns capacity: a NewCluster to create, or an existing one."""

    project: str
    name: str
    location: str
    new: gke_cluster.NewCluster | None = None
    check: pulumi.Resource | None = None
    """An existing cluster's ClusterCheck (infra/gke/cluster_check.py)."""


@dataclass
class CapacityArgs:
    """What a stack that owns capacity creates besides the workload."""

    cluster: ClusterArgs
    node_pools: list[dict[str, Any]]
    """One gcp.container.NodePool's inputs per slice, in slice order."""
    node_account_id: str
    image_repository: str | None = None
    """projects/P/locations/L/repositories/R when the pods' image is in Artifact Registry."""
    deployer: str | None = None
    workload_policies: list[dict[str, Any]] = field(default_factory=list)
    """gcp.compute.ResourcePolicy inputs the pools name (TPU7x: infra/gke/capacity.py)."""
    install_jobset: bool = True
    install_kueue: bool = False
    queue_objects: list[dict[str, Any]] = field(default_factory=list)
    """A capacity stack's queue: ResourceFlavor, ClusterQueue, LocalQueues,
    WorkloadPriorityClasses (infra/gke/manifest.py capacity_objects)."""
    team_namespaces: list[str] = field(default_factory=list)
    """The team namespaces the stack creates: only on a cluster it creates (an existing
    cluster's are the platform's, checked at preview); retained on destroy."""
    namespace_labels: dict[str, str] = field(default_factory=dict)


class _OwnedCapacity:
    """The cluster, pools and controllers of a stack that owns them, declared under `parent`."""

    def __init__(self, name: str, args: CapacityArgs, parent: pulumi.ComponentResource) -> None:
        self.identity = node_identity(args.cluster.project, args.node_account_id,
                                      args.image_repository, args.deployer, parent)
        spec = args.cluster.new
        if spec is not None:
            spec.node_account_email = self.identity.account.email
            spec.installed_manifests = list(self.manifests(args).values())
            self.access: ClusterAccess = gke_cluster.create(spec, parent, [])
        else:
            self.access = gke_cluster.existing(args.cluster.name, args.cluster.location,
                                               args.cluster.project, args.cluster.check)
        policies = workload_policies(args.workload_policies, parent)
        self.node_pools = tpu_node_pools(
            args.node_pools, self.access.ref, parent,
            [*self.access.ready, self.identity.account, *self.identity.grants, *policies])
        self.own = provider(name, self.access, parent)
        # Upserts: the controllers a second stack applies again, and a stack's own namespace
        # that a destroy retained (preview refuses one that is not the stack's).
        self.adopting = provider(name, self.access, parent, shared=True)
        chosen = self.manifests(args)
        self.controllers = controllers.install(name, chosen, self.adopting, parent) \
            if chosen else []

    @staticmethod
    def manifests(args: CapacityArgs) -> dict[str, str]:
        return controllers.manifests(args.install_jobset, args.install_kueue)


class GkeSlices(pulumi.ComponentResource):
    """gke.kind all: capacity and workload of one experiment."""

    node_pools: list[gcp.container.NodePool]
    jobset: k8s.apiextensions.CustomResource

    def __init__(self, name: str, capacity: CapacityArgs, workload: WorkloadArgs,
                 opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("multislice:infra:GkeSlices", name, None, opts)
        owned = _OwnedCapacity(name, capacity, self)
        self.node_pools = owned.node_pools
        self.jobset = declare(workload, owned.own, self, owned.access,
                              owned.controllers, owned.node_pools, owned.adopting)
        self.register_outputs({"node_pools": [p.name for p in self.node_pools],
                               "node_account": owned.identity.account.email,
                               "jobset": workload.jobset["metadata"]["name"]})


class GkeCapacity(pulumi.ComponentResource):
    """gke.kind capacity: the pools, controllers and queue teams' workload stacks run on."""

    node_pools: list[gcp.container.NodePool]

    def __init__(self, name: str, args: CapacityArgs,
                 opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("multislice:infra:GkeCapacity", name, None, opts)
        owned = _OwnedCapacity(name, args, self)
        self.node_pools = owned.node_pools
        # Team namespaces outlive the stack and every team's objects in them: retained on
        # destroy and when a team leaves the list; two capacity stacks may serve one team.
        kept = pulumi.ResourceOptions(parent=self, provider=owned.own, retain_on_delete=True)
        namespaces = [k8s.core.v1.Namespace(
            team, metadata={"name": team, "labels": args.namespace_labels}, opts=kept)
            for team in args.team_namespaces]
        after = pulumi.ResourceOptions(parent=self, provider=owned.own,
                                       depends_on=[*owned.controllers, *namespaces])
        for obj in args.queue_objects:
            logical = f"{obj['kind'].lower()}-{obj['metadata'].get('namespace', '')}" \
                      f"{'-' if obj['metadata'].get('namespace') else ''}{obj['metadata']['name']}"
            if obj["kind"] == "NetworkPolicy":
                k8s.networking.v1.NetworkPolicy(
                    logical, metadata=obj["metadata"], spec=obj["spec"], opts=after)
            elif obj["kind"] == "ValidatingAdmissionPolicy":
                k8s.admissionregistration.v1.ValidatingAdmissionPolicy(
                    logical, metadata=obj["metadata"], spec=obj["spec"], opts=after)
            elif obj["kind"] == "ValidatingAdmissionPolicyBinding":
                k8s.admissionregistration.v1.ValidatingAdmissionPolicyBinding(
                    logical, metadata=obj["metadata"], spec=obj["spec"], opts=after)
            elif "spec" in obj:
                k8s.apiextensions.CustomResource(
                    logical, api_version=obj["apiVersion"], kind=obj["kind"],
                    metadata=obj["metadata"], spec=obj["spec"], opts=after)
            else:  # WorkloadPriorityClass: value and description, no spec
                k8s.yaml.v2.ConfigGroup(logical, objs=[obj], opts=after)
        self.register_outputs({"node_pools": [p.name for p in self.node_pools],
                               "node_account": owned.identity.account.email})


class GkeWorkload(pulumi.ComponentResource):
    """gke.kind workload: the experiment on an existing cluster's capacity, nothing else."""

    jobset: k8s.apiextensions.CustomResource

    def __init__(self, name: str, cluster: ClusterArgs, workload: WorkloadArgs,
                 opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("multislice:infra:GkeWorkload", name, None, opts)
        access = gke_cluster.existing(cluster.name, cluster.location, cluster.project,
                                      cluster.check)
        self.jobset = declare(workload, provider(name, access, self), self, access, [], [])
        self.register_outputs({"jobset": workload.jobset["metadata"]["name"]})
