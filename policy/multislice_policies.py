"""The policies of the multislice pack, as plain functions plus their pulumi-policy wrappers.

Each `check_*` function takes the argument bag pulumi-policy passes (anything with
`resource_type`, `props`, `urn`, `name` and `get_config()`) and a `report_violation(message)`
callback, so tests call them directly with fake arguments.

Property names are the engine's (camelCase for pulumi-gcp resources). The queued resource is a
Pulumi dynamic resource (type `pulumi-python:dynamic:Resource`), recognised by its inputs: the
flat spec of infra/tpu_vm/request.py (see is_queued_resource).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pulumi_policy import (
    EnforcementLevel,
    PolicyConfigSchema,
    ResourceValidationPolicy,
    StackValidationPolicy,
)
from pulumi_policy.proxy import UnknownValueError

FIREWALL = "gcp:compute/firewall:Firewall"
BUCKET = "gcp:storage/bucket:Bucket"
INSTANCE = "gcp:compute/instance:Instance"
INSTANCE_TEMPLATE = "gcp:compute/instanceTemplate:InstanceTemplate"
TPU_VM = "gcp:tpu/v2Vm:V2Vm"
NODE_POOL = "gcp:container/nodePool:NodePool"  # a GKE TPU slice when it has a TPU topology
CLUSTER = "gcp:container/cluster:Cluster"
BUCKET_IAM = ("gcp:storage/bucketIAMMember:BucketIAMMember",
              "gcp:storage/bucketIAMBinding:BucketIAMBinding")
# Roles that let a member create, overwrite or delete objects of a bucket.
BUCKET_WRITE_ROLES = frozenset({
    "roles/storage.objectUser", "roles/storage.objectCreator", "roles/storage.objectAdmin",
    "roles/storage.admin", "roles/storage.legacyBucketWriter", "roles/storage.legacyBucketOwner",
})
# The service accounts the toolkit's hosts and pods run as (infra/stack_config/names.py: ms-STACK-tpu).
TRAINER_ACCOUNT = re.compile(r"^serviceAccount:ms-[a-z0-9-]+-tpu@")
DYNAMIC = "pulumi-python:dynamic:Resource"

OPEN_RANGES = frozenset({"0.0.0.0/0", "::/0"})
DEFAULT_COMPUTE_SA = re.compile(r"-compute@developer\.gserviceaccount\.com$", re.IGNORECASE)

DEFAULT_REQUIRED_LABELS: tuple[str, ...] = ("multislice-stack",)
DEFAULT_MAX_SLICES = 16
LABELLED_TYPES = frozenset({BUCKET, INSTANCE, TPU_VM})

ReportViolation = Callable[..., None]


class ValidationArgs(Protocol):
    resource_type: str
    props: Mapping[str, Any]
    urn: str
    name: str

    def get_config(self) -> Mapping[str, Any]: ...


def _get(mapping: Any, *names: str) -> Any:
    """The first present key among `names` (camelCase and snake_case spellings of one field)."""
    if not isinstance(mapping, Mapping):
        return None
    for name in names:
        if name in mapping and mapping[name] is not None:
            return mapping[name]
    return None


def stack_of(urn: str) -> str:
    """The stack name inside a URN: `urn:pulumi:STACK::PROJECT::TYPE::NAME`."""
    head = urn.split("::", 1)[0]
    return head.split(":")[-1] if head.startswith("urn:pulumi:") else ""


def is_queued_resource(resource_type: str, props: Mapping[str, Any]) -> bool:
    """The queued-resource dynamic resource: its inputs are infra/tpu_vm/request.py's flat spec."""
    return resource_type == DYNAMIC and "queued_resource_id" in props and "accelerator_type" in props


@dataclass(frozen=True)
class TpuNodes:
    """The TPU nodes one resource creates: a pulumi-gcp TPU VM, a queued resource's slices, or a
    GKE TPU slice node pool.

    Fields are read when a check asks, so a value unknown during preview only matters to the
    check that reads it.
    """

    props: Mapping[str, Any]
    kind: str  # vm (gcp.tpu.V2Vm) | queued (the flat spec, snake_case) | node_pool (GKE)
    slices: int

    def external_ips(self) -> bool:
        if self.kind == "queued":
            return bool(self.props.get("enable_external_ips", False))
        if self.kind == "node_pool":  # private nodes are the cluster's setting, not the pool's
            return False
        return bool(_get(_get(self.props, "networkConfig"), "enableExternalIps"))

    def service_account_email(self) -> Any:
        if self.kind == "queued":
            return self.props.get("service_account_email")
        if self.kind == "node_pool":
            return _get(_get(self.props, "nodeConfig"), "serviceAccount")
        return _get(_get(self.props, "serviceAccount"), "email")

    def labels(self) -> Mapping[str, Any]:
        if self.kind == "node_pool":
            return _get(_get(self.props, "nodeConfig"), "labels") or {}
        return _get(self.props, "labels") or {}


