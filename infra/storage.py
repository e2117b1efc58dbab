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
    """Bucket name (infra/names.py): code/, runs/STACK/ (checkpoints, metrics, logs)."""
    archive_path: Path
    """Local path of the experiment archive (infra/archive.py) uploaded as archive_object."""
    archive_object: str
    """Object name of the archive, code/<sha256>.tar.gz: the VMs verify the hash."""
    launch_spec_object: str = ""
    """Object name of the launch spec, launch/STACK.json (fixed: the VMs' metadata names it)."""
    launch_spec_text: str = ""
    """Its content (infra/manifest.py:launch_spec_text); a change is an update of this object."""
    labels: dict[str, str] = field(default_factory=dict)
    """Labels of the bucket (the toolkit's multislice-stack label included)."""
    delete_on_destroy: bool = False
    """Let `pulumi destroy` delete the bucket and everything in it (checkpoints, environments,
    logs). Off: the bucket is retained (left in place, dropped from the stack's state)."""


class ExperimentStorage(pulumi.ComponentResource):
    bucket: gcp.storage.Bucket
    archive: gcp.storage.BucketObject
    launch_spec: gcp.storage.BucketObject

    def __init__(self, name: str, args: StorageArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("multislice:infra:Storage", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.bucket = gcp.storage.Bucket(
            args.bucket_name,  # logical name = GCP name (infra/names.py)
            name=args.bucket_name,
            project=args.project,
            location=args.location,
            uniform_bucket_level_access=True,
            public_access_prevention="enforced",
            labels=args.labels,
            force_destroy=args.delete_on_destroy,
            opts=pulumi.ResourceOptions(parent=self, retain_on_delete=not args.delete_on_destroy),
        )
        self.archive = gcp.storage.BucketObject(
            f"{args.bucket_name}/{args.archive_object}",  # as gcloud storage ls shows it
            bucket=self.bucket.name,
            name=args.archive_object,
            source=pulumi.FileAsset(str(args.archive_path)),
            content_type="application/gzip",
            opts=child,
        )
        # After the archive it names. A new content may replace the object (same name): delete
        # first, or the create-then-delete order would delete the new one. Hosts that poll in
        # the gap see 404 and wait for it.
        self.launch_spec = gcp.storage.BucketObject(
            f"{args.bucket_name}/{args.launch_spec_object}",
            bucket=self.bucket.name,
            name=args.launch_spec_object,
            # An asset, not `content`: pulumi-gcp marks `content` secret, which would hide the
            # spec's changes from `pulumi preview --diff` and from the PR's render diff.
            source=pulumi.StringAsset(args.launch_spec_text),
            content_type="application/json",
            opts=pulumi.ResourceOptions(parent=self, depends_on=[self.archive],
                                        delete_before_replace=True),
        )
        self.register_outputs({"bucket": self.bucket.name, "archive": self.archive.output_name,
                               "launch_spec": self.launch_spec.output_name})
