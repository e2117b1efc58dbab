"""The policies of the multislice pack, as plain functions plus their pulumi-policy wrappers.

Each `check_*` function takes the argument bag pulumi-policy passes (anything with
`resource_type`, `props`, `urn`, `name` and `get_config()`) and a `report_violation(message)`
callback, so tests call them directly with fake arguments.

Property names are the engine's (camelCase for pulumi-gcp resources). The queued resource is a
Pulumi dynamic resource (type `pulumi-python:dynamic:Resource`), recognised by its inputs: the
flat spec of infra/tpu_request.py, or a full API request under `request` (see is_queued_resource).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
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


def is_flat_queued_resource_spec(props: Mapping[str, Any]) -> bool:
    """The queued-resource dynamic resource's inputs (see infra/tpu_request.py): a flat spec."""
    return "queued_resource_id" in props and "accelerator_type" in props


def queued_resource_request(props: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The TPU API `QueuedResource` body when the inputs carry the full API request.

    Accepted under `request` either as the `QueuedResource` itself or as the
    `CreateQueuedResourceRequest` holding it (`queued_resource`), in snake_case or camelCase.
    """
    request = _get(props, "request")
    if not isinstance(request, Mapping):
        return None
    body = _get(request, "queuedResource", "queued_resource") or request
    tpu = _get(body, "tpu")
    if not isinstance(tpu, Mapping) or _get(tpu, "nodeSpec", "node_spec") is None:
        return None
    return body


def _node_specs(body: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    specs = _get(_get(body, "tpu"), "nodeSpec", "node_spec") or []
    return [spec for spec in specs if isinstance(spec, Mapping)]


class _FlatSpecNode(Mapping):
    """A node-shaped view (networkConfig, serviceAccount, labels) of the flat spec.

    Lazy, so a field that is unknown during preview only matters to the check that reads it.
    """

    _FIELDS = ("networkConfig", "serviceAccount", "labels")

    def __init__(self, spec: Mapping[str, Any]) -> None:
        self._spec = spec

    def __getitem__(self, key: str) -> Any:
        if key == "networkConfig":
            return {"enableExternalIps": bool(self._spec.get("enable_external_ips", False))}
        if key == "serviceAccount":
            return _LazyEmail(self._spec)
        if key == "labels":
            return self._spec.get("labels") or {}
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._FIELDS)

    def __len__(self) -> int:
        return len(self._FIELDS)


class _LazyEmail(Mapping):
    def __init__(self, spec: Mapping[str, Any]) -> None:
        self._spec = spec

    def __getitem__(self, key: str) -> Any:
        if key != "email":
            raise KeyError(key)
        return self._spec.get("service_account_email")

    def __iter__(self) -> Iterator[str]:
        return iter(("email",))

    def __len__(self) -> int:
        return 1


def is_queued_resource(resource_type: str, props: Mapping[str, Any]) -> bool:
    return resource_type == DYNAMIC and (
        is_flat_queued_resource_spec(props) or queued_resource_request(props) is not None
    )


def tpu_nodes(resource_type: str, props: Mapping[str, Any]) -> Iterator[tuple[Mapping[str, Any], int]]:
    """(node definition, slice count) for every TPU node template the resource creates."""
    if resource_type == TPU_VM:
        yield props, 1
        return
    if resource_type != DYNAMIC:
        return
    if is_flat_queued_resource_spec(props):
        yield _FlatSpecNode(props), int(props.get("slices") or 1)
        return
    body = queued_resource_request(props)
    if body is None:
        return
    for spec in _node_specs(body):
        multislice = _get(spec, "multisliceParams", "multislice_params")
        count = _get(multislice, "nodeCount", "node_count")
        yield _get(spec, "node") or {}, int(count) if count is not None else 1


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
    for node, _ in tpu_nodes(args.resource_type, args.props):
        network = _get(node, "networkConfig", "network_config")
        if _get(network, "enableExternalIps", "enable_external_ips"):
            report_violation(
                f"TPU nodes of {args.urn} get external IPs (networkConfig.enableExternalIps=true) "
                f"in stack {stack!r}; stacks allowed external IPs: {sorted(allowed)}. "
                "Use Cloud NAT for egress instead, or add the stack to allowExternalIpsStacks"
            )
            return


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
    for node, _ in tpu_nodes(args.resource_type, args.props):
        if not _email_set(node):
            report_violation(
                f"TPU nodes of {args.urn} set no serviceAccount.email, so they would run as the "
                "default compute service account; allowed: a dedicated account's email"
            )
            return


def _email_set(node: Mapping[str, Any]) -> bool:
    """Whether the node names a service account; one unknown during preview counts as named."""
    try:
        return bool(_get(_get(node, "serviceAccount", "service_account"), "email"))
    except UnknownValueError:
        return True


def _labels_of(resource_type: str, props: Mapping[str, Any]) -> list[Mapping[str, Any]] | None:
    if resource_type in LABELLED_TYPES:
        return [_get(props, "labels") or {}]
    if is_queued_resource(resource_type, props):
        return [_get(node, "labels") or {} for node, _ in tpu_nodes(resource_type, props)]
    return None


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
        count = sum(n for _, n in tpu_nodes(resource.resource_type, resource.props))
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
