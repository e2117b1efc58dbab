"""A dedicated service account for the TPU VMs with only what training needs.

Never the default compute service account (it has project Editor in many projects).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_gcp as gcp

from infra.stack_config.manifest import (
    BUCKET_READ_ROLE,
    BUCKET_WRITE_ROLE,
    DATA_BUCKET_ROLE,
    LOGGING_ROLES,
    host_write_condition,
)

# Attaching a service account to a VM (the queued resource's create) needs actAs on it.
ACT_AS_ROLE = "roles/iam.serviceAccountUser"


INDEX_READ_ROLE = "roles/artifactregistry.reader"


@dataclass
class IdentityArgs:
    """What TrainerIdentity creates: the TPU VMs' own service account, least privilege."""

    project: str
    """Google Cloud project id (the log and metric writer roles are granted here)."""
    account_id: str
    """Service account id, ms-STACK-tpu (at most 30 characters)."""
    bucket: pulumi.Input[str]
    """The experiment bucket: read on all of it, write under `write_prefixes` only."""
    write_prefixes: list[str]
    """Object-name prefixes the hosts write (infra/stack_config/manifest.py host_write_prefixes): an IAM
    Condition on the write grant, so no host rewrites the launch spec, code/ or envs/."""
    data_buckets: list[str] = field(default_factory=list)
    """Other buckets holding training data: roles/storage.objectViewer on each (read only)."""
    deployer: str | None = None
    """IAM member that runs `pulumi up`: roles/iam.serviceAccountUser on this account only."""
    project_roles: tuple[str, ...] = LOGGING_ROLES
    """Project-level roles (the VMs' agents ship logs and metrics as this account). A workload
    stack on GKE has none: a pod's output is shipped by the node's agent, as the node's account."""
    index_repository: tuple[str, str, str] | None = None
    """(project, location, repository) of the Artifact Registry repository that serves the
    stack's package_index, when it is in the stack's project: roles/artifactregistry.reader on
    it alone, which the hosts' pip and uv need for a build."""
    display_name: str = "Multislice TPU workers"
    """Shown in the console's service account list."""


class TrainerIdentity(pulumi.ComponentResource):
    account: gcp.serviceaccount.Account

    def __init__(self, name: str, args: IdentityArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("multislice:infra:Identity", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.account = gcp.serviceaccount.Account(
            args.account_id,  # logical name = GCP account id (infra/stack_config/names.py)
            project=args.project,
            account_id=args.account_id,
            display_name=args.display_name,
            opts=child,
        )
        member = self.account.email.apply(lambda email: f"serviceAccount:{email}")
        self.bucket_read = gcp.storage.BucketIAMMember(
            f"{args.account_id}-bucket-read",  # IAM bindings have no GCP name of their own
            bucket=args.bucket,
            role=BUCKET_READ_ROLE,
            member=member,
            opts=child,
        )
        self.bucket_write = gcp.storage.BucketIAMMember(
            f"{args.account_id}-bucket-write",
            bucket=args.bucket,
            role=BUCKET_WRITE_ROLE,
            member=member,
            condition=gcp.storage.BucketIAMMemberConditionArgs(
                title="multislice-host-writes",
                description="The hosts write their run, boot logs and prepared data only; the "
                            "launch spec, code/ and envs/ are the deployer's.",
                expression=pulumi.Output.from_input(args.bucket).apply(
                    lambda bucket: host_write_condition(bucket, args.write_prefixes)),
            ),
            opts=child,
        )
        self.index_read = None
        if args.index_repository is not None:
            project, location, repository = args.index_repository
            self.index_read = gcp.artifactregistry.RepositoryIamMember(
                f"{args.account_id}-index-read",
                project=project,
                location=location,
                repository=repository,
                role=INDEX_READ_ROLE,
                member=member,
                opts=child,
            )
        self.data_access = [
            gcp.storage.BucketIAMMember(
                f"{args.account_id}-data-{bucket}",
                bucket=bucket,
                role=DATA_BUCKET_ROLE,
                member=member,
                opts=child,
            )
            for bucket in args.data_buckets
        ]
        self.project_roles = [
            gcp.projects.IAMMember(
                f"{args.account_id}-{role.split('/')[1].replace('.', '-').lower()}",
                project=args.project,
                role=role,
                member=member,
                opts=child,
            )
            for role in args.project_roles
        ]
        self.deployer_act_as = (
            gcp.serviceaccount.IAMMember(
                f"{args.account_id}-deployer-act-as",
                service_account_id=self.account.name,
                role=ACT_AS_ROLE,
                member=args.deployer,
                opts=child,
            )
            if args.deployer else None
        )
        self.register_outputs({"email": self.account.email})

    @property
    def grants(self) -> list[pulumi.Resource]:
        """Every role binding of the account: what a launch spec must wait for."""
        return [self.bucket_read, self.bucket_write, *self.data_access, *self.project_roles,
                *([self.index_read] if self.index_read is not None else [])]
