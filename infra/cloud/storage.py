"""Bucket for code, checkpoints and logs, the experiment archive named by its content hash, and the
launch spec object every VM reads (and polls) to know what to train."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pulumi
import pulumi_gcp as gcp


@dataclass
class StorageArgs:
    """What ExperimentStorage creates."""

    project: str
    """Google Cloud project id."""
    location: str
    """Bucket location: the slices' region, so checkpoints never cross regions."""
    bucket_name: str
    """Bucket name (infra/stack_config/names.py): code/, runs/STACK/ (checkpoints, metrics, logs)."""
    archive_path: Path
    """Local path of the experiment archive (infra/packaging/archive.py) uploaded as archive_object."""
    archive_object: str
    """Object name of the archive, code/<sha256>.tar.gz: the VMs verify the hash."""
    labels: dict[str, str] = field(default_factory=dict)
    """Labels of the bucket (the toolkit's multislice-stack label included)."""
    delete_on_destroy: bool = False
    """Let `pulumi destroy` delete the bucket and everything in it (checkpoints, environments,
    logs). Off: the bucket is retained (left in place, dropped from the stack's state).
    `pulumi destroy` reads both from the state, so a change takes a `pulumi up` first."""
    adopt_existing: bool = False
    """Import a bucket of this name that exists (kept by an earlier destroy) instead of creating
    it: the ``import_`` option under this component, where the program declares it."""
    soft_delete_days: int = 0
    """Soft-delete retention of the bucket in days; 0 turns soft delete off."""
    kms_key: str | None = None
    """A Cloud KMS key the bucket encrypts new objects with by default (CMEK), or Google's."""


class ExperimentStorage(pulumi.ComponentResource):
    """The bucket and the code archive; the launch spec is added by ``publish_launch_spec`` once
    what it relies on (the service account's grants) is declared."""

    bucket: gcp.storage.Bucket
    archive: gcp.storage.BucketObject
    launch_spec: gcp.storage.BucketObject

    def __init__(self, name: str, args: StorageArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("multislice:infra:Storage", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.bucket = gcp.storage.Bucket(
            args.bucket_name,  # logical name = GCP name (infra/stack_config/names.py)
            name=args.bucket_name,
            project=args.project,
            location=args.location,
            uniform_bucket_level_access=True,
            public_access_prevention="enforced",
            labels=args.labels,
            force_destroy=args.delete_on_destroy,
            soft_delete_policy=gcp.storage.BucketSoftDeletePolicyArgs(
                retention_duration_seconds=args.soft_delete_days * 86400),
            encryption=gcp.storage.BucketEncryptionArgs(default_kms_key_name=args.kms_key)
            if args.kms_key else None,
            opts=pulumi.ResourceOptions(
                parent=self, retain_on_delete=not args.delete_on_destroy,
                import_=args.bucket_name if args.adopt_existing else None),
        )
        self.archive = gcp.storage.BucketObject(
            f"{args.bucket_name}/{args.archive_object}",  # as gcloud storage ls shows it
            bucket=self.bucket.name,
            name=args.archive_object,
            source=pulumi.FileAsset(str(args.archive_path)),
            content_type="application/gzip",
            opts=child,
        )
        self._bucket_name = args.bucket_name

    def publish_launch_spec(self, object_name: str, text: pulumi.Input[str],
                            after: list[pulumi.Resource]) -> gcp.storage.BucketObject:
        """The launch spec object every VM polls (infra/stack_config/manifest.py:launch_spec_text).

        Written after the archive it names and after ``after``: every grant the trainer relies on
        (the VMs restart their trainers within a minute of a new generation, and a grant the spec
        lands before makes the trainer's first read of a new data bucket a 403)."""
        # After the archive it names. A new content may replace the object (same name): delete
        # first, or the create-then-delete order would delete the new one. Hosts that poll in
        # the gap see 404 and wait for it.
        self.launch_spec = gcp.storage.BucketObject(
            f"{self._bucket_name}/{object_name}",
            bucket=self.bucket.name,
            name=object_name,
            # An asset, not `content`: pulumi-gcp marks `content` secret, which would hide the
            # spec's changes from `pulumi preview --diff` and from the PR's render diff.
            source=pulumi.Output.from_input(text).apply(pulumi.StringAsset),
            content_type="application/json",
            opts=pulumi.ResourceOptions(parent=self, depends_on=[self.archive, *after],
                                        delete_before_replace=True),
        )
        self.register_outputs({"bucket": self.bucket.name, "archive": self.archive.output_name,
                               "launch_spec": self.launch_spec.output_name})
        return self.launch_spec
