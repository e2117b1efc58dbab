"""The cluster a GKE stack runs on: one it creates, with secure defaults, or an existing one.

A created cluster is Standard, in the stack's VPC and region: private nodes, Workload
Identity, a release channel, a small CPU pool for the controllers, and:

- its control plane reachable only from `gke.authorized_networks` (or only on its private
  endpoint with `gke.private_endpoint`); with neither it is reachable from anywhere with
  credentials, and render says so;
- deletion protection (`gke.deletion_protection`, on by default): the cluster refuses to be
  deleted until it is set false and applied. It protects the cluster, not what is in it: the
  engine deletes dependents first, so `pulumi destroy` removes the node pools, queue objects and
  JobSet before it stops at the cluster (team namespaces and controllers are retained anyway);
- a maintenance exclusion of minor and node upgrades until the version's end of support: GKE
  does not upgrade the TPU slices' nodes under a run (a multi-host slice upgraded is a slice
  restarted). Control plane patches still apply; the team upgrades the nodes between runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_gcp as gcp

from infra.gke.checks import GKE_CONTROL_PLANE_CIDR
from infra.gke.controllers import PROJECT_ROOT
from infra.gke.kube import ClusterAccess
from infra.gke.webhooks import control_plane_ports

CPU_POOL_MACHINE_TYPE = "e2-standard-4"  # the JobSet controller and GKE's own system pods
# A fixed start (a render is the same on every machine): any date before the cluster exists.
MAINTENANCE_EXCLUSION = {
    "exclusion_name": "multislice-no-node-upgrades",
    "start_time": "2026-01-01T00:00:00Z",
    "exclusion_options": {"scope": "NO_MINOR_OR_NODE_UPGRADES",
                          "end_time_behavior": "UNTIL_END_OF_SUPPORT"},
}


@dataclass
class NewCluster:
    """What create_cluster makes."""

    name: str
    project: str
    location: str
    zone: str
    network: pulumi.Input[str]
    subnetwork: pulumi.Input[str]
    cpu_pool_name: str
    node_account_email: pulumi.Input[str]
    release_channel: str = "REGULAR"
    labels: dict[str, str] = field(default_factory=dict)
    authorized_networks: list[str] = field(default_factory=list)
    private_endpoint: bool = False
    deletion_protection: bool = True
    min_master_version: str | None = None
    """The oldest GKE version that runs the stack's slices (TPU7x: 1.34.0-gke.2201000)."""
    installed_manifests: list[str] = field(default_factory=list)
    """The controllers' manifests this stack applies (for the webhook firewall rule)."""


def create(spec: NewCluster, parent: pulumi.Resource,
           depends_on: list[pulumi.Resource]) -> ClusterAccess:
    child = pulumi.ResourceOptions(parent=parent, depends_on=depends_on)
    authorized = ({"master_authorized_networks_config": {"cidr_blocks": [
        {"cidr_block": cidr, "display_name": f"authorized-{i}"}
        for i, cidr in enumerate(spec.authorized_networks)]}}
        if spec.authorized_networks else {})
    cluster = gcp.container.Cluster(
        spec.name,
        name=spec.name,
        project=spec.project,
        location=spec.location,
        network=spec.network,
        subnetwork=spec.subnetwork,
        networking_mode="VPC_NATIVE",
        # GKE Dataplane V2: NetworkPolicy enforced (a capacity stack's team isolation)
        datapath_provider="ADVANCED_DATAPATH",
        ip_allocation_policy={},  # GKE picks the pod and service ranges
        private_cluster_config={"enable_private_nodes": True,
                                "enable_private_endpoint": spec.private_endpoint,
                                "master_ipv4_cidr_block": GKE_CONTROL_PLANE_CIDR},
        **authorized,
        workload_identity_config={"workload_pool": f"{spec.project}.svc.id.goog"},
        release_channel={"channel": spec.release_channel},
        maintenance_policy={
            "daily_maintenance_window": {"start_time": "03:00"},
            "maintenance_exclusions": [MAINTENANCE_EXCLUSION],
        },
        remove_default_node_pool=True,
        initial_node_count=1,
        resource_labels=spec.labels,
        **({"min_master_version": spec.min_master_version} if spec.min_master_version else {}),
        # GKE cost allocation: the billing export breaks the cluster's cost down by namespace
        # and by the pods' labels (team, stack, experiment: infra/gke/manifest.py cost_labels)
        cost_management_config={"enabled": True},
        deletion_protection=spec.deletion_protection,
        opts=child,
    )
    cpu_pool = gcp.container.NodePool(
        spec.cpu_pool_name,
        name=spec.cpu_pool_name,
        project=spec.project,
        location=spec.location,
        cluster=cluster.name,
        # One node: node_count is per zone, and a regional cluster's pools span its zones
        # (three) unless node_locations says otherwise.
        node_locations=[spec.zone],
        node_count=1,
        management={"auto_repair": True, "auto_upgrade": True},
        node_config={
            "machine_type": CPU_POOL_MACHINE_TYPE,
            "service_account": spec.node_account_email,
            "oauth_scopes": ["https://www.googleapis.com/auth/cloud-platform"],
            "workload_metadata_config": {"mode": "GKE_METADATA"},
            # as the TPU pools': the controllers' node boots only signed components
            "shielded_instance_config": {"enable_secure_boot": True,
                                         "enable_integrity_monitoring": True},
            "labels": spec.labels,
            "tags": [spec.cpu_pool_name],  # the webhook rule's target
        },
        opts=child,
    )
    ports = control_plane_ports(PROJECT_ROOT / m for m in spec.installed_manifests)
    if ports:
        # GKE's own rule lets the control plane reach nodes on 443 and 10250 only.
        gcp.compute.Firewall(
            f"{spec.name}-webhooks",
            name=f"{spec.name}-webhooks",
            project=spec.project,
            network=spec.network,
            direction="INGRESS",
            source_ranges=[GKE_CONTROL_PLANE_CIDR],
            target_tags=[spec.cpu_pool_name],
            allows=[{"protocol": "tcp", "ports": [str(p) for p in ports]}],
            description="the GKE control plane to the webhooks and APIs of the "
                        "controllers this stack installs (infra/gke/webhooks.py)",
            opts=pulumi.ResourceOptions(parent=parent, depends_on=[cluster]),
        )
    return ClusterAccess(ref=cluster.name, endpoint=cluster.endpoint,
                         ca_certificate=cluster.master_auth.cluster_ca_certificate,
                         ready=[cluster, cpu_pool])


def existing(name: str, location: str, project: str,
             check: pulumi.Resource | None) -> ClusterAccess:
    """An existing cluster (in any project), as the GKE API describes it; nothing is created in
    it before its check (infra/gke/cluster_check.py) passed."""
    found = gcp.container.get_cluster_output(name=name, location=location, project=project)
    return ClusterAccess(
        ref=name, endpoint=found.endpoint,
        ca_certificate=found.master_auths.apply(lambda auths: auths[0].cluster_ca_certificate),
        ready=[check] if check is not None else [])
