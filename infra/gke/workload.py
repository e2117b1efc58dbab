"""What an experiment owns on a cluster, whoever runs the capacity: its Kubernetes service
account bound through Workload Identity to the stack's trainer account (so the bucket grants
apply unchanged), the boot files as a ConfigMap, the queue objects of its own queue (a stack
that owns its capacity, gke.queueing), and the JobSet. Objects of infra/gke/manifest.py."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_gcp as gcp
import pulumi_kubernetes as k8s

from infra.gke import live_run
from infra.gke.kube import ClusterAccess
from infra.gke.manifest import LAUNCH_SPEC_ANNOTATION

WORKLOAD_IDENTITY_ROLE = "roles/iam.workloadIdentityUser"


@dataclass
class WorkloadArgs:
    jobset: dict[str, Any]
    """The JobSet object (apiVersion, kind, metadata, spec); its pod template's run digest is
    chosen at declare (infra/gke/live_run.py)."""
    spec_sha256: pulumi.Input[str]
    """The digest of the launch spec this `pulumi up` publishes."""
    namespace: str
    create_namespace: bool
    """True for the namespace a stack of kind all owns (ms-STACK, or one it names)."""
    namespace_labels: dict[str, str]
    k8s_service_account: str
    service_account_email: str
    service_account_name: pulumi.Input[str]
    """The trainer service account's resource name (for the Workload Identity binding)."""
    workload_identity_member: str
    boot_config_map: str
    boot_files: dict[str, str]
    labels: dict[str, str] = field(default_factory=dict)
    kueue_objects: list[dict[str, Any]] = field(default_factory=list)
    """The stack's own ResourceFlavor, ClusterQueue and LocalQueue (gke.queueing)."""
    retain_namespace: bool = False
    """A named one is retained on destroy: other things may have come to live in it."""


def with_run_spec(jobset: dict[str, Any], run_sha256: pulumi.Input[str]) -> dict[str, Any]:
    """The JobSet with `run_sha256` as the digest its pods' template carries."""
    out = copy.deepcopy(jobset)
    for rjob in out["spec"]["replicatedJobs"]:
        rjob["template"]["spec"]["template"]["metadata"]["annotations"][
            LAUNCH_SPEC_ANNOTATION] = run_sha256
    return out


def declare(args: WorkloadArgs, provider: k8s.Provider, parent: pulumi.Resource,
            access: ClusterAccess, controllers: list[pulumi.Resource],
            capacity: list[pulumi.Resource],
            adopting: k8s.Provider | None = None) -> k8s.apiextensions.CustomResource:
    """Declares the workload's objects; returns the JobSet. `adopting` (an upserting provider)
    declares the stack's own namespace: one a destroy retained is the stack's again at the next
    `up` (preview refuses a namespace that exists and is not the stack's)."""
    ns_deps: list[pulumi.Resource] = [k8s.core.v1.Namespace(
        args.namespace, metadata={"name": args.namespace, "labels": args.namespace_labels},
        opts=pulumi.ResourceOptions(parent=parent, provider=adopting or provider,
                                    retain_on_delete=args.retain_namespace))
    ] if args.create_namespace else []
    in_ns = pulumi.ResourceOptions(parent=parent, provider=provider, depends_on=ns_deps)
    ksa = k8s.core.v1.ServiceAccount(
        args.k8s_service_account,
        metadata={"name": args.k8s_service_account, "namespace": args.namespace,
                  "labels": args.labels,
                  "annotations": {"iam.gke.io/gcp-service-account": args.service_account_email}},
        opts=in_ns)
    # IAM refuses a PROJECT.svc.id.goog member ("Identity Pool does not exist") until the
    # project's first Workload Identity cluster exists: a created cluster comes first.
    binding = gcp.serviceaccount.IAMMember(
        f"{args.k8s_service_account}-workload-identity",
        service_account_id=args.service_account_name,
        role=WORKLOAD_IDENTITY_ROLE,
        member=args.workload_identity_member,
        opts=pulumi.ResourceOptions(parent=parent, depends_on=access.ready))
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
            opts=pulumi.ResourceOptions(parent=parent, provider=provider,
                                        depends_on=[*controllers, *ns_deps]))
        for obj in args.kueue_objects
    ]
    meta = args.jobset["metadata"]
    run_sha256 = pulumi.Output.all(access.endpoint, access.ca_certificate,
                                   args.spec_sha256).apply(
        lambda a: live_run.run_spec_sha256(a[0], a[1], meta["namespace"], meta["name"], a[2]))
    jobset = with_run_spec(args.jobset, run_sha256)
    return k8s.apiextensions.CustomResource(
        meta["name"],
        api_version=jobset["apiVersion"],
        kind=jobset["kind"],
        metadata=jobset["metadata"],
        spec=jobset["spec"],
        # The JobSet API refuses most spec updates, and Kueue's webhook a change of the queue
        # label ("field is immutable"): a new pod template, shape or queue is a new JobSet
        # (same name, so the old one goes first; it queues again). A new launch spec is not,
        # while the JobSet runs (infra/gke/live_run.py). The node pools stay.
        opts=pulumi.ResourceOptions(
            parent=parent, provider=provider, replace_on_changes=["spec", "metadata.labels"],
            delete_before_replace=True,
            depends_on=[*controllers, *queues, ksa, binding, boot, *capacity]),
    )
