"""The one stack-config schema: parsed from Pulumi config, validated before any resource exists.

No pulumi import. The Pulumi program, the dynamic provider's ``check``, the CLI's offline render
and the VM's launcher all use this module; the launch spec written into TPU metadata is
``StackConfig.model_dump_json()``.
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from infra.topology import SliceTopology, UnknownAcceleratorError, parse_accelerator_type

CONFIG_NAMESPACE = "multislice"
MAX_SLICES = 256
IAP_RANGE = "35.235.240.0/20"
ICI_KEYS = ("ici_data", "ici_fsdp", "ici_tensor")
DCN_KEYS = ("dcn_data", "dcn_fsdp", "dcn_tensor")
EXPERIMENT_REQUIRED = ("pyproject.toml", "configs", "trainer/main.py")

Capacity = Literal["on-demand", "spot", "reserved", "guaranteed"]


class StackConfigError(ValueError):
    """One or more problems with a stack config; ``problems`` lists each message."""

    def __init__(self, problems: list[str], source: str = "stack config") -> None:
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source} is invalid ({len(problems)} problem(s)):\n{lines}")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, coerce_numbers_to_str=True)


class Mesh(_Model):
    """Parallelism per axis; the keys are the trainer's ``mesh`` section (docs/CONTRACTS.md)."""

    ici_data: int = 1
    ici_fsdp: int = -1
    ici_tensor: int = 1
    dcn_data: int = -1
    dcn_fsdp: int = 1
    dcn_tensor: int = 1


class Trainer(_Model):
    """What the VMs run: ``python -m trainer.main --config C --steps N --set ...``."""

    config: str = "default"
    steps: int = Field(default=1000, ge=1)
    seed: int | None = None
    mesh: Mesh = Mesh()
    overrides: dict[str, str | int | float | bool] = {}


class StackConfig(_Model):
    """Everything one multislice experiment needs; keys are ``multislice:<field>`` in the stack."""

    # <= 20 characters: the service account id "ms-STACK-tpu" must fit in 30.
    stack: str = Field(pattern=r"^[a-z][a-z0-9-]{0,19}$")
    project: str = Field(min_length=1)
    region: str = Field(min_length=1)
    zone: str = Field(min_length=1)
    accelerator_type: str
    runtime_version: str = ""
    slices: int = 1
    capacity: Capacity = "on-demand"
    reservation_name: str | None = None
    valid_until: str | None = None
    valid_after: str | None = None
    subnet_cidr: str = "10.128.0.0/20"
    ssh_from_iap: bool = False
    external_ips: bool = False
    labels: dict[str, str] = {}
    tags: list[str] = []
    experiment_dir: str
    trainer: Trainer = Trainer()
    python_version: str = "3.11"
    bucket_name: str | None = None
    wait_for_active_s: int = Field(default=3600, ge=0)

    # ---- derived names (never timestamps: a resumed run must find its own directory) ----
    @property
    def topology(self) -> SliceTopology:
        return parse_accelerator_type(self.accelerator_type)

    @property
    def resource_prefix(self) -> str:
        return f"ms-{self.stack}"

    @property
    def slice_tag(self) -> str:
        return f"{self.resource_prefix}-slice"

    @property
    def bucket(self) -> str:
        return self.bucket_name or f"{self.project}-{self.resource_prefix}"

    @property
    def run_dir(self) -> str:
        return f"gs://{self.bucket}/runs/{self.stack}"

    @property
    def queued_resource_id(self) -> str:
        return f"{self.resource_prefix}-qr"

    @property
    def node_ids(self) -> list[str]:
        """Node names the API gives each slice (multislice: ``PREFIX-<i>``)."""
        if self.slices == 1:
            return [self.resource_prefix]
        return [f"{self.resource_prefix}-{i}" for i in range(self.slices)]

    @property
    def effective_runtime_version(self) -> str:
        return self.runtime_version or self.topology.generation.default_runtime_version

    def resolved_mesh(self) -> dict[str, int]:
        """Mesh with every -1 filled in (call after ``validate_stack`` passed)."""
        topo = self.topology
        ici = _fill_axes(self.trainer.mesh, ICI_KEYS, topo.devices)
        dcn = _fill_axes(self.trainer.mesh, DCN_KEYS, self.slices)
        return {**ici, **dcn}

    def all_labels(self) -> dict[str, str]:
        return {"multislice-stack": self.stack, **self.labels}


