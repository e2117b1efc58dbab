"""Orchestration ``gke``: TPU slice node pools on a GKE cluster and one JobSet that trains on them.

Every object's content comes from infra/gke/manifest.py (pure); this module only declares them:

- the cluster, when the stack creates one: Standard, in the stack's VPC and region, private
  nodes, Workload Identity, a release channel, and a small CPU pool for the controllers;
- one TPU node pool per slice (COMPACT placement on the slice's topology, auto-repair, gVNIC,
  the trainer's service account, spot or a reservation as the stack's capacity says);
- a Kubernetes provider that reaches the cluster with the deployer's Google credentials through
  an exec credential: the kubeconfig runs `.venv/bin/multislice gke-token` (scripts/gke/token.py)
  for a fresh token whenever the provider needs one, so the state holds no bearer token that
  expires an hour later, and `pulumi destroy` / `refresh` days later authenticate without
  `--run-program` (no gke-gcloud-auth-plugin binary on the deployer's machine either);
- the JobSet controller from its pinned release manifest, kept in infra/k8s/;
- the workload's namespace, its Kubernetes service account bound through Workload Identity to the
  stack's trainer service account (so the bucket grants apply unchanged), the boot files as a
  ConfigMap, and the JobSet.

A run ends: its pods exit 0 and the JobSet completes. The pods carry the launch spec's digest, so a
code or trainer change rewrites the spec object and replaces the JobSet (a new run on the same
node pools, resumed from the last checkpoint). A change of the slices' shape replaces the pools.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pulumi
import pulumi_gcp as gcp
import pulumi_kubernetes as k8s

from infra.gke.checks import GKE_CONTROL_PLANE_CIDR
from infra.gke.webhooks import control_plane_ports

# The controllers' release manifests (JobSet always, Kueue for a queued stack), kept in the repo
# (infra/k8s/README.md: each built from its tag by the release's own recipe), so a PR shows every
# object `pulumi up` applies and nothing is fetched from the network then. The paths are relative
# to the project root (Pulumi.yaml sets no `main`), the working directory Pulumi's engine starts
# providers in (pulumi/pulumi pkg/engine/project.go getPwdMain), so the inputs read the same on
# every machine.
JOBSET_VERSION = "v0.12.0"
PROJECT_ROOT = Path(__file__).resolve().parents[2]
JOBSET_MANIFEST = f"infra/k8s/jobset-{JOBSET_VERSION}.yaml"
KUEUE_VERSION = "v0.19.2"  # serves kueue.x-k8s.io/v1beta2
KUEUE_MANIFEST = f"infra/k8s/kueue-{KUEUE_VERSION}.yaml"
WORKLOAD_IDENTITY_ROLE = "roles/iam.workloadIdentityUser"
CPU_POOL_MACHINE_TYPE = "e2-standard-4"  # the JobSet controller and GKE's own system pods


@dataclass
class GkeArgs:
    """What GkeSlices creates; the dicts come from infra/gke/manifest.py."""

    project: str
    cluster_name: str
    """The cluster's name: an existing one's, or the one to create."""
    location: str
    """The cluster's location (a region or zone)."""
    zone: str
    """The stack's zone: where its node pools (and a created cluster's controller pool) run."""
    create_cluster: bool
    node_pools: list[dict[str, Any]]
    """One gcp.container.NodePool's inputs per slice, in slice order."""
    jobset: dict[str, Any]
    """The JobSet object (apiVersion, kind, metadata, spec)."""
    namespace: str
    k8s_service_account: str
    node_account_id: str
    """The nodes' own service account (roles/container.defaultNodeServiceAccount only)."""
    service_account_email: str
    service_account_name: pulumi.Input[str]
    """The trainer service account's resource name (for the Workload Identity binding)."""
    workload_identity_member: str
    boot_config_map: str
    boot_files: dict[str, str]
    labels: dict[str, str] = field(default_factory=dict)
    release_channel: str = "REGULAR"
    network: pulumi.Input[str] | None = None
    """With create_cluster: the stack's VPC and subnet."""
    subnetwork: pulumi.Input[str] | None = None
    cpu_pool_name: str = ""
    install_jobset: bool = True
    """Apply JobSet's kept manifest (StackConfig.gke.installs())."""
    kueue_objects: list[dict[str, Any]] = field(default_factory=list)
    """ResourceFlavor, ClusterQueue, LocalQueue when the JobSet is queued (else empty)."""
    install_kueue: bool = True
    image_repository: str | None = None
    """projects/P/locations/L/repositories/R when the pods' image is in Artifact Registry."""
    deployer: str | None = None
    """IAM member that runs `pulumi up`: actAs on the node account (node pools attach it)."""
    create_namespace: bool = True
    """False when the namespace is the cluster admin's (it holds their LocalQueue)."""
    cluster_check: pulumi.Resource | None = None
    """An existing cluster's ClusterCheck (infra/gke/cluster_check.py): nothing in the cluster
    is created before it passes."""


