"""The stack's checks that both orchestrations share: placement, mesh against the topology,
capacity, bucket, labels, network, Python. Each returns problem lines that name the key, the value
and what is allowed; infra/stack_config/validation.py runs them with the orchestration's own
(infra/tpu_vm/checks.py, infra/gke/checks.py)."""

from __future__ import annotations

import ipaddress
import re
from typing import Literal

from infra.stack_config.mesh import MeshFillError, fill_mesh_group, group_values
from infra.stack_config.schema import MAX_LABELS, Mesh, StackConfig
from infra.stack_config.topology import (
    MAX_SLICES,
    SliceTopology,
    UnknownAcceleratorError,
    zones_offering,
)

_PROJECT_RE = re.compile(r"^([a-z][a-z0-9.-]{0,61}[a-z0-9]:)?[a-z][a-z0-9-]{4,28}[a-z0-9]\Z")
_REGION_RE = re.compile(r"^[a-z]+-[a-z]+[0-9]+\Z")
_ZONE_RE = re.compile(r"^[a-z]+-[a-z]+[0-9]+-[a-z]\Z")
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]\Z")
_LABEL_RE = re.compile(r"^[a-z][a-z0-9_-]{0,62}\Z")
_LABEL_VALUE_RE = re.compile(r"^[a-z0-9_-]{0,63}\Z")
_TAG_RE = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?\Z")
MIN_PYTHON = "3.11"  # the template uses tomllib; an experiment's pyproject may ask for more
_PYTHON_RE = re.compile(r"^3\.(1[1-9]|[2-9][0-9])\Z")


def _check_axes(mesh: Mesh, group: Literal["ici", "dcn"], total: int, what: str) -> list[str]:
    values = group_values(mesh.values(), group)
    shown = ", ".join(f"{k}={v}" for k, v in values.items())
    try:
        fill_mesh_group(values, total)
    except MeshFillError as err:
        if err.problem == "bad_value":
            return [
                f"trainer.mesh.{k}: value {values[k]} is not allowed; use a positive integer or "
                "-1 (fill in)"
                for k in err.keys
            ]
        if err.problem == "two_fills":
            return [f"trainer.mesh: {shown} has {len(err.keys)} axes set to -1; at most one per "
                    "group"]
        if err.problem == "not_divisible":
            return [
                f"trainer.mesh: {shown}: the product of the fixed axes ({err.known}) does not "
                f"divide {what} ({total}), so {err.keys[0]}=-1 cannot be filled in"
            ]
        return [f"trainer.mesh: {shown}: product is {err.known} but must equal {what} ({total})"]
    return []


def _placement_problems(cfg: StackConfig) -> list[str]:
    problems = []
    if not _PROJECT_RE.match(cfg.project):
        problems.append(
            f"project: {cfg.project!r} is not a Google Cloud project id; ids are 6 to 30 "
            "lowercase letters, digits and hyphens, starting with a letter (e.g. my-project-123)"
        )
    if not _REGION_RE.match(cfg.region):
        problems.append(
            f"region: {cfg.region!r} is not a region name; regions look like us-central1, "
            "europe-west4"
        )
    if problems:
        return problems  # a zone cannot be checked against a region that is not one
    if not _ZONE_RE.match(cfg.zone):
        problems.append(
            f"zone: {cfg.zone!r} is not a zone name; zones look like us-central1-a, europe-west4-b"
        )
    elif not cfg.zone.startswith(cfg.region + "-"):
        problems.append(
            f"zone: {cfg.zone!r} is not in region {cfg.region!r}; allowed zones look like "
            f"{cfg.region}-a, {cfg.region}-b, ..."
        )
    return problems


def _zone_warnings(cfg: StackConfig, topo: SliceTopology) -> list[str]:
    zones = zones_offering(topo.generation)
    if zones and cfg.zone not in zones:
        return [
            f"zone: {cfg.zone!r} is not listed as offering TPU {topo.generation.family} "
            f"({topo.accelerator_type}); zones known to offer it: {', '.join(zones)}. The "
            "request may wait forever or fail: check the Cloud TPU regions and zones page"
        ]
    return []


