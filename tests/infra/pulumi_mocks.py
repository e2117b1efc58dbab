"""Run the Pulumi program under the mock runtime and record every resource it registers."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pulumi

from infra.stack_config.names import node_ids
from infra.tpu_vm.api import node_name, queued_resource_name

PROJECT = "multislice"
DYNAMIC = "pulumi-python:dynamic:Resource"


@dataclass
class Registered:
    typ: str
    name: str
    inputs: dict[str, Any]
    import_id: str | None = None
    """The id the engine was asked to import (the ``import_`` option), None for a create."""

    @property
    def urn(self) -> str:
        return f"urn:pulumi:mock::{PROJECT}::{self.typ}::{self.name}"

    def expect(self, key: str, expected: Any) -> None:
        actual = self.inputs.get(key)
        assert actual == expected, f"{self.urn}: {key} is {actual!r}, expected {expected!r}"


_current: list[RecordingMocks | None] = [None]


class AlreadyExists(Exception):
    """What pulumi-kubernetes reports when the API server refuses a create (client-side, the
    default from v4.29 without upsertExistingObjects) of an object that exists."""


class RecordingMocks(pulumi.runtime.Mocks):
    def __init__(self, cluster_objects: set[tuple[str, str | None, str]] | None = None) -> None:
        # (kind, namespace or None, name) of the objects the cluster holds before `pulumi up`
        self.cluster_objects = set(cluster_objects or ())
        self.providers: dict[str, dict[str, Any]] = {}  # a provider's id -> its inputs
        self.resources: list[Registered] = []
        self.options: dict[str, pulumi.ResourceOptions] = {}  # logical name -> its options
        self.objects: dict[str, pulumi.Resource] = {}  # logical name -> the resource object

    def record_options(self, args: pulumi.ResourceTransformationArgs) -> None:
        """A stack transformation: keeps each resource's options (retain_on_delete,
        depends_on...), which the mock monitor never sees. Stack transformations outlive a
        run in this process, so only the mocks of the newest run records."""
        if _current[0] is not self:
            return
        self.options[args.name] = args.opts
        self.objects[args.name] = args.resource

    def _refuse_an_existing_object(self, args: pulumi.runtime.MockResourceArgs,
                                   inputs: dict[str, Any]) -> None:
        if not args.typ.startswith("kubernetes:") or args.typ.startswith("kubernetes:yaml"):
            return
        meta = inputs.get("metadata") or {}
        key = (args.typ.rsplit(":", 1)[-1], meta.get("namespace"), meta.get("name"))
        # a provider reference is "URN::ID"; the mocks give every resource the id NAME_id
        provider = self.providers.get((args.provider or "").rsplit("::", 1)[-1], {})
        if key in self.cluster_objects and not args.resource_id and \
                str(provider.get("upsertExistingObjects", "")).lower() != "true":
            kind = key[0].lower() + "s"
            raise AlreadyExists(f'resource "{key[2]}" was not successfully created by the '
                                f'Kubernetes API server: {kind} "{key[2]}" already exists')

    def new_resource(self, args: pulumi.runtime.MockResourceArgs):
        inputs = dict(args.inputs)
        if args.typ.startswith("pulumi:providers:"):
            self.providers[f"{args.name}_id"] = inputs
        self._refuse_an_existing_object(args, inputs)
        self.resources.append(Registered(args.typ, args.name, inputs, args.resource_id or None))
        from infra.gke.manifest import mock_resource_outputs

        outputs = {**inputs, **mock_resource_outputs(args.typ, inputs)}
        if args.typ == "gcp:serviceaccount/account:Account":
            outputs["email"] = f"{inputs['accountId']}@{inputs['project']}.iam.gserviceaccount.com"
            outputs["name"] = f"projects/{inputs['project']}/serviceAccounts/{outputs['email']}"
        if args.typ == DYNAMIC and "queued_resource_id" in inputs:
            outputs["name"] = queued_resource_name(
                inputs["project"], inputs["zone"], inputs["queued_resource_id"]
            )
            outputs["node_names"] = [
                node_name(inputs["project"], inputs["zone"], i)
                for i in node_ids(inputs["node_prefix"], int(inputs["slices"]))
            ]
            outputs["state"] = "ACTIVE"
        return [f"{args.name}_id", outputs]

    def call(self, args: pulumi.runtime.MockCallArgs):
        from infra.gke.manifest import mock_call_result

        return mock_call_result(args.token, dict(args.args))

    def of_type(self, typ: str) -> list[Registered]:
        """In name order: the engine registers resources as their inputs resolve, in no fixed
        order (two node pools came in either order)."""
        return sorted((r for r in self.resources if r.typ == typ), key=lambda r: r.name)

    def queued_resource(self) -> Registered:
        """The queued resource: the dynamic resource with a queued_resource_id (the others are
        preview's checks: infra/preview/run_check.py, infra/gke/cluster_check.py)."""
        (found,) = [r for r in self.of_type(DYNAMIC) if "queued_resource_id" in r.inputs]
        return found

    def one(self, typ: str) -> Registered:
        found = self.of_type(typ)
        assert len(found) == 1, f"expected one {typ}, got {[r.urn for r in found]}"
        return found[0]


def run_program(
    config: dict[str, Any], base_dir: Path, stack: str = "exp",
    cluster_objects: set[tuple[str, str | None, str]] | None = None,
    live_jobsets: dict[tuple[str, str], dict[str, Any]] | None = None,
) -> tuple[RecordingMocks, dict[str, Any]]:
    """Evaluate the program (validation + wiring) for ``config`` (un-namespaced keys), against a
    cluster that already holds ``cluster_objects`` ((kind, namespace, name)) and the JobSets
    ``live_jobsets`` ((namespace, name) -> the object as the API server returns it)."""
    from infra.gke import live_run
    from infra.stack import create_stack
    from infra.stack_config.pulumi_config import load_stack_config

    mocks = RecordingMocks(cluster_objects)
    _current[0] = mocks
    pulumi.runtime.set_mocks(mocks, project=PROJECT, stack=stack, preview=False)
    pulumi.runtime.set_all_config(
        {f"multislice:{k}": v if isinstance(v, str) else json.dumps(v) for k, v in config.items()}
    )
    outputs: dict[str, Any] = {}

    @pulumi.runtime.test
    def program():
        pulumi.runtime.register_stack_transformation(mocks.record_options)
        cfg, _ = load_stack_config(base_dir=base_dir)
        outs = create_stack(cfg, base_dir)
        return pulumi.Output.all(**outs).apply(outputs.update)

    live = live_jobsets or {}
    live_run.reader = lambda _endpoint, _ca, namespace, name: live.get((namespace, name))
    try:
        program()
    finally:
        live_run.reader = None
    return mocks, outputs