NODE_ROLE = "roles/container.defaultNodeServiceAccount"  # GKE's least-privilege node role
IMAGE_READER_ROLE = "roles/artifactregistry.reader"


def installed_manifests(args: GkeArgs) -> dict[str, str]:
    """The kept release manifests this stack applies to its cluster, by controller."""
    return {**({"jobset": JOBSET_MANIFEST} if args.install_jobset else {}),
            **({"kueue": KUEUE_MANIFEST} if args.kueue_objects and args.install_kueue else {})}


# Client-go runs the exec credential plugin with the provider's working directory, the project
# root (see the manifests above), where Pulumi.yaml's virtualenv is: the toolkit's own CLI there.
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


class GkeSlices(pulumi.ComponentResource):
    node_pools: list[gcp.container.NodePool]
    jobset: k8s.apiextensions.CustomResource

    def __init__(self, name: str, args: GkeArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("multislice:infra:GkeSlices", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        node_account, node_grants = self._node_identity(args, child)
        cluster_deps: list[pulumi.Resource] = [args.cluster_check] if args.cluster_check else []
        if args.create_cluster:
            cluster = gcp.container.Cluster(
                args.cluster_name,
                name=args.cluster_name,
                project=args.project,
                location=args.location,
                network=args.network,
                subnetwork=args.subnetwork,
                networking_mode="VPC_NATIVE",
                ip_allocation_policy={},  # GKE picks the pod and service ranges
                private_cluster_config={"enable_private_nodes": True,
                                        "enable_private_endpoint": False,
                                        "master_ipv4_cidr_block": GKE_CONTROL_PLANE_CIDR},
                workload_identity_config={"workload_pool": f"{args.project}.svc.id.goog"},
                release_channel={"channel": args.release_channel},
                remove_default_node_pool=True,
                initial_node_count=1,
                resource_labels=args.labels,
                deletion_protection=False,
                opts=child,
            )
            cpu_pool = gcp.container.NodePool(
                args.cpu_pool_name,
                name=args.cpu_pool_name,
                project=args.project,
                location=args.location,
                cluster=cluster.name,
                # One node: node_count is per zone, and a regional cluster's pools span its
                # zones (three) unless node_locations says otherwise.
                node_locations=[args.zone],
                node_count=1,
                management={"auto_repair": True, "auto_upgrade": True},
                node_config={
                    "machine_type": CPU_POOL_MACHINE_TYPE,
                    "service_account": node_account.email,
                    "oauth_scopes": ["https://www.googleapis.com/auth/cloud-platform"],
                    "workload_metadata_config": {"mode": "GKE_METADATA"},
                    "labels": args.labels,
                    "tags": [args.cpu_pool_name],  # the webhook rule's target
                },
                opts=child,
            )
            ports = control_plane_ports(
                PROJECT_ROOT / m for m in installed_manifests(args).values())
            if ports:
                # GKE's own rule lets the control plane reach nodes on 443 and 10250 only.
                gcp.compute.Firewall(
                    f"{args.cluster_name}-webhooks",
                    name=f"{args.cluster_name}-webhooks",
                    project=args.project,
                    network=args.network,
                    direction="INGRESS",
                    source_ranges=[GKE_CONTROL_PLANE_CIDR],
                    target_tags=[args.cpu_pool_name],
                    allows=[{"protocol": "tcp", "ports": [str(p) for p in ports]}],
                    description="the GKE control plane to the webhooks and APIs of the "
                                "controllers this stack installs (infra/gke/webhooks.py)",
                    opts=pulumi.ResourceOptions(parent=self, depends_on=[cluster]),
                )
            endpoint, ca = cluster.endpoint, cluster.master_auth.cluster_ca_certificate
            cluster_deps = [cluster, cpu_pool]
            cluster_ref: pulumi.Input[str] = cluster.name
        else:
            found = gcp.container.get_cluster_output(
                name=args.cluster_name, location=args.location, project=args.project)
            endpoint = found.endpoint
            ca = found.master_auths.apply(lambda auths: auths[0].cluster_ca_certificate)
            cluster_ref = args.cluster_name

        self.node_pools = [
            gcp.container.NodePool(
                spec["name"],
                **{**spec, "cluster": cluster_ref},
                # A multi-host TPU slice cannot be resized: a new node count is a new pool.
                opts=pulumi.ResourceOptions(parent=self, replace_on_changes=["nodeCount"],
                                            delete_before_replace=True,
                                            depends_on=[*cluster_deps, node_account,
                                                        *node_grants]),
            )
            for spec in args.node_pools
        ]

        config = pulumi.Output.all(endpoint, ca).apply(lambda v: kubeconfig(*v))
        # Server-side apply (pulumi-kubernetes v4's default, pinned here against the
        # PULUMI_K8S_ENABLE_SERVER_SIDE_APPLY override): Kueue's CRDs are too large for the
        # last-applied annotation a client-side apply writes (Kueue's install guide).
        provider = k8s.Provider(
            f"{name}-k8s", kubeconfig=config, enable_server_side_apply=True,
            opts=pulumi.ResourceOptions(parent=self, depends_on=cluster_deps))
        on_cluster = pulumi.ResourceOptions(parent=self, provider=provider)

        # Cluster-wide: their CRDs hold every JobSet (and Kueue workload) of the cluster, not
        # only this stack's. Retained on `pulumi destroy` (the option propagates to the
        # manifest's objects, Pulumi's retainOnDelete docs), so one team's teardown never
        # deletes another's jobs; a created cluster takes them with it.
        controllers: list[pulumi.Resource] = [
            k8s.yaml.v2.ConfigFile(f"{name}-{controller}-controller", file=manifest,
                                   opts=pulumi.ResourceOptions.merge(
                                       on_cluster, pulumi.ResourceOptions(retain_on_delete=True)))
            for controller, manifest in installed_manifests(args).items()]
        ns_deps: list[pulumi.Resource] = [k8s.core.v1.Namespace(
            args.namespace, metadata={"name": args.namespace, "labels": args.labels},
            opts=on_cluster)] if args.create_namespace else []
        in_ns = pulumi.ResourceOptions(parent=self, provider=provider, depends_on=ns_deps)
        ksa = k8s.core.v1.ServiceAccount(
            args.k8s_service_account,
            metadata={"name": args.k8s_service_account, "namespace": args.namespace,
                      "labels": args.labels,
                      "annotations": {"iam.gke.io/gcp-service-account":
                                      args.service_account_email}},
            opts=in_ns)
        # IAM refuses a PROJECT.svc.id.goog member ("Identity Pool does not exist") until the
        # project's first Workload Identity cluster exists: a created cluster comes first.
        binding = gcp.serviceaccount.IAMMember(
            f"{args.k8s_service_account}-workload-identity",
            service_account_id=args.service_account_name,
            role=WORKLOAD_IDENTITY_ROLE,
            member=args.workload_identity_member,
            opts=pulumi.ResourceOptions(parent=self, depends_on=cluster_deps))
        boot = k8s.core.v1.ConfigMap(
            args.boot_config_map,
            metadata={"name": args.boot_config_map, "namespace": args.namespace,
                      "labels": args.labels},
            data=args.boot_files,
            # pulumi-kubernetes replaces a ConfigMap whose data changes; same name: delete first
            opts=pulumi.ResourceOptions.merge(in_ns, pulumi.ResourceOptions(
                delete_before_replace=True)))
        queues = [
            k8s.apiextensions.CustomResource(
                f"{obj['kind'].lower()}-{obj['metadata']['name']}",
                api_version=obj["apiVersion"], kind=obj["kind"], metadata=obj["metadata"],
                spec=obj["spec"],
                opts=pulumi.ResourceOptions(parent=self, provider=provider,
                                            depends_on=[*controllers, *ns_deps]))
            for obj in args.kueue_objects
        ]
        self.jobset = k8s.apiextensions.CustomResource(
            args.jobset["metadata"]["name"],
            api_version=args.jobset["apiVersion"],
            kind=args.jobset["kind"],
            metadata=args.jobset["metadata"],
            spec=args.jobset["spec"],
            # The JobSet API refuses most spec updates: a new spec is a new JobSet (same name,
            # so the old one goes first). The node pools stay.
            opts=pulumi.ResourceOptions(
                parent=self, provider=provider, replace_on_changes=["spec"],
                delete_before_replace=True,
                depends_on=[*controllers, *queues, ksa, binding, boot, *self.node_pools]),
        )
        self.register_outputs({"node_pools": [p.name for p in self.node_pools],
                               "node_account": node_account.email,
                               "jobset": args.jobset["metadata"]["name"]})

    def _node_identity(self, args: GkeArgs, child: pulumi.ResourceOptions,
                       ) -> tuple[gcp.serviceaccount.Account, list[pulumi.Resource]]:
        """The nodes' service account and its grants: GKE's node role, reading the pods' image
        when it is in Artifact Registry, and actAs for the deployer."""
        account = gcp.serviceaccount.Account(
            args.node_account_id, project=args.project, account_id=args.node_account_id,
            display_name="Multislice GKE nodes", opts=child)
        member = account.email.apply(lambda email: f"serviceAccount:{email}")
        grants: list[pulumi.Resource] = [gcp.projects.IAMMember(
            f"{args.node_account_id}-node-role", project=args.project, role=NODE_ROLE,
            member=member, opts=child)]
        if args.image_repository:
            _, project, _, location, _, repository = args.image_repository.split("/")
            grants.append(gcp.artifactregistry.RepositoryIamMember(
                f"{args.node_account_id}-image-reader", project=project, location=location,
                repository=repository, role=IMAGE_READER_ROLE, member=member, opts=child))
        if args.deployer:
            grants.append(gcp.serviceaccount.IAMMember(
                f"{args.node_account_id}-deployer-act-as", service_account_id=account.name,
                role="roles/iam.serviceAccountUser", member=args.deployer, opts=child))
        return account, grants