def tpu_nodes(resource_type: str, props: Mapping[str, Any]) -> TpuNodes | None:
    if resource_type == TPU_VM:
        return TpuNodes(props, kind="vm", slices=1)
    if is_queued_resource(resource_type, props):
        return TpuNodes(props, kind="queued", slices=int(props.get("slices") or 1))
    if resource_type == NODE_POOL and _get(_get(props, "placementPolicy"), "tpuTopology"):
        return TpuNodes(props, kind="node_pool", slices=1)  # one pool is one slice
    return None


def _walk_strings(value: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """Every string inside `value` with its path; values unknown during preview are skipped."""
    if isinstance(value, str):
        yield path, value
        return
    if isinstance(value, Mapping):
        items = [(str(key), f"{path}.{key}" if path else str(key)) for key in value]
        children = [(key, child_path) for key, child_path in items if not key.startswith("__")]
    elif isinstance(value, Sequence):
        children = [(index, f"{path}[{index}]") for index in range(len(value))]
    else:
        return
    for key, child_path in children:
        try:
            item = value[key]
        except UnknownValueError:
            continue
        yield from _walk_strings(item, child_path)


def check_no_open_ingress(args: ValidationArgs, report_violation: ReportViolation) -> None:
    if args.resource_type != FIREWALL:
        return
    props = args.props
    if str(_get(props, "direction") or "INGRESS").upper() != "INGRESS" or _get(props, "disabled"):
        return
    opened = sorted(set(_get(props, "sourceRanges") or []) & OPEN_RANGES)
    if opened:
        report_violation(
            f"firewall {args.urn} allows ingress from {', '.join(opened)}; allowed: source tags or "
            "specific ranges (e.g. the IAP range 35.235.240.0/20 for SSH)"
        )


def check_no_external_ips(args: ValidationArgs, report_violation: ReportViolation) -> None:
    allowed = args.get_config().get("allowExternalIpsStacks") or []
    stack = stack_of(args.urn)
    if stack in allowed:
        return
    if args.resource_type == CLUSTER:
        private = _get(_get(args.props, "privateClusterConfig"), "enablePrivateNodes")
        if private is not True:
            report_violation(
                f"GKE cluster {args.urn} gives its nodes external IPs (privateClusterConfig."
                f"enablePrivateNodes={private!r}) in stack {stack!r}; stacks allowed external "
                f"IPs: {sorted(allowed)}. Use private nodes and Cloud NAT for egress instead"
            )
        return
    nodes = tpu_nodes(args.resource_type, args.props)
    if nodes is not None and nodes.external_ips():
        report_violation(
            f"TPU nodes of {args.urn} get external IPs (networkConfig.enableExternalIps=true) "
            f"in stack {stack!r}; stacks allowed external IPs: {sorted(allowed)}. "
            "Use Cloud NAT for egress instead, or add the stack to allowExternalIpsStacks"
        )


def check_bucket_public_access_prevention(
    args: ValidationArgs, report_violation: ReportViolation
) -> None:
    if args.resource_type != BUCKET:
        return
    value = _get(args.props, "publicAccessPrevention")
    if value != "enforced":
        report_violation(
            f"bucket {args.urn} has publicAccessPrevention={value!r}; allowed: 'enforced'"
        )


def check_trainer_bucket_writes_conditioned(
    args: ValidationArgs, report_violation: ReportViolation
) -> None:
    """The hosts' account writes a bucket only under an IAM Condition (their run directory and
    logs): an unconditional write role would let any one host rewrite the launch spec, code/ or
    envs/ that every host runs."""
    if args.resource_type not in BUCKET_IAM or _get(args.props, "role") not in BUCKET_WRITE_ROLES:
        return
    members = _get(args.props, "members") or [_get(args.props, "member")]
    trainers = [m for m in members if isinstance(m, str) and TRAINER_ACCOUNT.match(m)]
    condition = _get(args.props, "condition")
    if trainers and not (condition and _get(condition, "expression")):
        report_violation(
            f"{args.urn} grants {_get(args.props, 'role')} on bucket {_get(args.props, 'bucket')!r} "
            f"to {', '.join(trainers)} without a condition; allowed: a write role conditioned on "
            "the object names the hosts write (resource.name.startsWith(...))"
        )


def check_no_default_compute_service_account(
    args: ValidationArgs, report_violation: ReportViolation
) -> None:
    for path, value in _walk_strings(args.props):
        if DEFAULT_COMPUTE_SA.search(value.removeprefix("serviceAccount:")):
            report_violation(
                f"{args.urn} uses the default compute service account ({path}={value!r}); "
                "allowed: a dedicated least-privilege service account"
            )
            return
    if args.resource_type in (INSTANCE, INSTANCE_TEMPLATE):
        account = _get(args.props, "serviceAccount")
        if account is not None and not _get(account, "email"):
            report_violation(
                f"{args.urn} attaches a service account block without an email, which means the "
                "default compute service account; allowed: an explicit dedicated account's email"
            )
        return
    nodes = tpu_nodes(args.resource_type, args.props)
    if nodes is not None and not _email_set(nodes):
        report_violation(
            f"TPU nodes of {args.urn} set no serviceAccount.email, so they would run as the "
            "default compute service account; allowed: a dedicated account's email"
        )


def _email_set(nodes: TpuNodes) -> bool:
    """Whether the nodes name a service account; one unknown during preview counts as named."""
    try:
        return bool(nodes.service_account_email())
    except UnknownValueError:
        return True


def _labels_of(resource_type: str, props: Mapping[str, Any]) -> list[Mapping[str, Any]] | None:
    if resource_type in LABELLED_TYPES:
        return [_get(props, "labels") or {}]
    nodes = tpu_nodes(resource_type, props)
    return [nodes.labels()] if nodes is not None else None


def check_required_labels(args: ValidationArgs, report_violation: ReportViolation) -> None:
    required = list(args.get_config().get("requiredLabels", DEFAULT_REQUIRED_LABELS))
    label_sets = _labels_of(args.resource_type, args.props)
    if label_sets is None:
        return
    for labels in label_sets:
        missing = [key for key in required if not labels.get(key)]
        if missing:
            report_violation(
                f"{args.urn} lacks required labels {missing} (has {sorted(labels)}); "
                f"required: {required}"
            )
            return


def check_slice_cap(args: Any, report_violation: ReportViolation) -> None:
    """Stack policy: the slices of all queued resources and TPU VMs together stay under the cap."""
    cap = int(args.get_config().get("maxSlices", DEFAULT_MAX_SLICES))
    per_resource = []
    for resource in args.resources:
        nodes = tpu_nodes(resource.resource_type, resource.props)
        count = nodes.slices if nodes is not None else 0
        if count:
            per_resource.append((resource.urn, count))
    total = sum(count for _, count in per_resource)
    if total > cap:
        detail = ", ".join(f"{urn}: {count}" for urn, count in per_resource)
        report_violation(
            f"the stack requests {total} TPU slices ({detail}); the cap is maxSlices={cap}"
        )


def build_policies() -> list[ResourceValidationPolicy | StackValidationPolicy]:
    mandatory = EnforcementLevel.MANDATORY
    return [
        ResourceValidationPolicy(
            name="no-open-ingress",
            description="Firewall rules must not allow ingress from 0.0.0.0/0 or ::/0.",
            validate=check_no_open_ingress,
            enforcement_level=mandatory,
        ),
        ResourceValidationPolicy(
            name="no-tpu-external-ips",
            description="TPU nodes get no external IPs unless the stack is listed as allowed.",
            validate=check_no_external_ips,
            enforcement_level=mandatory,
            config_schema=PolicyConfigSchema(
                properties={
                    "allowExternalIpsStacks": {
                        "type": "array",
                        "items": {"type": "string"},
                        "default": [],
                    }
                }
            ),
        ),
        ResourceValidationPolicy(
            name="bucket-public-access-prevention",
            description="Buckets must enforce public access prevention.",
            validate=check_bucket_public_access_prevention,
            enforcement_level=mandatory,
        ),
        ResourceValidationPolicy(
            name="trainer-bucket-writes-conditioned",
            description="The hosts' service account writes a bucket only under an IAM Condition.",
            validate=check_trainer_bucket_writes_conditioned,
            enforcement_level=mandatory,
        ),
        ResourceValidationPolicy(
            name="no-default-compute-service-account",
            description="Nothing runs as or grants to the default compute service account.",
            validate=check_no_default_compute_service_account,
            enforcement_level=mandatory,
        ),
        ResourceValidationPolicy(
            name="required-labels",
            description="Labelled resources carry the required labels.",
            validate=check_required_labels,
            enforcement_level=mandatory,
            config_schema=PolicyConfigSchema(
                properties={
                    "requiredLabels": {
                        "type": "array",
                        "items": {"type": "string"},
                        "default": list(DEFAULT_REQUIRED_LABELS),
                    }
                }
            ),
        ),
        StackValidationPolicy(
            name="max-slices-per-stack",
            description="A stack requests at most maxSlices TPU slices.",
            validate=check_slice_cap,
            enforcement_level=mandatory,
            config_schema=PolicyConfigSchema(
                properties={
                    "maxSlices": {"type": "integer", "minimum": 1, "default": DEFAULT_MAX_SLICES}
                }
            ),
        ),
    ]