# ---------------------------------------------------------------------------------------------
# semantic validation
# ---------------------------------------------------------------------------------------------

_LABEL_RE = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
_LABEL_VALUE_RE = re.compile(r"^[a-z0-9_-]{0,63}$")
_TAG_RE = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
_DURATION_RE = re.compile(r"^(\d+)([smhd])$")


def _fill_axes(mesh: Mesh, keys: tuple[str, ...], total: int) -> dict[str, int]:
    values = {k: getattr(mesh, k) for k in keys}
    known = math.prod(v for v in values.values() if v != -1)
    return {k: (total // known if v == -1 else v) for k, v in values.items()}


def _check_axes(mesh: Mesh, keys: tuple[str, ...], total: int, what: str) -> list[str]:
    values = {k: getattr(mesh, k) for k in keys}
    shown = ", ".join(f"{k}={v}" for k, v in values.items())
    problems = [
        f"trainer.mesh.{k}: value {v} is not allowed; use a positive integer or -1 (fill in)"
        for k, v in values.items()
        if v == 0 or v < -1
    ]
    if problems:
        return problems
    fills = [k for k, v in values.items() if v == -1]
    if len(fills) > 1:
        return [f"trainer.mesh: {shown} has {len(fills)} axes set to -1; at most one per group"]
    known = math.prod(v for v in values.values() if v != -1)
    if fills:
        if total % known:
            return [
                f"trainer.mesh: {shown}: the product of the fixed axes ({known}) does not divide "
                f"{what} ({total}), so {fills[0]}=-1 cannot be filled in"
            ]
    elif known != total:
        return [f"trainer.mesh: {shown}: product is {known} but must equal {what} ({total})"]
    return []


def _parse_window(value: str) -> bool:
    if _DURATION_RE.match(value):
        return True
    try:
        datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return False
    return True


def queueing_window_to_api(value: str) -> dict[str, str]:
    """``6h`` -> ``{"duration": "21600s"}``; an ISO timestamp -> ``{"time": "...Z"}``."""
    match = _DURATION_RE.match(value)
    if match:
        unit = {"s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]
        return {"duration": f"{int(match.group(1)) * unit}s"}
    stamp = datetime.fromisoformat(value.replace("Z", "+00:00"))
    return {"time": stamp.strftime("%Y-%m-%dT%H:%M:%SZ")}


def check_experiment_dir(path: Path) -> list[str]:
    if not path.is_dir():
        return [f"experiment_dir: {str(path)!r} does not exist or is not a directory"]
    missing = [rel for rel in EXPERIMENT_REQUIRED if not (path / rel).exists()]
    if missing:
        return [
            f"experiment_dir: {str(path)!r} is not a template-shaped project: missing "
            f"{', '.join(missing)} (needs {', '.join(EXPERIMENT_REQUIRED)})"
        ]
    return []


def validate_stack(
    cfg: StackConfig, base_dir: Path | None = None, check_files: bool = True
) -> list[str]:
    """Check every rule that needs more than one field. Raises StackConfigError; returns warnings.

    ``base_dir`` resolves a relative ``experiment_dir`` (the directory holding Pulumi.yaml).
    """
    problems: list[str] = []
    warnings: list[str] = []

    topo: SliceTopology | None = None
    try:
        topo = cfg.topology
    except UnknownAcceleratorError as exc:
        problems.append(str(exc))

    if not 1 <= cfg.slices <= MAX_SLICES:
        problems.append(f"slices: value {cfg.slices} is out of range; allowed 1..{MAX_SLICES}")
    elif topo is not None:
        problems += _check_axes(
            cfg.trainer.mesh,
            ICI_KEYS,
            topo.devices,
            f"devices per slice of {topo.accelerator_type}",
        )
        problems += _check_axes(cfg.trainer.mesh, DCN_KEYS, cfg.slices, "the slice count")
    if cfg.trainer.mesh.dcn_tensor > 1:
        warnings.append(
            f"trainer.mesh.dcn_tensor: value {cfg.trainer.mesh.dcn_tensor} puts tensor "
            "parallelism on the slow DCN links; keep it 1 and use dcn_data/dcn_fsdp"
        )

    if cfg.capacity == "spot" and cfg.reservation_name:
        problems.append(
            f"capacity: 'spot' and reservation_name {cfg.reservation_name!r} are exclusive; "
            "use capacity 'reserved' with the reservation, or drop reservation_name for spot"
        )
    elif cfg.reservation_name and cfg.capacity != "reserved":
        problems.append(
            f"reservation_name: {cfg.reservation_name!r} is set but capacity is "
            f"{cfg.capacity!r}; a reservation needs capacity 'reserved'"
        )
    for key in cfg.trainer.overrides:
        if key.startswith("mesh."):
            problems.append(
                f"trainer.overrides: {key!r} is not allowed; set parallelism in trainer.mesh "
                "so it is validated against the topology"
            )

    if not cfg.zone.startswith(cfg.region + "-"):
        problems.append(
            f"zone: {cfg.zone!r} is not in region {cfg.region!r}; allowed zones look like "
            f"{cfg.region}-a, {cfg.region}-b, ..."
        )
    try:
        net = ipaddress.ip_network(cfg.subnet_cidr, strict=True)
        if net.version != 4 or not net.is_private:
            problems.append(
                f"subnet_cidr: {cfg.subnet_cidr!r} must be a private IPv4 range "
                "(10.0.0.0/8, 172.16.0.0/12 or 192.168.0.0/16)"
            )
        elif net.prefixlen > 29:
            problems.append(f"subnet_cidr: {cfg.subnet_cidr!r} is too small; allowed /8 to /29")
    except ValueError as exc:
        problems.append(f"subnet_cidr: {cfg.subnet_cidr!r} does not parse as a network ({exc})")

    for key, value in cfg.labels.items():
        if not _LABEL_RE.match(key) or not _LABEL_VALUE_RE.match(value):
            problems.append(
                f"labels: {key}={value!r} is not a valid GCP label; keys start with a lowercase "
                "letter, keys and values use only lowercase letters, digits, '_' and '-' (<= 63)"
            )
    for tag in cfg.tags:
        if not _TAG_RE.match(tag):
            problems.append(
                f"tags: {tag!r} is not a valid network tag; use lowercase letters, digits and "
                "'-', starting with a letter, at most 63 characters"
            )
    for field in ("valid_until", "valid_after"):
        value = getattr(cfg, field)
        if value is not None and not _parse_window(value):
            problems.append(
                f"{field}: {value!r} is neither a duration (e.g. 30m, 6h, 2d) nor an ISO-8601 "
                "timestamp (e.g. 2026-12-01T00:00:00Z)"
            )
    if (
        cfg.valid_until
        and cfg.valid_after
        and (_DURATION_RE.match(cfg.valid_until) or _DURATION_RE.match(cfg.valid_after))
    ):
        problems.append(
            f"valid_until/valid_after: {cfg.valid_after!r}..{cfg.valid_until!r}: when both are "
            "set they form an interval and must both be ISO-8601 timestamps"
        )
    if not re.match(r"^3\.(1[0-9]|[89])$", cfg.python_version):
        problems.append(
            f"python_version: {cfg.python_version!r} is not allowed; use 3.MINOR, 3.8 to 3.19"
        )

    if check_files:
        exp = Path(cfg.experiment_dir)
        if not exp.is_absolute() and base_dir is not None:
            exp = base_dir / exp
        problems += check_experiment_dir(exp)

    if problems:
        raise StackConfigError(problems, source=f"stack {cfg.stack!r}")
    return warnings


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------


def _format_pydantic(err: ValidationError) -> list[str]:
    out = []
    for item in err.errors():
        loc = ".".join(str(p) for p in item["loc"])
        if item["type"] == "extra_forbidden":
            allowed = ", ".join(sorted(StackConfig.model_fields))
            out.append(f"{loc}: unknown key (value {item['input']!r}); allowed keys: {allowed}")
        elif item["type"] == "missing":
            out.append(f"{loc}: required but not set")
        else:
            out.append(f"{loc}: value {item['input']!r} is not allowed: {item['msg']}")
    return out


def parse_stack(raw: Mapping[str, Any], stack: str, source: str = "stack config") -> StackConfig:
    """Build a StackConfig from un-namespaced keys; type errors become StackConfigError."""
    data = {"stack": stack, **raw}
    try:
        return StackConfig.model_validate(data)
    except ValidationError as exc:
        raise StackConfigError(_format_pydantic(exc), source=source) from None


def _decode(value: Any) -> Any:
    """Pulumi config carries structured values as JSON strings."""
    if isinstance(value, str) and value[:1] in ("{", "["):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def namespaced_to_raw(config: Mapping[str, Any]) -> dict[str, Any]:
    """``{"multislice:zone": ..., "gcp:project": ...}`` -> schema keys (gcp:* only as fallback)."""
    raw: dict[str, Any] = {}
    prefix = CONFIG_NAMESPACE + ":"
    for key, value in config.items():
        if key.startswith(prefix):
            raw[key[len(prefix) :]] = _decode(value)
    for key in ("project", "region", "zone"):
        if key not in raw and f"gcp:{key}" in config:
            raw[key] = config[f"gcp:{key}"]
    return raw


def stack_name_from_path(path: Path) -> str:
    name = path.name
    if not (name.startswith("Pulumi.") and name.endswith(".yaml")) or name == "Pulumi.yaml":
        raise StackConfigError(
            [f"file name {name!r} is not of the form Pulumi.<stack>.yaml"], source=str(path)
        )
    return name[len("Pulumi.") : -len(".yaml")]


def find_project_root(start: Path) -> Path:
    """The nearest directory at or above ``start`` holding Pulumi.yaml (else ``start``)."""
    start = start.resolve()
    for candidate in (start, *start.parents):
        if (candidate / "Pulumi.yaml").is_file():
            return candidate
    return start


def load_stack_file(
    path: str | Path,
    base_dir: Path | None = None,
    check_files: bool = True,
    validate: bool = True,
) -> StackConfig:
    """Read ``Pulumi.<stack>.yaml`` (its ``config:`` mapping) the way the Pulumi program would.

    ``base_dir`` (which a relative ``experiment_dir`` is resolved against) defaults to the
    nearest directory at or above the file that holds ``Pulumi.yaml``, as in the Pulumi program.
    """
    import yaml

    path = Path(path)
    if base_dir is None:
        base_dir = find_project_root(path.parent)
    stack = stack_name_from_path(path)
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise StackConfigError([f"cannot read: {exc}"], source=str(path)) from None
    config = doc.get("config") if isinstance(doc, dict) else None
    if not isinstance(config, dict):
        raise StackConfigError(["has no 'config:' mapping"], source=str(path))
    cfg = parse_stack(namespaced_to_raw(config), stack, source=str(path))
    if validate:
        validate_stack(cfg, base_dir=base_dir, check_files=check_files)
    return cfg
