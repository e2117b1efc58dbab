"""The TPU capacity of a GKE stack that owns it: the nodes' own service account and one TPU node
pool per slice (COMPACT placement on the slice's topology, auto-repair, gVNIC, spot or a
reservation as the stack's capacity says; inputs from infra/gke/manifest.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_gcp as gcp

NODE_ROLE = "roles/container.defaultNodeServiceAccount"  # GKE's least-privilege node role
IMAGE_READER_ROLE = "roles/artifactregistry.reader"


@dataclass
class NodeIdentity:
    account: gcp.serviceaccount.Account
    grants: list[pulumi.Resource]


def node_identity(project: str, account_id: str, image_repository: str | None,
                  deployer: str | None, parent: pulumi.Resource) -> NodeIdentity:
    """The nodes' service account and its grants: GKE's node role, reading the pods' image
    when it is in Artifact Registry, and actAs for the deployer (node pools attach it)."""
    child = pulumi.ResourceOptions(parent=parent)
    account = gcp.serviceaccount.Account(
        account_id, project=project, account_id=account_id,
        display_name="Multislice GKE nodes", opts=child)
    member = account.email.apply(lambda email: f"serviceAccount:{email}")
    grants: list[pulumi.Resource] = [gcp.projects.IAMMember(
        f"{account_id}-node-role", project=project, role=NODE_ROLE, member=member, opts=child)]
    if image_repository:
        _, repo_project, _, location, _, repository = image_repository.split("/")
        grants.append(gcp.artifactregistry.RepositoryIamMember(
            f"{account_id}-image-reader", project=repo_project, location=location,
            repository=repository, role=IMAGE_READER_ROLE, member=member, opts=child))
    if deployer:
        grants.append(gcp.serviceaccount.IAMMember(
            f"{account_id}-deployer-act-as", service_account_id=account.name,
            role="roles/iam.serviceAccountUser", member=deployer, opts=child))
    return NodeIdentity(account, grants)


def workload_policies(specs: list[dict[str, Any]], parent: pulumi.Resource,
                      ) -> list[gcp.compute.ResourcePolicy]:
    """The workload policies TPU7x slice pools name (infra/gke/capacity.py workload_policies).
    A policy cannot change in place: a new topology is a new policy, and its pools are new."""
    return [gcp.compute.ResourcePolicy(
        spec["name"], **spec,
        opts=pulumi.ResourceOptions(parent=parent, delete_before_replace=True))
        for spec in specs]


def tpu_node_pools(specs: list[dict[str, Any]], cluster_ref: pulumi.Input[str],
                   parent: pulumi.Resource,
                   depends_on: list[pulumi.Resource]) -> list[gcp.container.NodePool]:
    return [
        gcp.container.NodePool(
            spec["name"],
            **{**spec, "cluster": cluster_ref},
            # A multi-host TPU slice cannot be resized: a new node count is a new pool.
            opts=pulumi.ResourceOptions(parent=parent, replace_on_changes=["nodeCount"],
                                        delete_before_replace=True, depends_on=depends_on),
        )
        for spec in specs
    ]
