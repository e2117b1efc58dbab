"""Bucket for code, checkpoints and logs, plus the experiment archive named by its content hash."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pulumi
import pulumi_gcp as gcp


@dataclass
class StorageArgs:
    project: str
    location: str
    bucket_name: str
    archive_path: Path
    archive_object: str
    labels: dict[str, str] = field(default_factory=dict)
    force_destroy: bool = False


class ExperimentStorage(pulumi.ComponentResource):
    bucket: gcp.storage.Bucket
    archive: gcp.storage.BucketObject

    def __init__(self, name: str, args: StorageArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("multislice:infra:Storage", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.bucket = gcp.storage.Bucket(
            f"{name}-bucket",
            name=args.bucket_name,
            project=args.project,
            location=args.location,
            uniform_bucket_level_access=True,
            public_access_prevention="enforced",
            labels=args.labels,
            force_destroy=args.force_destroy,
            opts=child,
        )
        self.archive = gcp.storage.BucketObject(
            f"{name}-archive",
            bucket=self.bucket.name,
            name=args.archive_object,
            source=pulumi.FileAsset(str(args.archive_path)),
            content_type="application/gzip",
            opts=child,
        )
        self.register_outputs({"bucket": self.bucket.name, "archive": self.archive.output_name})
