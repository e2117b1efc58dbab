"""The one stack-config schema: the typed keys of a stack, parsed before any resource exists.

No pulumi import, and no orchestration: the checks that need more than one key are
infra/stack_config/checks.py (shared), infra/tpu_vm/checks.py and infra/gke/checks.py, run together by
infra/stack_config/validation.py; reading a stack file is infra/stack_config/stack_file.py. The Pulumi program, the dynamic
provider's ``check``, the CLI's offline render and the VM's launcher all use this module; the
launch spec is ``StackConfig.model_dump_json()``.
"""

from __future__ import annotations

import difflib
import re
import typing
import urllib.parse
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from infra.stack_config.mesh import FORK_AXIS_KEY, fill_mesh_group, group_values
from infra.stack_config.names import StackNames, stack_names
from infra.stack_config.topology import SliceTopology, parse_accelerator_type

CONFIG_NAMESPACE = "multislice"
# Namespaces a stack file may use: ours, the gcp provider's (project/region/zone are fallbacks for
# ours; its other keys configure the provider) and the engine's own.
OTHER_NAMESPACES = ("gcp", "pulumi")
SECRET_MARKER = "[secret]"  # what an offline reader sees instead of an encrypted value
MAX_LABELS = 64  # per GCP resource, the toolkit's own included
STACK_LABEL = "multislice-stack"
# On the Kubernetes objects a stack names from its stack name alone (its namespace, ClusterQueue,
# ResourceFlavor): the Google Cloud project it belongs to, so two teams' stacks of one name on a
# shared cluster are told apart (infra/gke/cluster_check.py ownership_problem).
PROJECT_LABEL = "multislice-project"

Capacity = Literal["on-demand", "spot", "reserved", "guaranteed", "flex-start"]
Orchestration = Literal["tpu-vm", "gke"]
# The pods' container unless a stack names its own: Docker's official python:3.11.15-bookworm
# (Debian 12: bash, curl and tar, CPython 3.11 as /usr/local/bin/python3; user root), pinned by the
# digest of its multi-platform index as Docker's own record of the published tag lists it
# (github.com/docker-library/repo-info, repos/python/remote/3.11.15-bookworm.md at commit
# 3effc3eac4f65a99767fd721667a1bf157496ba4; built 2026-08-05). GKE nodes pull Docker Hub images
# through Google's mirror.gcr.io cache first, which Docker Hub's rate limits do not count
# (cloud.google.com/artifact-registry/docs/pull-cached-dockerhub-images). The boot path needs only
# those four tools: the trainer's interpreter and environment come from the experiment's lock.
DEFAULT_GKE_IMAGE = ("docker.io/library/python:3.11.15-bookworm@sha256:"
                     "bf8254c2785186ab1d2fbb231326aecc4c2286a260e49822142793ebea75bc61")



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
    """Parallelism per axis; the keys are the trainer's ``mesh`` section (docs/CONTRACTS.md).
    An axis the experiment adds is an ``ici_NAME``/``dcn_NAME`` pair of integers (infra/stack_config/mesh.py);
    the experiment's config check refuses a name it does not declare."""

    model_config = ConfigDict(extra="allow", frozen=True, coerce_numbers_to_str=True)

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

    @model_validator(mode="after")
    def _added_axes_are_named_sizes(self) -> Mesh:
        builtin = sorted(Mesh.model_fields)
        for key, value in (self.model_extra or {}).items():
            close = difflib.get_close_matches(key, builtin, n=1, cutoff=0.8)
            if close or not FORK_AXIS_KEY.match(key):
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise ValueError(
                    f"unknown key {key!r}{hint}: allowed keys of trainer.mesh: "
                    f"{', '.join(builtin)}, or ici_NAME and dcn_NAME of an axis the "
                    "experiment adds (its trainer/config.py MESH_AXES)")
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{key} = {value!r}: expected an integer (-1 fills in)")
        return self

    def values(self) -> dict[str, int]:
        """Every key given, the added axes' too."""
        return {**self.model_dump(), **(self.model_extra or {})}


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


