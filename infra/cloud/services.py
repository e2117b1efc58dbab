"""The Google APIs the stack uses, enabled by the program itself (a fresh project has them off).

Each is a `gcp.projects.Service` with `disable_on_destroy=False`: `pulumi destroy` of one
experiment must not switch an API off under the project's other workloads. The queued resource
and everything else depends on this component, so the first `pulumi up` enables first.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

# What the program and the VMs call. cloudresourcemanager serves the project IAM grants
# (projects.IAMMember); serviceusage itself is on in every project (it enables the others).
REQUIRED_APIS = (
    "tpu.googleapis.com",  # the queued resource (TPU API v2)
    "compute.googleapis.com",  # network, subnet, firewall, router, NAT; the TPU VMs
    "iam.googleapis.com",  # the VMs' service account
    "cloudresourcemanager.googleapis.com",  # project-level role grants
    "storage.googleapis.com",  # the bucket, from the program and from the VMs
)
TPU_API = "tpu.googleapis.com"
COMPUTE_API = "compute.googleapis.com"
GKE_API = "container.googleapis.com"  # orchestration gke: the cluster and its node pools


@dataclass
class ServicesArgs:
    """What ProjectServices enables."""

    project: str
    """Google Cloud project id."""
    apis: tuple[str, ...] = REQUIRED_APIS
    """Service names, e.g. tpu.googleapis.com."""


class ProjectServices(pulumi.ComponentResource):
    services: list[gcp.projects.Service]

    def __init__(self, name: str, args: ServicesArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("multislice:infra:Services", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.services = [
            gcp.projects.Service(
                f"{name}-{api.split('.')[0]}",
                project=args.project,
                service=api,
                disable_on_destroy=False,  # other workloads of the project may use it
                disable_dependent_services=False,
                opts=child,
            )
            for api in args.apis
        ]
        self.register_outputs({"apis": [s.service for s in self.services]})
