"""The one stack-config schema: parsed from Pulumi config, validated before any resource exists.

No pulumi import. The Pulumi program, the dynamic provider's ``check``, the CLI's offline render
and the VM's launcher all use this module; the launch spec written into TPU metadata is
``StackConfig.model_dump_json()``.
"""

from __future__ import annotations

import contextlib
import difflib
import ipaddress
import json
import re
import typing
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from infra.mesh import DCN_KEYS, ICI_KEYS, MeshFillError, fill_mesh_group
from infra.names import StackNames, stack_names
from infra.topology import (
    MAX_SLICES,
    SliceTopology,
    UnknownAcceleratorError,
    parse_accelerator_type,
    runtime_version_generation,
    zones_offering,
)

CONFIG_NAMESPACE = "multislice"
# Namespaces a stack file may use: ours, the gcp provider's (project/region/zone are fallbacks for
# ours; its other keys configure the provider) and the engine's own.
OTHER_NAMESPACES = ("gcp", "pulumi")
SECRET_MARKER = "[secret]"  # what an offline reader sees instead of an encrypted value
MAX_LABELS = 64  # per GCP resource, the toolkit's own included
STACK_LABEL = "multislice-stack"

Capacity = Literal["on-demand", "spot", "reserved", "guaranteed", "flex-start"]
Orchestration = Literal["tpu-vm", "gke"]
# GKE "About flex-start provisioning mode" (cloud.google.com/kubernetes-engine/docs/concepts/
# provisioning-model, read 2026-12): TPUs need GKE 1.33.0-gke.1712000 or later, in the zones it
# lists; TPU v3 and v4 are not supported.
FLEX_START_UNSUPPORTED_FAMILIES = ("v4",)
# A container image pinned by digest: a tag can move under a running job, a digest cannot.
# An image reference as the distribution spec's grammar has it (docker/distribution reference):
# an optional registry host[:port]/, path components of lowercase alphanumerics joined by
# separators, an optional tag, and the digest this toolkit requires.
_REGISTRY = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*(?::[0-9]+)?/)?"
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_PINNED_IMAGE_RE = re.compile(rf"^{_REGISTRY}{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
                              r"(?::[\w][\w.-]{0,127})?@sha256:[0-9a-f]{64}$")
# Kubernetes label values (and the name part of keys): node labels on GKE are the stack's labels.
_K8S_LABEL_RE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
# A GKE cluster name (GKE's own rule: a lowercase letter, then at most 39 lowercase letters,
# digits or hyphens, not ending in a hyphen).
_GKE_CLUSTER_NAME_RE = re.compile(r"^[a-z](?:[-a-z0-9]{0,38}[a-z0-9])?$")
# Namespaces a stack's workload may not take: Kubernetes reserves kube-*, GKE manages gke-*
# (and gmp-* for its managed Prometheus), and the controllers this toolkit installs own theirs
# (the Namespace objects of infra/k8s/*.yaml; tests/infra/test_gke.py checks the list).
RESERVED_NAMESPACE_PREFIXES = ("kube-", "gke-", "gmp-")
CONTROLLER_NAMESPACES = ("jobset-system", "kueue-system")
# The pods' container unless a stack names its own: Docker's official python:3.11.15-bookworm
# (Debian 12: bash, curl and tar, CPython 3.11 as /usr/local/bin/python3; user root), pinned by the
# digest of its multi-platform index as Docker's own record of the published tag lists it
# (github.com/docker-library/repo-info, repos/python/remote/3.11.15-bookworm.md at commit
# 3effc3eac4f65a99767fd721667a1bf157496ba4; built 2026-08-05). GKE nodes pull Docker Hub images
# through Google's mirror.gcr.io cache first, which Docker Hub's rate limits do not count
# (cloud.google.com/artifact-registry/docs/pull-cached-dockerhub-images). The boot path needs only
# those four tools: the trainer's interpreter and environment come from the experiment's lock.
# A created GKE cluster's control plane range (private_cluster_config.master_ipv4_cidr_block):
# fixed, so that the firewall rule for the webhooks (infra/gke/webhooks.py) names it at preview.
GKE_CONTROL_PLANE_CIDR = "172.16.0.0/28"
DEFAULT_GKE_IMAGE = ("docker.io/library/python:3.11.15-bookworm@sha256:"
                     "bf8254c2785186ab1d2fbb231326aecc4c2286a260e49822142793ebea75bc61")