class PackageIndex(_Model):
    """``multislice:package_index``: the organisation's own package index, for hosts that build
    the environment: uv and the lock's wheels come from it (hashes still enforced), the
    interpreter from `python_mirror`. No credentials in the URL: on Artifact Registry
    (*.pkg.dev) the host's service account is the credential (its access token, as
    Artifact Registry's pip docs use it); any other index is asked without one."""

    url: str = Field(pattern=r"^https?://[^/@\s]+/\S*$")  # PEP 503 "simple" root
    # Where uv downloads CPython (its UV_PYTHON_INSTALL_MIRROR): a copy of python-build-standalone's
    # release assets. Unset: GitHub, which a host with egress none cannot reach.
    python_mirror: str | None = Field(default=None, pattern=r"^https?://[^@\s]+$")

    @property
    def artifact_registry(self) -> tuple[str, str, str] | None:
        """(project, location, repository) of an Artifact Registry Python repository's URL
        (https://LOCATION-python.pkg.dev/PROJECT/REPOSITORY/simple/), or None for another index."""
        found = re.match(r"^https://([a-z0-9-]+)-python\.pkg\.dev/([^/]+)/([^/]+)/", self.url)
        return (found[2], found[1], found[3]) if found else None

    @field_validator("url", "python_mirror")
    @classmethod
    def _plain_url(cls, value: str | None) -> str | None:
        """What a URL parser reads as the host is the host the text shows: no user, query or
        fragment (`https://evil#.pkg.dev/` is host `evil`, and the hosts send their token to
        what looks like Artifact Registry), a DNS name or an IPv4 address, and a port."""
        if value is None:
            return None
        parts = urllib.parse.urlsplit(value)
        try:
            port = parts.port
        except ValueError:
            raise ValueError("its port is not a number from 0 to 65535") from None
        host = parts.hostname or ""
        expected = host + (f":{port}" if port is not None else "")
        if parts.username is not None or parts.query or parts.fragment or "#" in value \
                or parts.netloc.lower() != expected or not _URL_HOST.match(host):
            raise ValueError("a plain http(s) URL of a host name (letters, digits, '-' and '.'), "
                             "an optional port and a path: no user, query or fragment")
        return value


NetworkFinding = Literal["mtu", "subnet-network", "private-google-access", "internal-ingress",
                         "internal-egress", "google-apis-egress", "nat", "open-to-others"]


