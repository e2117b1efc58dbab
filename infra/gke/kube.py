"""How the program reaches a cluster's API server: a kubeconfig whose user is an exec credential,
and the two Kubernetes providers a stack uses.

The kubeconfig runs `.venv/bin/multislice gke-token` (scripts/gke/token.py) for a fresh token
whenever the provider needs one, so the state holds no bearer token that expires an hour later,
and `pulumi destroy` / `refresh` days later authenticate without `--run-program` (no
gke-gcloud-auth-plugin binary on the deployer's machine either). The token is minted from the
deployer's application-default credentials (README: which identity creates what).

Two providers, because pulumi-kubernetes (4.29 and later) refuses to create an object that
exists already unless `upsertExistingObjects` is on, and that guard is worth keeping for what a
stack owns (a renamed resource would otherwise update and then delete the same object):

- `own`: the stack's own objects (its namespace, service account, ConfigMap, queue objects,
  JobSet): AlreadyExists stays an error.
- `shared`: the cluster-wide controllers a stack installs (JobSet's, Kueue's), which a second
  stack, or this one after a `pulumi destroy` that retained them, applies again: upserted,
  never an AlreadyExists, and retained on delete (infra/gke/controllers.py).

Both apply server-side (pulumi-kubernetes v4's default, pinned here against the
PULUMI_K8S_ENABLE_SERVER_SIDE_APPLY override): Kueue's CRDs are too large for the last-applied
annotation a client-side apply writes (Kueue's install guide).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pulumi
import pulumi_kubernetes as k8s

# Client-go runs the exec credential plugin with the provider's working directory, the project
# root (infra/gke/controllers.py), where Pulumi.yaml's virtualenv is: the toolkit's own CLI there.
TOKEN_COMMAND = ".venv/bin/multislice"
TOKEN_ARGS = ["gke-token"]


def kubeconfig(endpoint: str, ca_certificate: str) -> str:
    """A kubeconfig whose user is an exec credential (client.authentication.k8s.io/v1beta1):
    pulumi-kubernetes asks `multislice gke-token` for a token when it needs one."""
    return json.dumps({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "gke", "cluster": {
            "server": f"https://{endpoint}", "certificate-authority-data": ca_certificate}}],
        "users": [{"name": "deployer", "user": {"exec": {
            "apiVersion": "client.authentication.k8s.io/v1beta1",
            "command": TOKEN_COMMAND, "args": TOKEN_ARGS, "interactiveMode": "Never",
            "provideClusterInfo": False,
            "installHint": "run pulumi from the project root, where `make` put .venv (the "
                           "virtualenv Pulumi.yaml names): .venv/bin/multislice gke-token mints "
                           "the token from your application-default credentials"}}}],
        "contexts": [{"name": "gke", "context": {"cluster": "gke", "user": "deployer"}}],
        "current-context": "gke",
    })


@dataclass
class ClusterAccess:
    """A cluster as the program reaches it."""

    ref: pulumi.Input[str]
    """The cluster's name, as node pools name it (an Output for a created cluster)."""
    endpoint: pulumi.Input[str]
    ca_certificate: pulumi.Input[str]
    ready: list[pulumi.Resource]
    """What must exist before anything is created in the cluster (the created cluster and its
    controller pool, or an existing cluster's check)."""


def provider(name: str, cluster: ClusterAccess, parent: pulumi.Resource, *,
             shared: bool = False) -> k8s.Provider:
    """The `own` provider, or with `shared` the one for cluster-wide objects (module docstring)."""
    config = pulumi.Output.all(cluster.endpoint, cluster.ca_certificate).apply(
        lambda v: kubeconfig(*v))
    return k8s.Provider(
        f"{name}-k8s{'-shared' if shared else ''}", kubeconfig=config,
        enable_server_side_apply=True, **({"upsert_existing_objects": True} if shared else {}),
        opts=pulumi.ResourceOptions(parent=parent, depends_on=cluster.ready))
