"""The ``MultisliceQueuedResource`` component over the TPU dynamic provider
(infra/tpu_vm/provider.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi.dynamic

from infra.tpu_vm.provider import QueuedResourceProvider


class TpuQueuedResource(pulumi.dynamic.Resource):
    """One queued resource (N slices). Inputs: the flat spec of infra.tpu_vm.request."""

    name: pulumi.Output[str]
    state: pulumi.Output[str]
    node_ids: pulumi.Output[list[str]]
    node_names: pulumi.Output[list[str]]

    def __init__(self, name: str, spec: dict[str, Any], opts: pulumi.ResourceOptions | None = None):
        props = {**spec, "name": None, "state": None, "node_ids": None, "node_names": None}
        super().__init__(QueuedResourceProvider(), name, props, opts)


@dataclass
class MultisliceQueuedResourceArgs:
    """What MultisliceQueuedResource creates."""

    spec: dict[str, Any]
    """The dynamic provider's flat inputs, from infra.stack_config.manifest.queued_resource_spec: project,
    zone, queued_resource_id, accelerator_type, runtime_version, slices, node_prefix, network,
    subnetwork, enable_external_ips, tags, labels, service_account_email, metadata (startup
    script, launch spec), capacity, reservation_name, valid_until/valid_after, wait_for_active_s."""


class MultisliceQueuedResource(pulumi.ComponentResource):
    resource: TpuQueuedResource

    def __init__(
        self,
        name: str,
        args: MultisliceQueuedResourceArgs,
        opts: pulumi.ResourceOptions | None = None,
    ):
        super().__init__("multislice:infra:QueuedResource", name, None, opts)
        self.resource = TpuQueuedResource(
            args.spec["queued_resource_id"],  # logical name = the queued resource's id
            args.spec,
            # Same queued-resource id on replace: the old one must go first.
            opts=pulumi.ResourceOptions(parent=self, delete_before_replace=True),
        )
        self.queued_resource_name = self.resource.name
        self.node_names = self.resource.node_names
        self.register_outputs(
            {"queued_resource_name": self.resource.name, "node_names": self.resource.node_names}
        )
