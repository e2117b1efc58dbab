"""A dedicated service account for the TPU VMs with only what training needs.

Never the default compute service account (it has project Editor in many projects).
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

from infra.manifest import BUCKET_ROLE, LOGGING_ROLES


@dataclass
class IdentityArgs:
    project: str
    account_id: str
    bucket: pulumi.Input[str]
    display_name: str = "Multislice TPU workers"


class TrainerIdentity(pulumi.ComponentResource):
    account: gcp.serviceaccount.Account

    def __init__(self, name: str, args: IdentityArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("multislice:infra:Identity", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.account = gcp.serviceaccount.Account(
            f"{name}-sa",
            project=args.project,
            account_id=args.account_id,
            display_name=args.display_name,
            opts=child,
        )
        member = self.account.email.apply(lambda email: f"serviceAccount:{email}")
        self.bucket_access = gcp.storage.BucketIAMMember(
            f"{name}-bucket-objects",
            bucket=args.bucket,
            role=BUCKET_ROLE,
            member=member,
            opts=child,
        )
        self.project_roles = [
            gcp.projects.IAMMember(
                f"{name}-{role.split('/')[1].replace('.', '-').lower()}",
                project=args.project,
                role=role,
                member=member,
                opts=child,
            )
            for role in LOGGING_ROLES
        ]
        self.register_outputs({"email": self.account.email})