class SharedNetwork(_Model):
    """``multislice:network``: an existing VPC a platform team runs (in the stack's project or a
    Shared VPC host project), used instead of creating one; never modified or deleted."""

    project: str | None = None  # the host project; default the stack's
    name: str = Field(pattern=r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
    subnet: str = Field(pattern=r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")  # in the stack's region
    # What preview's check (infra/preview/network_check.py) reports as a warning instead of a
    # refusal, by the name each finding carries: for a platform team that knows its network
    # better than the check (a rule form it cannot read, an inspection it cannot judge).
    warn_only: list[NetworkFinding] = []
    # The MTU is a warning unless this is set (a performance choice, not a failure).
    strict: bool = False


GkeKind = Literal["all", "workload", "capacity"]
_LABEL = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
_URL_HOST = re.compile(rf"^{_LABEL}(\.{_LABEL})*$")
SHAPE_NAME = r"^[a-z][a-z0-9]{0,7}$"  # part of the pools' names (GKE: at most 40 characters)


class GkeShape(_Model):
    """One slice shape of a capacity stack (``gke.shapes.NAME``): its own TPU node pools, one a
    slice, and its own Kueue ResourceFlavor."""

    accelerator_type: str
    slices: int = Field(default=1, ge=1)
    capacity: Capacity = "on-demand"
    reservation_name: str | None = None


class GkeTeam(_Model):
    """One team of a capacity stack (``gke.teams.NAMESPACE``): chips per shape name. `quota` is
    the team's nominal quota; `borrowing_limit` caps what it may borrow from the cohort beyond
    it (unset: what others lend), `lending_limit` what others may borrow of its unused quota
    (unset: all of it). Kueue's ClusterQueue fields of the same names, per shape's flavor."""

    quota: dict[str, int]
    borrowing_limit: dict[str, int] = {}
    lending_limit: dict[str, int] = {}


class Gke(_Model):
    """``multislice:gke``: where the slices run when ``orchestration`` is ``gke`` (infra/gke/resources.py)."""

    # What the stack owns. all: one experiment with its own capacity (node pools, controllers,
    # optionally the cluster), for a team that owns its project. capacity: a platform team's
    # stack: the cluster or an existing one, the TPU node pools, the controllers, a ClusterQueue
    # whose quota is the pools, and a LocalQueue in each of `team_namespaces`; no experiment.
    # workload: one experiment on capacity someone else runs: the JobSet, its ConfigMap, its
    # Kubernetes and Google service accounts, the bucket and the launch spec, in the admin's
    # `namespace` of a `cluster` in any project; no node pool, nothing cluster-wide.
    kind: GkeKind = "all"

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
    # Kueue's pinned release manifest (unset: as install_jobset: only on a created cluster; a
    # capacity stack on an existing cluster uses the admin's Kueue, checked at preview).
    queueing: bool = False
    install_kueue: bool | None = None
    # Or join the cluster admin's Kueue: the LocalQueue of this name in gke.namespace (which
    # must be given: the admin's namespace, which holds the queue and is not created by the
    # stack). `pulumi up` checks that the queue exists before creating anything.
    local_queue: str | None = Field(default=None, pattern=_K8S_NAME)
    # A Kueue WorkloadPriorityClass for the JobSet (label kueue.x-k8s.io/priority-class): its
    # place in the queue and what it may preempt. With queueing or local_queue.
    priority_class: str | None = Field(default=None, pattern=_K8S_NAME)
    # kind capacity: the team namespaces that may run on the pools; each gets a LocalQueue named
    # `local_queue` (default "tpu") of the stack's ClusterQueue and a default-deny NetworkPolicy.
    # On an existing cluster they are the platform's: each must exist and enforce Pod Security
    # baseline (checked at preview); the stack never creates or deletes one. On a cluster the
    # stack creates, it creates them, labelled baseline, and retains them on destroy.
    team_namespaces: list[str] = []
    # kind capacity: several slice shapes by name (a-z0-9, at most 8 characters), each its own
    # pools and ResourceFlavor; unset: one shape, the stack's accelerator_type, slices, capacity
    # and reservation_name (which a stack with shapes does not set: they are per shape).
    shapes: dict[str, GkeShape] = {}
    # kind capacity: teams by namespace with a quota of chips per shape (GkeTeam above): a
    # ClusterQueue per team and shape, all in the stack's cohort (borrowing what others lend,
    # reclaiming what they borrowed, priority preemption within each), and in each team's
    # namespace a LocalQueue per shape, named by the shape. Unset: `team_namespaces` share one
    # ClusterQueue of every chip.
    teams: dict[str, GkeTeam] = {}
    # kind capacity: Kueue WorkloadPriorityClasses by name and value; within the ClusterQueue a
    # pending JobSet of a higher priority preempts lower ones.
    priority_classes: dict[str, int] = {}
    # Node pools that scale to zero nodes while no pod asks for them (GKE's cluster autoscaler,
    # a multi-host TPU slice added and removed whole): a finished run stops billing. Unset: on
    # for kind capacity and for flex-start, off otherwise (the pools stay up, billed, until
    # `pulumi destroy`; render says so).
    scale_to_zero: bool | None = None
    # A cluster create_cluster makes: its control plane reachable only from these CIDR ranges
    # (authorized networks), or only on its private endpoint with `private_endpoint: true`.
    # Unset and false: reachable from anywhere, with credentials (render says so).
    authorized_networks: list[str] = []
    private_endpoint: bool = False
    # A created cluster refuses to be deleted until this is false and applied. It protects the
    # cluster itself, not what is in it: `pulumi destroy` still deletes the stack's node pools,
    # queue objects and JobSet first (dependents go before the cluster), then stops at it.
    deletion_protection: bool = True
    # A finished JobSet (Completed or Failed) is deleted by the JobSet controller this many
    # seconds after it finished (ttlSecondsAfterFinished; 0: at once); its logs stay in the
    # bucket. Default: xpk's, 12 hours.
    ttl_after_finished_s: int = Field(default=12 * 3600, ge=0)

    @property
    def team_names(self) -> list[str]:
        """The team namespaces of a capacity stack: `teams`' or `team_namespaces`."""
        return list(self.teams) or list(self.team_namespaces)

    @property
    def queued(self) -> bool:
        """Whether Kueue admits the JobSet: the stack's own queue or the admin's."""
        return self.queueing or self.local_queue is not None

    def installs(self) -> dict[str, bool]:
        """Which cluster-wide controllers this stack applies: by default only to a cluster it
        creates, never to an existing one (its admin's, taken as it is) unless the stack file
        says so."""
        def chosen(value: bool | None) -> bool:
            if self.kind == "workload":
                return False
            return self.create_cluster if value is None else value

        return {"jobset": chosen(self.install_jobset),
                "kueue": (self.queueing or self.kind == "capacity")
                and chosen(self.install_kueue)}

    def pools_scale_to_zero(self, capacity: str) -> bool:
        if self.scale_to_zero is not None:
            return self.scale_to_zero
        return self.kind == "capacity" or capacity == "flex-start"


class StackConfig(_Model):
    """Everything one multislice experiment needs; keys are ``multislice:<field>`` in the stack."""

    @model_validator(mode="before")
    @classmethod
    def _first_shape_is_the_stacks(cls, data: Any) -> Any:
        """A capacity stack with gke.shapes sets no shape keys of its own: they are its first
        shape's, so the checks shared with other stacks read a shape (gke/checks.py refuses
        keys that differ from it)."""
        gke = data.get("gke") if isinstance(data, dict) else None
        shapes = gke.get("shapes") if isinstance(gke, dict) else None
        if not (isinstance(shapes, dict) and shapes and gke.get("kind") == "capacity"):
            return data
        first = next(iter(shapes.values()))
        if not isinstance(first, dict):
            return data
        return {**{k: first[k] for k in ("accelerator_type", "slices", "capacity",
                                         "reservation_name") if k in first}, **data}

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
    # Shielded VM Secure Boot on the TPU VMs (the node's shielded_instance_config): only signed
    # boot components run. A queued resource made before this key existed keeps booting without
    # it until it is next created (infra/tpu_vm/provider.py): turning it on never re-queues.
    secure_boot: bool = True
    labels: dict[str, str] = {}
    tags: list[str] = []
    # Required but for a GKE capacity stack (gke.kind: capacity), which runs no experiment.
    experiment_dir: str = ""
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
    # data): what recovers checkpoints a compromised host deleted (the hosts may delete in their
    # run directory: checkpoint rotation does). Every rotated checkpoint stays billed that long,
    # so 7 (the API's minimum) by default; 0 (off) or 7..90, the API's range.
    soft_delete_days: int = 7
    # A customer-managed key (Cloud KMS) the bucket encrypts new objects with by default,
    # projects/P/locations/L/keyRings/R/cryptoKeys/K, in the bucket's location (the stack's
    # region). The project's Cloud Storage service agent needs
    # roles/cloudkms.cryptoKeyEncrypterDecrypter on it (README: the organisation's roles).
    bucket_kms_key: str | None = Field(
        default=None, pattern=r"^projects/[^/]+/locations/[^/]+/keyRings/[^/]+/cryptoKeys/[^/]+$")
    # Whether `pulumi up` enables the APIs the stack uses (roles/serviceusage.serviceUsageAdmin,
    # which can also disable any API of the project). A platform that enabled them sets false:
    # the stack then declares none, and the deployer needs no Service Usage role.
    enable_apis: bool = True
    # The run directory is gs://BUCKET/runs/STACK, or runs/STACK-RUN_NAME with a run name: a new
    # run on the same slices (say, after a change of the model's shape) is a one-line change.
    run_name: str | None = Field(default=None, pattern=r"^[a-z0-9][a-z0-9-]{0,39}$")
    # How often each VM checks the launch spec object for a new generation (a change of code or
    # trainer settings), jittered by +-25% so hosts do not poll in lockstep.
    spec_poll_s: int = Field(default=60, ge=5, le=3600)
    # How the hosts reach the internet. nat: through the stack's Cloud NAT (a host that finds no
    # environment for the lock in the bucket builds it from PyPI and GitHub). none: no NAT and no
    # route out is used; Private Google Access carries the bucket, and the environment must be
    # published before the boot (`multislice env-publish`): preview refuses the stack until it is.
    egress: Literal["nat", "none"] = "nat"
    # An existing network and subnet (orchestration tpu-vm), checked at preview against what the
    # slices need (MTU 8896, Private Google Access, the internal firewall on the hosts' tags, the
    # egress `egress` says), instead of the stack's own VPC, subnet, router and NAT.
    network: SharedNetwork | None = None
    package_index: PackageIndex | None = None
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
        """Every derived name (infra/stack_config/names.py); never a timestamp."""
        return stack_names(self.stack, self.project, self.slices, self.bucket_name,
                           self.run_name)

    @property
    def effective_runtime_version(self) -> str:
        return self.runtime_version or self.topology.generation.default_runtime_version

    def resolved_mesh(self) -> dict[str, int]:
        """Mesh with every -1 filled in (call after ``infra.stack_config.validation.validate_stack`` passed)."""
        topo = self.topology
        values = self.trainer.mesh.values()
        ici = fill_mesh_group(group_values(values, "ici"), topo.devices)
        dcn = fill_mesh_group(group_values(values, "dcn"), self.slices)
        return {**ici, **dcn}

    def trains_nothing(self) -> str | None:
        """Why this stack has no experiment to run or plan (a GKE capacity stack), else None."""
        if self.gke is not None and self.gke.kind == "capacity":
            return (f"stack {self.stack!r} is a GKE capacity stack (gke.kind: capacity): it "
                    "trains nothing; use a workload stack that joins its queue (gke.kind: "
                    "workload)")
        return None

    def toolkit_labels(self) -> dict[str, str]:
        """Labels the toolkit sets on every resource; a stack's ``labels`` cannot override them."""
        return {STACK_LABEL: self.stack}

    def all_labels(self) -> dict[str, str]:
        return {**self.labels, **self.toolkit_labels()}

    def owner_labels(self) -> dict[str, str]:
        """The Kubernetes labels that say which stack of which project owns an object (a domain-
        scoped project's ':' is no label character)."""
        return {**self.toolkit_labels(), PROJECT_LABEL: self.project.replace(":", "_")}


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


def suggest(word: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(word, allowed, n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


_USERINFO = re.compile(r"(://)[^/@\s'\"]*@")


def _shown(value: Any) -> str:
    """A refused value as a message shows it: a URL's user and password (a credential someone
    put where none belongs) masked, never repeated into a terminal or a CI log."""
    return _USERINFO.sub(r"\1***@", repr(value))


def _format_pydantic(err: ValidationError) -> list[str]:
    out = []
    for item in err.errors():
        loc = ".".join(str(p) for p in item["loc"])
        if item["type"] == "extra_forbidden":
            section, allowed = _section_fields(item["loc"])
            key = str(item["loc"][-1])
            out.append(
                f"{loc}: unknown key{suggest(key, allowed)} (value {_shown(item['input'])}); "
                f"allowed keys of {section}: {', '.join(sorted(allowed))}"
            )
        elif item["type"] == "missing":
            out.append(f"{loc}: required but not set")
        else:
            out.append(f"{loc}: value {_shown(item['input'])} is not allowed: {item['msg']}")
    return out


def parse_stack(raw: Mapping[str, Any], stack: str, source: str = "stack config") -> StackConfig:
    """Build a StackConfig from un-namespaced keys; type errors become StackConfigError."""
    data = {"stack": stack, **raw}
    try:
        return StackConfig.model_validate(data)
    except ValidationError as exc:
        raise StackConfigError(_format_pydantic(exc), source=source) from None