def _bucket_problems(cfg: StackConfig) -> list[str]:
    if not cfg.bucket_name and not _PROJECT_RE.match(cfg.project):
        return []  # derived from the project id, which already has its own error
    name = cfg.names.bucket
    source = "bucket_name" if cfg.bucket_name else "bucket_name (derived <project>-ms-<stack>)"
    reasons = []
    if not _BUCKET_RE.match(name):
        reasons.append(
            "use 3 to 63 lowercase letters, digits, '-', '_' and '.', starting and ending with a "
            "letter or digit"
        )
    if ".." in name or ".-" in name or "-." in name:
        reasons.append("dots may not be next to each other or to a hyphen")
    if name.startswith("goog") or "google" in name:
        reasons.append("names may not start with 'goog' or contain 'google'")
    if re.fullmatch(r"\d+\.\d+\.\d+\.\d+", name):
        reasons.append("names may not be IP addresses")
    if "." in name and not reasons:
        reasons.append("dotted names need domain verification; use '-' instead of '.'")
    if reasons:
        return [f"{source}: {name!r} is not a valid bucket name: {'; '.join(reasons)}"]
    return []


def _data_bucket_problems(cfg: StackConfig) -> list[str]:
    problems = []
    for name in cfg.data_buckets:
        if not _BUCKET_RE.match(name) or ".." in name:
            problems.append(
                f"data_buckets: {name!r} is not a bucket name; give the name alone (no gs://, no "
                "path): 3 to 63 lowercase letters, digits, '-', '_' and '.'"
            )
        elif name == cfg.names.bucket:
            problems.append(
                f"data_buckets: {name!r} is the stack's own bucket, which the VMs can already "
                "read and write; remove it from data_buckets"
            )
    repeated = sorted({n for n in cfg.data_buckets if cfg.data_buckets.count(n) > 1})
    if repeated:
        problems.append(f"data_buckets: {', '.join(map(repr, repeated))} listed more than once")
    return problems


# What only deployers write in the stack's bucket (the launch spec, the code archives, the
# published environments): the hosts' write grant never reaches it (manifest.host_write_prefixes)
DEPLOYER_PREFIXES = ("launch/", "code/", "envs/")


def data_path_problems(cfg: StackConfig) -> list[str]:
    """A data set in the stack's own bucket is one the hosts may write (they prepare it there):
    never at or above what only deployers write, or the hosts' write grant would reach the
    launch spec, the code or the environments every host runs."""
    path = str((cfg.trainer.overrides or {}).get("data.path", ""))
    own = f"gs://{cfg.names.bucket}"
    if path != own and not path.startswith(own + "/"):
        return []
    prefix = path.removeprefix(own).strip("/") + "/"
    clash = [p for p in DEPLOYER_PREFIXES if prefix == "/" or p.startswith(prefix)
             or prefix.startswith(p)]
    if not clash:
        return []
    return [f"trainer: data.path {path!r} is at or above {own}/{clash[0]}, which only deployers "
            "write (the hosts' write grant would reach what every host runs); keep data under "
            f"another prefix, such as {own}/data/"]


def readable_path_problems(cfg: StackConfig, paths: dict[str, str]) -> list[str]:
    """Every gs:// path the trainer reads (``data.path``, ``train.init_from``) must be in a bucket
    the VMs' service account can read: the stack's own, or one of ``data_buckets``."""
    readable = [cfg.names.bucket, *cfg.data_buckets]
    problems = []
    for key, path in paths.items():
        if not path.startswith("gs://"):
            continue
        bucket = path.removeprefix("gs://").split("/", 1)[0]
        if bucket in readable:
            continue
        problems.append(
            f"trainer: {key} {path!r} is in bucket {bucket!r}, which the TPU VMs' service "
            f"account cannot read (it reads {', '.join(map(repr, readable))}); add {bucket!r} "
            "to multislice:data_buckets (roles/storage.objectViewer on it), or copy it to "
            f"gs://{cfg.names.bucket}/"
        )
    return problems