_CLUSTER_RE = re.compile(
    r"^projects/(?P<project>[^/]+)/locations/(?P<location>[^/]+)/clusters/(?P<name>[^/]+)$")


# A problem line quotes the value it is about; a value of megabytes is cut in the middle, so the
# line keeps its start (the key and the value's head) and its end (what is allowed).
MAX_PROBLEM_CHARS = 1000


def _bounded(problem: str) -> str:
    if len(problem) <= MAX_PROBLEM_CHARS:
        return problem
    cut = len(problem) - 800
    return f"{problem[:600]} ...[{cut:,} characters cut]... {problem[-200:]}"


class StackConfigError(ValueError):
    """One or more problems with a stack config; ``problems`` lists each message."""

    def __init__(self, problems: list[str], source: str = "stack config") -> None:
        self.problems = [_bounded(problem) for problem in problems]
        lines = "\n".join(f"  - {p}" for p in self.problems)
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
    # Pipeline stages; the trainer checks the layer count, the micro-batches and repeats
    # (train.pipeline_microbatches, train.pipeline_repeats) and the batch split at preview.
    ici_pipeline: int = 1
    dcn_pipeline: int = 1


class Trainer(_Model):
    """What the VMs run: ``python -m trainer.main --config C --steps N --set ...``."""

    config: str = "default"
    steps: int = Field(default=1000, ge=1)
    seed: int | None = None
    mesh: Mesh = Mesh()
    overrides: dict[str, str | int | float | bool] = {}
    # How long jax.distributed.initialize() waits for every host. A slice rebuilt by auto-repair
    # boots minutes after the reset ones; the startup script restarts the trainer when this runs
    # out (exit 4 or an abort), up to max_restarts times per boot, with backoff.
    init_timeout_s: int = Field(default=600, ge=10, le=3600)
    max_restarts: int = Field(default=20, ge=0, le=1000)
    # Who runs the trainer on the VMs. root is what Google's own startup-script workloads use and
    # what can always open /dev/accel* and /dev/vfio/* and lock memory (infra/README.md); another
    # name is a system user made at boot with the device files' groups and unlimited memlock.
    run_as: str = Field(default="root", pattern=r"^[a-z_][a-z0-9_-]{0,31}$")


_K8S_NAME = r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"  # a DNS-1123 subdomain: Kueue's object names


