"""The three kinds of GKE stack composed from what each owns (gke.kind): `create_capacity` (a
platform team's cluster, pools, controllers and queues), `create_experiment` (kind all: its
capacity and its workload; kind workload: the workload alone, on the admin's capacity), and the
preview's check of an existing cluster (`check_existing_cluster`), all called once from
infra/stack.py after the parts every stack shares (APIs, network, bucket, identity). The objects
come from infra/gke/capacity.py (what a capacity owns) and infra/gke/manifest.py (the JobSet and
the names every kind shares); the components from infra/gke/resources.py."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pulumi
import pulumi_gcp as gcp

from infra.gke import capacity as gke_capacity
from infra.gke import manifest as gke_manifest
from infra.gke.cluster import NewCluster
from infra.gke.cluster_check import (
    JOBSET_CRDS,
    KUEUE_CRDS,
    ClusterCheck,
    admin_objects,
    check_inputs,
    owned_objects,
    team_namespace_objects,
    workload_access,
)
from infra.gke.k8s_names import CLUSTER_NAMESPACES
from infra.gke.resources import (
    CapacityArgs,
    ClusterArgs,
    GkeCapacity,
    GkeSlices,
    GkeWorkload,
)
from infra.gke.topology import ACCELERATOR_LABEL, TOPOLOGY_LABEL, gke_slice
from infra.gke.workload import WorkloadArgs

if TYPE_CHECKING:
    from infra.cloud.identity import TrainerIdentity
    from infra.cloud.network import SliceNetwork
    from infra.cloud.services import ProjectServices
    from infra.cloud.storage import ExperimentStorage
    from infra.stack_config.schema import StackConfig


def check_existing_cluster(cfg: StackConfig) -> pulumi.Resource:
    """The existing cluster as the GKE API describes it, checked against what the stack needs,
    and the CRDs of the controllers it does not install."""
    assert cfg.gke is not None and cfg.gke.cluster is not None
    installs = cfg.gke.installs()
    capacity_stack = cfg.gke.kind == "capacity"
    uses_kueue = cfg.gke.queued or capacity_stack
    crds = [*(() if installs["jobset"] else JOBSET_CRDS),
            *(KUEUE_CRDS if uses_kueue and not installs["kueue"] else ())]
    cluster_project = gke_manifest.cluster_project(cfg)
    found = gcp.container.get_cluster(name=gke_manifest.cluster_name(cfg),
                                      location=gke_manifest.cluster_location(cfg),
                                      project=cluster_project)
    named = cfg.gke.namespace is not None and cfg.gke.namespace not in CLUSTER_NAMESPACES
    declares_namespace = (cfg.gke.kind == "all" and cfg.gke.local_queue is None
                          and gke_manifest.namespace(cfg) not in CLUSTER_NAMESPACES)
    shape = gke_slice(cfg.topology)
    # What the stack creates under names made from its stack name alone: on a shared cluster
    # another team's stack of that name may hold them (refused at preview, naming the owner).
    owned = (owned_objects(gke_manifest.namespace(cfg) if declares_namespace else None,
                           [o for o in (gke_capacity.capacity_objects(cfg) if capacity_stack
                                        else gke_capacity.kueue_objects(cfg)
                                        if cfg.gke.queueing else [])
                            if "namespace" not in o["metadata"]], cfg.owner_labels(),
                           gke_manifest.pod_security_level(cfg))
             if cfg.gke.kind != "workload" else [])
    return ClusterCheck(f"{cfg.names.prefix}-cluster-check", check_inputs(
        found, cluster_path=cfg.gke.cluster, project=cluster_project, capacity=cfg.capacity,
        family=cfg.topology.family, crds=crds,
        objects=owned + (team_namespace_objects(cfg.gke.team_names)
                         if capacity_stack else admin_objects(
            gke_manifest.namespace(cfg), cfg.gke.local_queue, cfg.gke.priority_class,
            named_namespace=named and not declares_namespace,
            pod_security=gke_manifest.pod_security_level(cfg))),
        # The stack's own namespace does not exist before its first `pulumi up`: only a named
        # one is asked what the deployer may do in it.
        access=workload_access(gke_manifest.namespace(cfg), cfg.gke.queueing)
        if named and not capacity_stack else [],
        need_pools={"machine_type": shape.machine_type, "topology": shape.topology,
                    "count": cfg.slices} if cfg.gke.kind == "workload" else None,
        needs_network_policy=capacity_stack,
        installs={**({"JobSet": list(JOBSET_CRDS)} if installs["jobset"] else {}),
                  **({"Kueue": list(KUEUE_CRDS)} if installs["kueue"] else {})},
        uses_kueue=uses_kueue,
        creates_queue_objects=capacity_stack or cfg.gke.queueing,
        queue_fit={"namespace": gke_manifest.namespace(cfg), "queue": cfg.gke.local_queue,
                   "shape_labels": {ACCELERATOR_LABEL: shape.accelerator,
                                    TOPOLOGY_LABEL: shape.topology},
                   "chips": cfg.slices * shape.nodes * shape.chips_per_node,
                   "slices": cfg.slices} if cfg.gke.local_queue else None,
        admission_policy=capacity_stack and all(installs.values())))


def family_min_version(cfg: StackConfig) -> str | None:
    """The newest of the GKE version floors of the stack's slice families, if any has one."""
    from infra.gke.cluster_check import gke_version
    from infra.gke.topology import GKE_FAMILIES

    floors = [GKE_FAMILIES[shaped.topology.family].min_gke_version
              for _, shaped in gke_capacity.capacity_shapes(cfg)
              if shaped.topology.family in GKE_FAMILIES]
    floors = [f for f in floors if f]
    return max(floors, key=lambda v: gke_version(v) or (0, 0, 0, 0)) if floors else None