def _reservation_problems(cfg: StackConfig) -> list[str]:
    name = cfg.reservation_name or ""
    if cfg.orchestration == "gke":
        # A node pool's reservation_affinity names a reservation of its own project by name,
        # one shared from another project as projects/PROJECT/reservations/NAME (GKE's
        # "Consume reserved zonal resources"); the TPU API's zonal form is not one of them.
        if re.fullmatch(r"([a-z]([-a-z0-9]{0,61}[a-z0-9])?|projects/[^/]+/reservations/"
                        r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?)", name):
            return []
        return [
            f"reservation_name: {name!r} is not a reservation as a GKE node pool names it; use "
            "its name, or projects/PROJECT/reservations/NAME for one shared from another "
            "project (not the TPU API's projects/PROJECT/locations/ZONE/reservations/ID)"
        ]
    full = re.fullmatch(r"projects/([^/]+)/locations/([^/]+)/reservations/([^/]+)", name)
    if full:
        if full.group(2) != cfg.zone:
            return [
                f"reservation_name: {name!r} is in zone {full.group(2)!r} but the slices are in "
                f"{cfg.zone!r}; a reservation only serves its own zone"
            ]
        return []
    if not re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", name):
        return [
            f"reservation_name: {name!r} is neither a reservation id (lowercase letters, digits "
            "and '-') nor a full name projects/PROJECT/locations/ZONE/reservations/ID"
        ]
    return []


def _label_problems(cfg: StackConfig) -> list[str]:
    problems = []
    for key, value in cfg.labels.items():
        if key in cfg.toolkit_labels():
            problems.append(
                f"labels: {key}={value!r} overrides a label the toolkit sets itself "
                f"({key}={cfg.toolkit_labels()[key]!r}); choose another key"
            )
        elif not _LABEL_RE.match(key) or not _LABEL_VALUE_RE.match(value):
            problems.append(
                f"labels: {key}={value!r} is not a valid GCP label; keys start with a lowercase "
                "letter, keys and values use only lowercase letters, digits, '_' and '-' (<= 63)"
            )
    total = len({**cfg.labels, **cfg.toolkit_labels()})
    if total > MAX_LABELS:
        problems.append(
            f"labels: {len(cfg.labels)} labels plus the toolkit's {len(cfg.toolkit_labels())} "
            f"make {total}; a GCP resource allows at most {MAX_LABELS}"
        )
    return problems


# A trainer override is written into the launch spec (the bucket), the Pulumi state and the PR's
# render diff: never a credential. Keys named like one, values shaped like one (Google OAuth
# tokens and keys, GitHub, Hugging Face, AWS, OpenAI-style keys, PEM private keys).
SECRET_KEY = re.compile(r"(^|[_-])(token|secret|password|passwd|api[_-]?key|credentials?|"
                        r"private[_-]?key|access[_-]?key)\Z", re.I)  # of the last segment
SECRET_VALUE = re.compile(r"^(ya29\.|1//|AIza[0-9A-Za-z_-]{20}|gh[pousr]_[0-9A-Za-z]{20}|"
                          r"github_pat_|hf_[0-9A-Za-z]{20}|AKIA[0-9A-Z]{12}|sk-[0-9A-Za-z_-]{20}|"
                          r"-----BEGIN [A-Z ]*PRIVATE KEY)")


def secret_override_problems(overrides: dict[str, object]) -> list[str]:
    """One line per trainer override that looks like a credential, naming the key only."""
    problems = []
    for key, value in sorted(overrides.items()):
        why = ("its name says it holds one" if SECRET_KEY.search(key.rsplit(".", 1)[-1]) else
               "its value has a credential's shape" if isinstance(value, str)
               and SECRET_VALUE.match(value.strip()) else None)
        if why:
            problems.append(
                f"trainer.overrides: {key!r} looks like a credential ({why}); overrides are "
                "written to the launch spec in the bucket, the Pulumi state and pull-request "
                "render diffs: keep the secret in Secret Manager and have the trainer read it "
                "with the hosts' account (grant it roles/secretmanager.secretAccessor on that "
                "secret)")
    return problems