class Gke(_Model):
    """``multislice:gke``: where the slices run when ``orchestration`` is ``gke`` (infra/gke/resources.py)."""

    # An existing Standard cluster, projects/P/locations/L/clusters/NAME, with Workload Identity
    # on: the program adds only the TPU node pools and the workload to it.
    cluster: str | None = None
    # Or a new Standard cluster in the stack's VPC and region: private nodes, Workload Identity,
    # a release channel and a small CPU pool for the controllers (JobSet's).
    create_cluster: bool = False
    release_channel: Literal["RAPID", "REGULAR", "STABLE"] = "REGULAR"
    # The container every pod runs, pinned by digest (REPO/IMAGE[:TAG]@sha256:...): bash, curl,
    # tar and a python3 of 3.10 or later, like a TPU VM image; the boot files come in a ConfigMap.
    # Unset: DEFAULT_GKE_IMAGE above.
    image: str = DEFAULT_GKE_IMAGE
    # The Kubernetes namespace of the workload and its service account (default ms-STACK).
    namespace: str | None = Field(default=None, pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
    # Apply the JobSet controller's pinned release manifest. Unset: only on a cluster the stack
    # creates. On an existing cluster the controller is cluster-wide (its CRDs hold every team's
    # JobSets) and the admin's: `pulumi up` checks that it is there, and true installs it anyway.
    # Installed controllers are retained on `pulumi destroy` (Gke.installs below).
    install_jobset: bool | None = None
    # Queue the JobSet with Kueue: a ResourceFlavor of the slices' TPU nodes, a ClusterQueue with
    # quota for exactly this job's chips, a LocalQueue in the namespace; install_kueue applies
    # Kueue's pinned release manifest (unset: as install_jobset).
    queueing: bool = False
    install_kueue: bool | None = None
    # Or join the cluster admin's Kueue: the LocalQueue of this name in gke.namespace (which
    # must be given: the admin's namespace, which holds the queue and is not created by the
    # stack). `pulumi up` checks that the queue exists before creating anything.
    local_queue: str | None = Field(default=None, pattern=_K8S_NAME)
    # A Kueue WorkloadPriorityClass for the JobSet (label kueue.x-k8s.io/priority-class): its
    # place in the queue and what it may preempt. With queueing or local_queue.
    priority_class: str | None = Field(default=None, pattern=_K8S_NAME)

    @property
    def queued(self) -> bool:
        """Whether Kueue admits the JobSet: the stack's own queue or the admin's."""
        return self.queueing or self.local_queue is not None

    def installs(self) -> dict[str, bool]:
        """Which cluster-wide controllers this stack applies: by default only to a cluster it
        creates, never to one that other teams share unless the stack file says so."""
        def chosen(value: bool | None) -> bool:
            return self.create_cluster if value is None else value

        return {"jobset": chosen(self.install_jobset),
                "kueue": self.queueing and chosen(self.install_kueue)}


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
    # Buckets, besides the stack's own, that hold training data: the VMs' service account gets
    # roles/storage.objectViewer (read and list, nothing else) on each, and preview refuses a
    # gs:// data.path in any other bucket.
    data_buckets: list[str] = []
    wait_for_active_s: int = Field(default=3600, ge=0)
    # How long a booting VM retries a bucket call answered 401/403/5xx or a token the metadata
    # server does not have yet: the service account and its grants are seconds old on the first
    # `pulumi up`, and IAM changes take minutes to propagate.
    storage_retry_s: int = Field(default=600, ge=0, le=7200)
    # `pulumi destroy` keeps the bucket (checkpoints, environments, logs) unless this is true.
    # destroy reads it from the stack's state: set it, `pulumi up`, then `pulumi destroy`.
    delete_bucket_on_destroy: bool = False
    # Take over a bucket of the stack's name that exists already (one an earlier `pulumi destroy`
    # kept): the bucket is imported (the `import_` resource option, under the storage component)
    # instead of created. Harmless once imported: the engine treats it as any other resource.
    adopt_bucket: bool = False
    # Who runs `pulumi up` (user:EMAIL, serviceAccount:EMAIL, group:EMAIL): granted
    # roles/iam.serviceAccountUser on the VMs' service account alone, which attaching it to the
    # VMs requires and which cannot be granted before the first `pulumi up` creates the account.
    deployer: str | None = Field(
        default=None, pattern=r"^(user|serviceAccount|group):[^@\s:]+@[^@\s]+$")
    # Days Cloud Storage keeps an overwritten or deleted object (soft delete, billed as stored
    # data). New buckets get 7 by default; this toolkit rewrites host logs every minute, rotates
    # checkpoints and replaces spec and environment objects, so a multi-GB checkpoint rotated
    # every few minutes would keep terabytes for a week. 0 (off) or 7..90, the API's range.
    soft_delete_days: int = 0
    # The run directory is gs://BUCKET/runs/STACK, or runs/STACK-RUN_NAME with a run name: a new
    # run on the same slices (say, after a change of the model's shape) is a one-line change.
    run_name: str | None = Field(default=None, pattern=r"^[a-z0-9][a-z0-9-]{0,39}$")
    # How often each VM checks the launch spec object for a new generation (a change of code or
    # trainer settings), jittered by +-25% so hosts do not poll in lockstep.
    spec_poll_s: int = Field(default=60, ge=5, le=3600)
    # tpu-vm: a queued resource of TPU VMs (infra/tpu_vm/queued_resource.py). gke: TPU node pools and a
    # JobSet on a GKE cluster, set in `gke` (infra/gke/resources.py); the same spec, bucket and identity.
    orchestration: Orchestration = "tpu-vm"
    gke: Gke | None = None

    # ---- derived ----
    @property
    def topology(self) -> SliceTopology:
        return parse_accelerator_type(self.accelerator_type)

    @property
    def names(self) -> StackNames:
        """Every derived name (infra/names.py); never a timestamp."""
        return stack_names(self.stack, self.project, self.slices, self.bucket_name,
                           self.run_name)

    @property
    def effective_runtime_version(self) -> str:
        return self.runtime_version or self.topology.generation.default_runtime_version

    def resolved_mesh(self) -> dict[str, int]:
        """Mesh with every -1 filled in (call after ``infra.validation.validate_stack`` passed)."""
        topo = self.topology
        ici = _fill_axes(self.trainer.mesh, ICI_KEYS, topo.devices)
        dcn = _fill_axes(self.trainer.mesh, DCN_KEYS, self.slices)
        return {**ici, **dcn}

    def toolkit_labels(self) -> dict[str, str]:
        """Labels the toolkit sets on every resource; a stack's ``labels`` cannot override them."""
        return {STACK_LABEL: self.stack}

    def all_labels(self) -> dict[str, str]:
        return {**self.labels, **self.toolkit_labels()}


# ---------------------------------------------------------------------------------------------
# semantic validation
# ---------------------------------------------------------------------------------------------

_PROJECT_RE = re.compile(r"^([a-z][a-z0-9.-]{0,61}[a-z0-9]:)?[a-z][a-z0-9-]{4,28}[a-z0-9]$")
_REGION_RE = re.compile(r"^[a-z]+-[a-z]+[0-9]+$")
_ZONE_RE = re.compile(r"^[a-z]+-[a-z]+[0-9]+-[a-z]$")
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$")
_LABEL_RE = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
_LABEL_VALUE_RE = re.compile(r"^[a-z0-9_-]{0,63}$")
_TAG_RE = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
_DURATION_RE = re.compile(r"^(\d+)([smhd])$")
MIN_PYTHON = "3.11"  # the template uses tomllib; an experiment's pyproject may ask for more
_PYTHON_RE = re.compile(r"^3\.(1[1-9]|[2-9][0-9])$")


def _fill_axes(mesh: Mesh, keys: tuple[str, ...], total: int) -> dict[str, int]:
    return fill_mesh_group({k: getattr(mesh, k) for k in keys}, total)


def _check_axes(mesh: Mesh, keys: tuple[str, ...], total: int, what: str) -> list[str]:
    values = {k: getattr(mesh, k) for k in keys}
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


def parse_window_time(value: str) -> datetime | None:
    """An ISO-8601 timestamp with its offset (``Z`` or ``+09:00``) as an aware datetime.

    None when ``value`` is not a timestamp; a timestamp without an offset raises ValueError, since
    it would mean a different instant on every machine.
    """
    try:
        stamp = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    if stamp.tzinfo is None:
        raise ValueError(f"{value!r} has no time zone; add Z (UTC) or an offset such as +09:00")
    return stamp


def queueing_window_to_api(value: str) -> dict[str, str]:
    """``6h`` -> ``{"duration": "21600s"}``; a timestamp -> ``{"time": "...Z"}``, in UTC.

    ``2026-12-01T09:00:00+09:00`` is the instant ``2026-12-01T00:00:00Z``: the offset is applied,
    never dropped.
    """
    match = _DURATION_RE.match(value)
    if match:
        unit = {"s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]
        return {"duration": f"{int(match.group(1)) * unit}s"}
    stamp = parse_window_time(value)
    if stamp is None:
        raise ValueError(f"{value!r} is neither a duration nor an ISO-8601 timestamp")
    return {"time": stamp.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}


def _window_problems(cfg: StackConfig, now: datetime | None = None) -> list[str]:
    now = now or datetime.now(UTC)
    problems: list[str] = []
    stamps: dict[str, datetime] = {}
    for field in ("valid_after", "valid_until"):
        value = getattr(cfg, field)
        if value is None or _DURATION_RE.match(value):
            continue
        try:
            stamp = parse_window_time(value)
        except ValueError as exc:
            problems.append(f"{field}: {exc}")
            continue
        if stamp is None:
            problems.append(
                f"{field}: {value!r} is neither a duration (e.g. 30m, 6h, 2d) nor an ISO-8601 "
                "timestamp with a time zone (e.g. 2026-12-01T00:00:00Z)"
            )
        elif field == "valid_until" and stamp <= now:
            problems.append(
                f"valid_until: {value!r} is in the past (now {now:%Y-%m-%dT%H:%M:%SZ}); the "
                "request would expire before it is queued: use a later time or a duration"
            )
        else:
            stamps[field] = stamp
    if problems:
        return problems
    if cfg.valid_until and cfg.valid_after:
        if _DURATION_RE.match(cfg.valid_until) or _DURATION_RE.match(cfg.valid_after):
            return [
                f"valid_until/valid_after: {cfg.valid_after!r}..{cfg.valid_until!r}: when both "
                "are set they form an interval and must both be ISO-8601 timestamps"
            ]
        if stamps["valid_after"] >= stamps["valid_until"]:
            return [
                f"valid_after/valid_until: {cfg.valid_after!r} is not before "
                f"{cfg.valid_until!r}; the interval is empty: valid_after must come first"
            ]
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


def _runtime_problems(cfg: StackConfig, topo: SliceTopology) -> list[str]:
    version = cfg.effective_runtime_version
    owner = runtime_version_generation(version)
    if owner is not None and owner is not topo.generation:
        return [
            f"runtime_version: {version!r} is the software image for TPU {owner.family}, not "
            f"for {topo.accelerator_type}; use {topo.generation.default_runtime_version!r} "
            "(or leave runtime_version unset for that default)"
        ]
    return []


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


# Keys of a TPU-VM stack that mean nothing to GKE node pools: refused by name, not ignored.
_TPU_VM_ONLY = {
    "runtime_version": "GKE chooses the TPU node image",
    "valid_until": "a queueing window is a queued-resource setting",
    "valid_after": "a queueing window is a queued-resource setting",
    "wait_for_active_s": "node pools are created by GKE, not waited for by this toolkit",
    "ssh_from_iap": "GKE nodes are reached with kubectl, not SSH",
    "external_ips": "GKE TPU nodes here are private (Cloud NAT for egress)",
}


def _orchestration_problems(cfg: StackConfig, topo: SliceTopology | None) -> list[str]:
    if cfg.orchestration == "tpu-vm":
        problems = []
        if cfg.gke is not None:
            problems.append("gke: is set but orchestration is 'tpu-vm'; set "
                            "multislice:orchestration: gke to run on GKE, or remove multislice:gke")
        if cfg.capacity == "flex-start":
            problems.append("capacity: 'flex-start' is a GKE node pool setting here (the "
                            "google-cloud-tpu client of the queued resource has no flex-start "
                            "field); set multislice:orchestration: gke, or use on-demand, spot, "
                            "reserved or guaranteed")
        return problems
    problems = [
        f"{key}: does not apply to orchestration 'gke' ({why}); remove it"
        for key, why in _TPU_VM_ONLY.items() if key in cfg.model_fields_set
    ]
    if cfg.capacity == "guaranteed":
        problems.append("capacity: 'guaranteed' is a queued-resource tier; with orchestration "
                        "'gke' use on-demand, spot, reserved or flex-start")
    gke = cfg.gke
    if gke is None:
        return [*problems, "gke: orchestration 'gke' needs multislice:gke with either cluster: "
                "projects/P/locations/L/clusters/NAME (an existing cluster) or create_cluster: "
                "true"]
    if (gke.cluster is None) == (not gke.create_cluster):
        problems.append(
            f"gke: give exactly one of cluster (an existing cluster) and create_cluster: true; "
            f"got cluster={gke.cluster!r}, create_cluster={gke.create_cluster}")
    elif gke.cluster is not None:
        match = _CLUSTER_RE.match(gke.cluster)
        if match is None:
            problems.append(
                f"gke.cluster: {gke.cluster!r} is not a full cluster resource name; use "
                "projects/PROJECT/locations/LOCATION/clusters/NAME")
        else:
            if not _GKE_CLUSTER_NAME_RE.match(match["name"]):
                problems.append(
                    f"gke.cluster: name {match['name']!r} is not a GKE cluster name (a "
                    "lowercase letter, then at most 39 lowercase letters, digits or hyphens, "
                    "not ending in one); check the name in the console")
            if match["project"] != cfg.project:
                problems.append(
                    f"gke.cluster: {gke.cluster!r} is in project {match['project']!r}, not the "
                    f"stack's project {cfg.project!r}; the node pools, bucket and service account "
                    "of a stack live in one project")
            if match["location"] not in (cfg.region, cfg.zone):
                problems.append(
                    f"gke.cluster: {gke.cluster!r} is in {match['location']!r}, but the stack's "
                    f"TPUs are in zone {cfg.zone!r}; use a cluster in region {cfg.region!r} or "
                    f"zone {cfg.zone!r}, or change multislice:zone")
        if "subnet_cidr" in cfg.model_fields_set:
            problems.append("subnet_cidr: does not apply to an existing cluster (its node pools "
                            "use the cluster's network); remove it")
    elif gke.create_cluster:
        with contextlib.suppress(ValueError):  # an unparsable subnet_cidr is named below
            if ipaddress.ip_network(cfg.subnet_cidr, strict=False).overlaps(
                    ipaddress.ip_network(GKE_CONTROL_PLANE_CIDR)):
                problems.append(
                    f"subnet_cidr: {cfg.subnet_cidr!r} overlaps {GKE_CONTROL_PLANE_CIDR}, the "
                    "control plane range of the cluster create_cluster makes; use a range "
                    "outside it, such as the default 10.128.0.0/20")
    if "install_kueue" in gke.model_fields_set and not gke.queueing:
        problems.append(f"gke.install_kueue: {gke.install_kueue} is set but gke.queueing is "
                        "false; Kueue is installed only for a queued JobSet: set gke.queueing: "
                        "true, or remove gke.install_kueue")
    if gke.local_queue is not None and gke.queueing:
        problems.append(f"gke.local_queue: {gke.local_queue!r} joins the cluster admin's queue, "
                        "and gke.queueing: true creates the stack's own; choose one")
    if gke.local_queue is not None and gke.namespace is None:
        problems.append(f"gke.local_queue: {gke.local_queue!r} is a LocalQueue of a namespace the "
                        "admin made; set gke.namespace to that namespace (the stack then does not "
                        "create it)")
    if gke.priority_class is not None and gke.create_cluster:
        problems.append(f"gke.priority_class: {gke.priority_class!r} names a WorkloadPriorityClass "
                        "the cluster's admin made; a cluster create_cluster makes has none; "
                        "remove it")
    elif gke.priority_class is not None and not gke.queued:
        problems.append(f"gke.priority_class: {gke.priority_class!r} is a Kueue "
                        "WorkloadPriorityClass, which orders queued jobs only; set gke.queueing: "
                        "true or gke.local_queue, or remove it")
    if not _PINNED_IMAGE_RE.match(gke.image):
        why = ("is not pinned by digest" if "@sha256:" not in gke.image
               else "is not an image reference (whitespace, a scheme, an empty or upper-case "
                    "name?)")
        problems.append(
            f"gke.image: {gke.image!r} {why}; use REGISTRY/NAME[:TAG]@sha256:<64 hex> so every "
            "restart runs the same image")
    if gke.namespace is not None and (gke.namespace.startswith(RESERVED_NAMESPACE_PREFIXES)
                                      or gke.namespace in CONTROLLER_NAMESPACES):
        problems.append(
            f"gke.namespace: {gke.namespace!r} is reserved (kube-*, gke-* and gmp-* are the "
            f"cluster's own; {', '.join(CONTROLLER_NAMESPACES)} are the controllers'); use a "
            "namespace of the workload's own, such as the default ms-STACK")
    if gke.cluster is not None and "release_channel" in gke.model_fields_set:
        problems.append(
            f"gke.release_channel: {gke.release_channel!r} has no effect on an existing cluster "
            "(it keeps its own channel; only a cluster create_cluster makes gets this one); "
            "remove it")
    for key, value in cfg.all_labels().items():
        if not (_K8S_LABEL_RE.match(key) and len(key) <= 63) or not _K8S_LABEL_RE.match(value):
            problems.append(
                f"labels: {key}={value!r} becomes a Kubernetes label of the GKE nodes, which "
                "must start and end with a letter or digit (between them letters, digits, '-', "
                "'_' and '.', at most 63); change it")
    if topo is not None:
        from infra.gke.names import name_problems
        from infra.gke.topology import GkeTopologyError, gke_slice

        try:
            shape = gke_slice(topo)
        except GkeTopologyError as exc:
            problems.append(str(exc))
        else:
            problems += name_problems(cfg.stack, cfg.names.jobset, cfg.slices, shape.nodes)
        if cfg.capacity == "flex-start" and topo.family in FLEX_START_UNSUPPORTED_FAMILIES:
            problems.append(
                f"capacity: 'flex-start' does not run TPU {topo.family} on GKE (GKE's "
                "flex-start provisioning mode: TPU v3 and v4 are not supported); use on-demand, "
                "spot or reserved, or a v5e, v5p or v6e accelerator_type")
    return problems


def stack_problems(cfg: StackConfig, now: datetime | None = None) -> tuple[list[str], list[str]]:
    """(problems, warnings) of every rule that needs more than one field of the stack config.

    The experiment directory's own checks (infra/experiment.py) and the raising are
    infra/validation.py's: this module knows nothing of experiments.
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
    problems += _orchestration_problems(cfg, topo)
    if cfg.orchestration == "tpu-vm" and topo is not None and cfg.slices > 1 and topo.hosts == 1:
        warnings.append(
            f"accelerator_type: {topo.accelerator_type} is a single-host slice; whether the TPU "
            "API accepts a multislice of single-host slices is not settled by a public source "
            "(Google's GKE multislice page allows multi-host slices only; the TPU VM pages say "
            "nothing): the create may be refused. A multi-host type (e.g. v5litepod-16) is "
            "the documented path"
        )
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
    for key in cfg.trainer.overrides:
        if key.startswith("mesh."):
            problems.append(
                f"trainer.overrides: {key!r} is not allowed; set parallelism in trainer.mesh "
                "so it is validated against the topology"
            )

    problems += _placement_problems(cfg)
    if topo is not None:
        if cfg.orchestration == "tpu-vm":
            problems += _runtime_problems(cfg, topo)
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
    problems += _window_problems(cfg, now=now)
    from infra.lock import VM_INTERPRETERS

    if not _PYTHON_RE.match(cfg.python_version) or cfg.python_version not in VM_INTERPRETERS:
        problems.append(
            f"python_version: {cfg.python_version!r} is not allowed; use one of "
            f"{', '.join(VM_INTERPRETERS)} (a CPython the VMs install, {MIN_PYTHON} or later "
            "as the training template needs)"
        )

    return problems, warnings


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------


def _section_fields(loc: tuple[Any, ...]) -> tuple[str, list[str]]:
    """(section name, its allowed keys) for the parent of a pydantic error location."""
    model: Any = StackConfig
    names = []
    for part in loc[:-1]:
        field = model.model_fields.get(str(part)) if isinstance(model, type) else None
        annotation = field.annotation if field is not None else None
        # `gke: Gke | None`: the section is the model inside the Optional.
        candidates = [annotation, *typing.get_args(annotation)]
        annotation = next((c for c in candidates
                           if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if annotation is None:
            break
        model, names = annotation, [*names, str(part)]
    allowed = [k for k in model.model_fields if k != "stack"]
    return ".".join(names) or "multislice", allowed


def _suggest(word: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(word, allowed, n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _format_pydantic(err: ValidationError) -> list[str]:
    out = []
    for item in err.errors():
        loc = ".".join(str(p) for p in item["loc"])
        if item["type"] == "extra_forbidden":
            section, allowed = _section_fields(item["loc"])
            key = str(item["loc"][-1])
            out.append(
                f"{loc}: unknown key{_suggest(key, allowed)} (value {item['input']!r}); "
                f"allowed keys of {section}: {', '.join(sorted(allowed))}"
            )
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


def parse_namespaced(
    config: Mapping[str, Any], stack: str, source: str = "stack config"
) -> StackConfig:
    """The one loader: a stack's config as the engine hands it to the program -> StackConfig.

    ``config`` maps ``namespace:key`` to values (strings, structured values as JSON), as in
    ``PULUMI_CONFIG``. Every key must be known: an unknown ``multislice:`` key, a namespace other
    than multislice/gcp/pulumi (``multislcie:slices``) or a key without one is an error naming
    it, never silently ignored. ``gcp:project``/``region``/``zone`` fill in ours when unset.
    """
    problems: list[str] = []
    raw: dict[str, Any] = {}
    fields = [f for f in StackConfig.model_fields if f != "stack"]
    namespaces = (CONFIG_NAMESPACE, *OTHER_NAMESPACES)
    for key, value in config.items():
        namespace, colon, name = str(key).partition(":")
        if not colon:
            problems.append(
                f"{key}: config key without a namespace; write {CONFIG_NAMESPACE}:{key}"
            )
        elif namespace == CONFIG_NAMESPACE:
            if name in fields:
                raw[name] = _decode(value)
            else:
                problems.append(
                    f"{key}: unknown key{_suggest(name, fields)}; allowed keys of "
                    f"{CONFIG_NAMESPACE}: {', '.join(sorted(fields))}"
                )
        elif namespace not in OTHER_NAMESPACES:
            problems.append(
                f"{key}: unknown namespace {namespace!r}{_suggest(namespace, list(namespaces))}; "
                f"allowed namespaces: {', '.join(namespaces)}"
            )
    for key in ("project", "region", "zone"):
        if key not in raw and f"gcp:{key}" in config:
            raw[key] = config[f"gcp:{key}"]
    try:
        cfg = parse_stack(raw, stack, source=source)
    except StackConfigError as exc:
        raise StackConfigError(problems + exc.problems, source=source) from None
    if problems:
        raise StackConfigError(problems, source=source)
    return cfg


_YAML12_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$")


class _UniqueKeyLoader:
    """yaml.SafeLoader that refuses duplicate mapping keys, as the Pulumi CLI's YAML reader does."""

    @staticmethod
    def build() -> Any:
        import yaml

        class Loader(yaml.SafeLoader):
            pass

        def mapping(loader: Any, node: Any, deep: bool = False) -> dict[Any, Any]:
            seen: dict[Any, Any] = {}
            for key_node, value_node in node.value:
                key = loader.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (the Pulumi CLI refuses this file)",
                        key_node.start_mark)
                seen[key] = loader.construct_object(value_node, deep=deep)
            return seen

        Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
        # The Pulumi CLI reads YAML 1.2, where `1e-3` is a float; YAML 1.1 (PyYAML) needs a dot
        # and makes it the string "1e-3", which a float setting then refuses.
        Loader.add_implicit_resolver("tag:yaml.org,2002:float", _YAML12_EXPONENT_FLOAT,
                                     list("-+0123456789."))
        return Loader


def _engine_value(value: Any) -> str:
    if isinstance(value, dict) and set(value) == {"secure"}:
        return SECRET_MARKER  # encrypted: only the engine (with the stack's key) can read it
    if isinstance(value, str):
        return value
    return json.dumps(value)


def read_stack_file(path: Path, project: str = CONFIG_NAMESPACE) -> dict[str, str]:
    """A stack file's ``config:`` as the engine hands it to the program (``PULUMI_CONFIG``).

    As the Pulumi CLI does: duplicate keys are refused, a key without a namespace belongs to the
    project (``slices`` is ``multislice:slices``; both at once is a duplicate), and values become
    strings (structured ones JSON). Encrypted values read as ``[secret]``.
    """
    import yaml

    from infra.userfile import UserFileError, load_yaml, read_text

    try:
        doc = load_yaml(read_text(path, "stack file"), str(path),
                        _UniqueKeyLoader.build()) or {}
    except UserFileError as exc:
        raise StackConfigError([str(exc).removeprefix(f"{path}: ")], source=str(path)) from None
    except yaml.YAMLError as exc:
        raise StackConfigError([f"cannot read: {exc}"], source=str(path)) from None
    config = doc.get("config") if isinstance(doc, dict) else None
    if not isinstance(config, dict):
        raise StackConfigError(["has no 'config:' mapping"], source=str(path))
    out: dict[str, str] = {}
    problems = []
    for key, value in config.items():
        key = str(key)
        parts = key.split(":")
        if len(parts) == 1:
            full = f"{project}:{key}"
        elif len(parts) == 3 and parts[1] == "config":  # the old `ns:config:name` form
            full = f"{parts[0]}:{parts[2]}"
        else:
            full = key
        if full in out:
            problems.append(f"{key}: the same key as {full} given twice; keep one")
        out[full] = _engine_value(value)
    if problems:
        raise StackConfigError(problems, source=str(path))
    return out


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


def project_name(root: Path) -> str:
    """The ``name:`` of root/Pulumi.yaml: the namespace of un-namespaced stack keys."""
    import yaml

    from infra.userfile import UserFileError, load_yaml, read_text

    try:
        doc = load_yaml(read_text(root / "Pulumi.yaml", "project file"),
                        str(root / "Pulumi.yaml")) or {}
    except (UserFileError, yaml.YAMLError):
        return CONFIG_NAMESPACE
    return str(doc.get("name") or CONFIG_NAMESPACE) if isinstance(doc, dict) else CONFIG_NAMESPACE