def cluster_args(cfg: StackConfig, network: SliceNetwork | None,
                  check: pulumi.Resource | None) -> Any:

    assert cfg.gke is not None
    n = cfg.names
    new = None
    if cfg.gke.create_cluster:
        assert network is not None
        new = NewCluster(
            name=gke_manifest.cluster_name(cfg), project=cfg.project,
            location=gke_manifest.cluster_location(cfg), zone=cfg.zone,
            network=network.network.id, subnetwork=network.subnet.id,
            cpu_pool_name=n.gke_cpu_pool, node_account_email="",
            release_channel=cfg.gke.release_channel, labels=cfg.toolkit_labels(),
            authorized_networks=list(cfg.gke.authorized_networks),
            private_endpoint=cfg.gke.private_endpoint,
            deletion_protection=cfg.gke.deletion_protection,
            min_master_version=family_min_version(cfg))
    return ClusterArgs(project=gke_manifest.cluster_project(cfg),
                       name=gke_manifest.cluster_name(cfg),
                       location=gke_manifest.cluster_location(cfg), new=new, check=check)


def capacity_args(cfg: StackConfig, network: SliceNetwork | None,
                   check: pulumi.Resource | None) -> Any:

    assert cfg.gke is not None
    capacity = cfg.gke.kind == "capacity"
    return CapacityArgs(
        cluster=cluster_args(cfg, network, check),
        node_pools=gke_capacity.node_pools(cfg),
        workload_policies=gke_capacity.workload_policies(cfg),
        node_account_id=cfg.names.gke_node_account_id,
        image_repository=None if capacity else gke_manifest.image_repository(cfg.gke.image),
        deployer=cfg.deployer,
        install_jobset=cfg.gke.installs()["jobset"],
        install_kueue=cfg.gke.installs()["kueue"],
        queue_objects=gke_capacity.capacity_objects(cfg) if capacity else [],
        # Only a created cluster's: an existing cluster's team namespaces are the platform's
        # (checked at preview, never created or deleted by a stack).
        team_namespaces=cfg.gke.team_names if capacity and cfg.gke.create_cluster else [],
        namespace_labels={**cfg.owner_labels(), **gke_manifest.namespace_labels(cfg)},
    )


def create_capacity(cfg: StackConfig, services: ProjectServices,
                    network: SliceNetwork | None, check: pulumi.Resource | None
                    ) -> dict[str, Any]:
    """gke.kind capacity: no experiment, bucket or trainer; the cluster, pools, controllers and
    queues that teams' workload stacks run on, after the stack's APIs (and network)."""
    assert cfg.gke is not None
    n = cfg.names
    queue_objects = gke_capacity.capacity_objects(cfg)
    capacity = GkeCapacity(f"{n.prefix}-gke-capacity", capacity_args(cfg, network, check),
                           opts=pulumi.ResourceOptions(depends_on=[
                               services, *([network] if network else [])]))
    return {
        "cluster": cfg.gke.cluster or gke_manifest.cluster_name(cfg),
        "node_pools": [p.name for p in capacity.node_pools],
        "cluster_queues": sorted(o["metadata"]["name"] for o in queue_objects
                                 if o["kind"] == "ClusterQueue"),
        "local_queues": sorted(f"{o['metadata']['namespace']}/{o['metadata']['name']}"
                               for o in queue_objects if o["kind"] == "LocalQueue"),
        **billing(cfg),
        **control_plane(cfg),
    }