def shared_problems(cfg: StackConfig) -> tuple[list[str], list[str], SliceTopology | None]:
    """(problems, warnings, topology or None) of the rules every orchestration shares."""
    problems: list[str] = []
    warnings: list[str] = []

    topo: SliceTopology | None = None
    try:
        topo = cfg.topology
    except UnknownAcceleratorError as exc:
        problems.append(str(exc))

    if cfg.bucket_kms_key and cfg.bucket_kms_key.split("/")[3] != cfg.region:
        problems.append(f"bucket_kms_key: {cfg.bucket_kms_key!r} is in location "
                        f"{cfg.bucket_kms_key.split('/')[3]!r}; a bucket's default key must be "
                        f"in the bucket's location, the stack's region {cfg.region!r}")
    repository = cfg.package_index.artifact_registry if cfg.package_index else None
    if repository and repository[0] != cfg.project:
        project, location, name = repository
        warnings.append(
            f"package_index: {cfg.package_index.url} is a repository of project {project}, "
            f"where this stack grants nothing: a host that builds needs its owner to run `gcloud "
            f"artifacts repositories add-iam-policy-binding {name} --project={project} "
            f"--location={location} --member=serviceAccount:{cfg.names.service_account_email} "
            "--role=roles/artifactregistry.reader`")
    if not 1 <= cfg.slices <= MAX_SLICES:
        problems.append(f"slices: value {cfg.slices} is out of range; allowed 1..{MAX_SLICES}")
    elif topo is not None:
        problems += _check_axes(
            cfg.trainer.mesh,
            "ici",
            topo.devices,
            f"devices per slice of {topo.accelerator_type}",
        )
        problems += _check_axes(cfg.trainer.mesh, "dcn", cfg.slices, "the slice count")
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
    elif cfg.reservation_name:
        problems += _reservation_problems(cfg)
    problems += secret_override_problems(cfg.trainer.overrides)
    problems += data_path_problems(cfg)
    for key in cfg.trainer.overrides:
        if key.startswith("mesh."):
            problems.append(
                f"trainer.overrides: {key!r} is not allowed; set parallelism in trainer.mesh "
                "so it is validated against the topology"
            )

    if cfg.network is not None and "subnet_cidr" in cfg.model_fields_set:
        problems.append(f"subnet_cidr: {cfg.subnet_cidr!r} is for the stack's own subnet; with "
                        "multislice:network the slices use that network's subnet: remove it")
    if cfg.network is not None and cfg.ssh_from_iap:
        problems.append("ssh_from_iap: a firewall rule in the stack's own VPC; a shared network "
                        "is never modified (its team opens SSH from IAP): remove it")
    if cfg.egress == "none" and cfg.package_index and not cfg.package_index.python_mirror:
        problems.append(f"package_index: {cfg.package_index.url!r} serves the wheels, but with "
                        "egress 'none' a host building the environment would download CPython "
                        "from GitHub: set package_index.python_mirror to your copy of "
                        "python-build-standalone's releases")
    if cfg.egress == "none" and cfg.external_ips:
        problems.append("external_ips: true with egress 'none': an external IP is a route to "
                        "the internet; remove external_ips, or use egress 'nat'")
    problems += _placement_problems(cfg)
    if topo is not None:
        warnings += _zone_warnings(cfg, topo)
    problems += _bucket_problems(cfg)
    problems += _data_bucket_problems(cfg)
    if cfg.soft_delete_days != 0 and not 7 <= cfg.soft_delete_days <= 90:
        problems.append(
            f"soft_delete_days: value {cfg.soft_delete_days} is not allowed; use 0 (soft delete "
            "off) or 7..90 days (the range Cloud Storage accepts)"
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

    problems += _label_problems(cfg)
    for tag in cfg.tags:
        if not _TAG_RE.match(tag):
            problems.append(
                f"tags: {tag!r} is not a valid network tag; use lowercase letters, digits and "
                "'-', starting with a letter, at most 63 characters"
            )
    from infra.packaging.lock import VM_INTERPRETERS

    if not _PYTHON_RE.match(cfg.python_version) or cfg.python_version not in VM_INTERPRETERS:
        problems.append(
            f"python_version: {cfg.python_version!r} is not allowed; use one of "
            f"{', '.join(VM_INTERPRETERS)} (a CPython the VMs install, {MIN_PYTHON} or later "
            "as the training template needs)"
        )

    return problems, warnings, topo