def control_plane(cfg: StackConfig) -> dict[str, str]:
    """Who can reach a created cluster's control plane (render shows it)."""
    assert cfg.gke is not None
    if not cfg.gke.create_cluster:
        return {}
    if cfg.gke.private_endpoint:
        reach = ("reachable on its private endpoint only (gke.private_endpoint): run pulumi "
                 "from inside the VPC")
    elif cfg.gke.authorized_networks:
        reach = (f"reachable only from {', '.join(cfg.gke.authorized_networks)} "
                 "(gke.authorized_networks)")
    else:
        reach = ("reachable from anywhere, with credentials: set gke.authorized_networks to "
                 "your offices' and CI's ranges, or gke.private_endpoint: true")
    return {"control_plane": reach}


def billing(cfg: StackConfig) -> dict[str, str]:
    """What stays billed once a run has finished, and how to stop it (render shows it)."""
    assert cfg.gke is not None
    if cfg.gke.kind == "workload":
        return {"billing": "nothing of its own but the bucket: the node pools are the "
                           "admin's (their capacity stack says what they cost idle)"}
    if cfg.gke.pools_scale_to_zero(cfg.capacity):
        return {"billing": "the TPU node pools scale to zero nodes when no pod runs on them "
                           "(GKE's cluster autoscaler): a finished run stops billing TPUs"}
    return {"billing": f"the {cfg.slices} TPU node pool(s) stay up and billed after the run "
                       "completes, until `pulumi destroy`; set multislice:gke.scale_to_zero: "
                       "true to have them scale to zero nodes between runs"}


def create_experiment(cfg: StackConfig, services: ProjectServices, network: SliceNetwork | None,
                storage: ExperimentStorage, identity: TrainerIdentity,
                spec_text: pulumi.Input[str],
                cluster_check: pulumi.Resource | None) -> dict[str, Any]:

    n = cfg.names
    assert cfg.gke is not None
    # A stack of kind all declares its namespace (ms-STACK, or the one it names), never one
    # every cluster has, nor the admin's that holds their queue (local_queue); a workload stack
    # runs in the admin's. The cluster check refuses a named one that exists and is not this
    # stack's (no AlreadyExists at up); a named one is retained on destroy.
    own_namespace = (cfg.gke.kind == "all" and cfg.gke.local_queue is None
                     and cfg.gke.namespace not in CLUSTER_NAMESPACES)
    workload = WorkloadArgs(
        jobset=gke_manifest.jobset(cfg, ""),  # its run's digest: declare (live_run.py)
        spec_sha256=pulumi.Output.from_input(spec_text).apply(gke_manifest.launch_spec_sha256),
        namespace=gke_manifest.namespace(cfg),
        create_namespace=own_namespace,
        retain_namespace=own_namespace and cfg.gke.namespace is not None,
        namespace_labels={**cfg.owner_labels(), **gke_manifest.namespace_labels(cfg)},
        k8s_service_account=n.k8s_service_account,
        service_account_email=n.service_account_email,
        service_account_name=identity.account.name,
        workload_identity_member=gke_manifest.workload_identity_member(cfg),
        boot_config_map=n.boot_config_map,
        boot_files=gke_manifest.boot_files(),
        labels=cfg.toolkit_labels(),
        kueue_objects=gke_capacity.kueue_objects(cfg) if cfg.gke.queueing else [],
    )
    after = pulumi.ResourceOptions(depends_on=[
        services, storage, identity, *([network] if network else []),
        *([identity.deployer_act_as] if identity.deployer_act_as else [])])
    outputs: dict[str, Any] = {
        "cluster": cfg.gke.cluster or gke_manifest.cluster_name(cfg),
        "jobset": f"{gke_manifest.namespace(cfg)}/{n.jobset}",
        **billing(cfg),
        **control_plane(cfg),
    }
    if cfg.gke.kind == "workload":
        GkeWorkload(f"{n.prefix}-gke-workload", cluster_args(cfg, None, cluster_check),
                    workload, opts=after)
        return outputs
    slices = GkeSlices(f"{n.prefix}-gke-slices", capacity_args(cfg, network, cluster_check),
                       workload, opts=after)
    return {**outputs, "node_pools": [p.name for p in slices.node_pools]}
