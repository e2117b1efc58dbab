"""`multislice render STACK_CONFIG`: the stack's resources as a reviewable manifest, offline.

The Pulumi program (__main__.py, infra/program.py) runs under Pulumi's mock runtime: no CLI, no provider
plugins, no credentials. Every resource it registers is recorded with its type, name, parent,
dependencies and inputs; the queued resource also gets the full TPU API request the dynamic
provider would send. The manifest is sorted and free of absolute paths and timestamps, so the same
input always gives the same bytes and a diff of two renders shows exactly what a change does. A
relative experiment_dir resolves against the project root (Pulumi.yaml, infra/), as under `pulumi`.

`--diff OTHER` compares against OTHER (a stack config, or a manifest written by `--output`);
`--diff-base REF` against the stack as the git ref REF has it, rendered by REF's code
(scripts/render_base.py), which is what CI's render-diff job runs. Either prints resources added (+), removed (-) and changed (~) field by field. Resources are matched by
their role in the stack (names derived from the stack and the archive hash taken out), so two
stacks differ only where their configs do. Each changed resource says whether its provider updates
it in place or replaces it, and which input forces that; the last line is the verdict: whether the
change keeps the queued resource (the slices) or gives up the capacity and queues again.

Exit codes: 0 rendered (whether or not the diff is empty), 1 the program failed under the mock
runtime, 2 invalid stack config or arguments.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scripts import PROJECT_ROOT
from scripts.argtypes import report_error

MANIFEST_VERSION = 1
ROOT = PROJECT_ROOT  # the Pulumi project (Pulumi.yaml, infra/)
DYNAMIC = "pulumi-python:dynamic:Resource"
BUCKET_OBJECT = "gcp:storage/bucketObject:BucketObject"
NODE_POOL = "gcp:container/nodePool:NodePool"
JOBSET = "kubernetes:jobset.x-k8s.io/v1alpha2:JobSet"
EXIT_OK, EXIT_PROGRAM, EXIT_USAGE = 0, 1, 2
SECRET = "[secret]"


class RenderError(ValueError):
    """The stack config or the OTHER file cannot be rendered; the message says why."""


# ---- reading the stack config ------------------------------------------------------------------


def pulumi_config(stack_file: Path, root: Path = ROOT) -> dict[str, str]:
    """The `config:` block as the engine hands it to a program (infra.stack_config.schema.read_stack_file)."""
    from infra.stack_config.schema import StackConfigError
    from infra.stack_config.stack_file import project_name, read_stack_file

    try:
        return read_stack_file(stack_file, project_name(root))
    except StackConfigError as exc:
        raise RenderError(str(exc)) from None


# ---- running the program under mocks -----------------------------------------------------------


@dataclass
class Registration:
    type: str
    name: str
    urn: str
    parent: str
    custom: bool
    dependencies: list[str]
    inputs: dict[str, Any]
    retain_on_delete: bool = False


@dataclass
class Recorder:
    registrations: list[Registration] = field(default_factory=list)


def _mock_classes() -> tuple[type, type]:
    """Mocks and MockMonitor subclasses (built lazily: importing pulumi is slow)."""
    import pulumi
    from pulumi.runtime.mocks import MockMonitor

    from infra.stack_config.names import node_ids
    from infra.tpu_vm.api import node_name, queued_resource_name

    class RenderMocks(pulumi.runtime.Mocks):
        """Outputs echo the inputs, plus the few values the program reads back."""

        def new_resource(self, args: pulumi.runtime.MockResourceArgs) -> tuple[str, dict]:
            from infra.gke.manifest import mock_resource_outputs

            outputs = {**args.inputs, **mock_resource_outputs(args.typ, dict(args.inputs))}
            if args.typ == "gcp:serviceaccount/account:Account":
                outputs["email"] = (
                    f"{args.inputs['accountId']}@{args.inputs['project']}.iam.gserviceaccount.com"
                )
                # what a grant on the account names (the actAs of multislice:deployer)
                outputs["name"] = f"projects/{args.inputs['project']}/serviceAccounts/" \
                    f"{outputs['email']}"
            if args.typ == DYNAMIC and "queued_resource_id" in args.inputs:
                spec = args.inputs
                outputs["name"] = queued_resource_name(
                    spec["project"], spec["zone"], spec["queued_resource_id"])
                ids = node_ids(spec["node_prefix"], int(spec["slices"]))
                outputs["node_ids"] = ids
                outputs["node_names"] = [node_name(spec["project"], spec["zone"], i) for i in ids]
                outputs["state"] = "ACTIVE"
            return f"{args.name}-id", outputs

        def call(self, args: pulumi.runtime.MockCallArgs) -> dict:
            from infra.gke.manifest import mock_call_result

            return mock_call_result(args.token, dict(args.args))

    class RecordingMonitor(MockMonitor):
        """Also keeps what MockResourceArgs leaves out: parent and dependencies."""

        def __init__(self, mocks: Any, recorder: Recorder) -> None:
            super().__init__(mocks)
            self.recorder = recorder

        def RegisterResource(self, request: Any) -> Any:  # noqa: N802 - gRPC method name
            from pulumi.runtime import rpc

            response = super().RegisterResource(request)
            if request.type != "pulumi:pulumi:Stack":
                self.recorder.registrations.append(Registration(
                    type=request.type,
                    name=request.name,
                    urn=response.urn,
                    parent=request.parent,
                    custom=bool(request.custom),
                    dependencies=list(request.dependencies),
                    inputs=rpc.deserialize_properties(request.object),
                    retain_on_delete=bool(request.retainOnDelete),
                ))
            return response

    return RenderMocks, RecordingMonitor


def run_program(stack_file: Path, root: Path = ROOT) -> tuple[Recorder, dict[str, Any]]:
    """Evaluate root/__main__.py for this stack under the mock runtime.

    The config reaches the program the way the engine passes it (``PULUMI_CONFIG``'s mapping, set
    with ``set_all_config``), and is validated by the program's own loader
    (``infra.stack_config.pulumi_config.load_stack_config``) first, so render and preview cannot disagree.
    """
    import runpy

    import pulumi
    from pulumi.runtime import settings

    from infra.stack_config.pulumi_config import load_stack_config
    from infra.stack_config.schema import StackConfigError
    from infra.stack_config.stack_file import project_name, stack_name_from_path

    render_mocks, recording_monitor = _mock_classes()
    recorder = Recorder()
    mocks = render_mocks()
    settings.ROOT.set(None)  # a fresh root stack for every render in this process
    pulumi.runtime.set_mocks(mocks, project=project_name(root), stack=stack_name_from_path(
        stack_file), preview=False, monitor=recording_monitor(mocks, recorder))
    pulumi.runtime.set_all_config(pulumi_config(stack_file, root))
    try:
        _, warnings = load_stack_config(base_dir=root)
    except StackConfigError as exc:
        message = str(exc).replace(f"stack {stack_name_from_path(stack_file)!r}", str(stack_file), 1)
        raise RenderError(message) from None
    for warning in warnings:  # what preview would print too; the manifest stays on stdout
        print(f"multislice render: warning: {warning}", file=sys.stderr)
    outputs: dict[str, Any] = {}

    @pulumi.runtime.test
    def program() -> Any:
        runpy.run_path(str(root / "__main__.py"), run_name="__main__")
        exports = dict(settings.get_root_resource().outputs)
        return pulumi.Output.from_input(exports).apply(outputs.update)

    from infra.gke import live_run

    # No cluster is asked offline: the JobSet's run digest is shown as what `up` would choose.
    live_run.reader = lambda *_: live_run.Offline()
    try:
        program()
    finally:
        live_run.reader = None
    return recorder, outputs


# ---- the manifest ------------------------------------------------------------------------------


def _short(urn: str) -> str | None:
    """`TYPE::NAME` of a URN (the last type of a parent chain); None for the stack itself."""
    if not urn:
        return None
    parts = urn.split("::")
    typ = parts[2].split("$")[-1]
    return None if typ == "pulumi:pulumi:Stack" else f"{typ}::{parts[3]}"


def _plain(value: Any, root: Path) -> Any:
    """JSON-able, deterministic, and free of this machine's paths."""
    import pulumi

    if isinstance(value, dict):
        from pulumi.runtime import rpc

        if value.get(rpc._special_sig_key) == rpc._special_secret_sig:
            return SECRET  # a secret input (a kubeconfig with a token): never printed
        return {str(k): _plain(v, root) for k, v in sorted(value.items()) if not str(k).startswith("__")}
    if isinstance(value, list | tuple):
        return [_plain(v, root) for v in value]
    if isinstance(value, str):
        return value.replace(f"{root}/", "").replace(str(root), ".")
    if isinstance(value, float) and value.is_integer():
        return int(value)  # the protobuf Struct carries every number as a double
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, pulumi.FileAsset | pulumi.FileArchive):
        import hashlib

        path = Path(str(value.path))
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
        kind = "file_asset" if isinstance(value, pulumi.FileAsset) else "file_archive"
        return {kind: _plain(str(path), root), "sha256": digest}
    if isinstance(value, pulumi.StringAsset):
        return {"string_asset": value.text}
    if isinstance(value, pulumi.RemoteAsset | pulumi.RemoteArchive):
        return {"remote": value.uri}
    if isinstance(value, pulumi.AssetArchive):
        return {"asset_archive": _plain(dict(value.assets), root)}
    return f"<{type(value).__name__}>"


def _archive_files(source: Any) -> dict[str, str] | None:
    """The files of a code archive (a .tar.gz file asset) with their sha256, else None."""
    import pulumi

    from infra.packaging.archive import archive_files

    if not isinstance(source, pulumi.FileAsset):
        return None
    path = Path(str(source.path))
    return archive_files(path) if path.name.endswith(".tar.gz") and path.is_file() else None


def build_manifest(stack_file: Path, root: Path = ROOT) -> dict[str, Any]:
    """Validate, evaluate, and describe every resource of the stack."""
    from infra.stack_config.stack_file import project_name, stack_name_from_path
    from infra.tpu_vm.request import build_queued_resource_request

    recorder, outputs = run_program(stack_file, root)
    resources = []
    for reg in recorder.registrations:
        entry: dict[str, Any] = {
            "type": reg.type,
            "name": reg.name,
            "parent": _short(reg.parent),
            "custom": reg.custom,
            "depends_on": sorted({s for s in map(_short, reg.dependencies) if s}),
            "inputs": _plain(reg.inputs, root),
        }
        if reg.retain_on_delete:  # `pulumi destroy` leaves it (and, for a component, its children)
            entry["retain_on_delete"] = True
        if reg.type == DYNAMIC and "queued_resource_id" in reg.inputs:
            entry["api_request"] = _plain(build_queued_resource_request(dict(reg.inputs)), root)
        files = _archive_files(reg.inputs.get("source"))
        if files is not None:
            entry["archive_files"] = files
        resources.append(entry)
    resources.sort(key=lambda r: (r["type"], r["name"]))
    return {
        "manifest_version": MANIFEST_VERSION,
        "project": project_name(root),
        "stack": stack_name_from_path(stack_file),
        "resources": resources,
        "outputs": _plain(outputs, root),
    }


def _run_check(manifest: dict[str, Any]) -> dict[str, Any] | None:
    """The inputs of the stack's run check (infra/preview/run_check.py): bucket, run, model shape."""
    return next(((r.get("inputs") or {}) for r in manifest.get("resources", [])
                 if r["type"] == DYNAMIC and "run_prefix" in (r.get("inputs") or {})), None)


def run_verdict(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """What a new launch spec does to the training run, when it does more than resume it."""
    from infra.preview.run_check import shape_changes

    was, now = _run_check(old), _run_check(new)
    if was is None or now is None:
        return None  # a base rendered before manifests said
    where = f"gs://{now.get('bucket')}/{now.get('run_prefix')}"
    if (was.get("bucket"), was.get("run_prefix")) != (now.get("bucket"), now.get("run_prefix")):
        return (f"the trainer starts fresh in {where} (a new run_name; "
                f"gs://{was.get('bucket')}/{was.get('run_prefix')} keeps its checkpoints)")
    before, after = was.get("model_shape"), now.get("model_shape")
    if isinstance(before, dict) and isinstance(after, dict) and before != after:
        return (f"the model's shape changes ({shape_changes(before, after)}): the run's "
                f"checkpoints in {where} will not restore; set a new run_name")
    return None


class _LiteralDumper:
    """yaml.SafeDumper that writes multi-line strings (scripts) as literal blocks."""

    @staticmethod
    def build() -> Any:
        import yaml

        class Dumper(yaml.SafeDumper):
            pass

        def text(dumper: Any, value: str) -> Any:
            style = "|" if "\n" in value and not any(c in value for c in "\t\r") else None
            return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

        Dumper.add_representer(str, text)
        return Dumper


def dump(manifest: dict[str, Any], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(manifest, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    import yaml

    return yaml.dump(manifest, Dumper=_LiteralDumper.build(), sort_keys=True,
                     default_flow_style=False, allow_unicode=True, width=1 << 16)


# ---- diff --------------------------------------------------------------------------------------


def load_other(path: Path, root: Path = ROOT) -> dict[str, Any]:
    """OTHER for --diff: a rendered manifest (YAML or JSON), or a stack config to render."""
    import yaml

    from infra.stack_config.userfile import MAX_CONFIG_BYTES, UserFileError, load_yaml, read_text

    try:
        # A rendered manifest of a large stack is bigger than a stack file: 16 of its limit.
        doc = load_yaml(read_text(path, "manifest or stack config", 16 * MAX_CONFIG_BYTES),
                        f"--diff {path}")
    except UserFileError as exc:
        raise RenderError(f"--diff {exc}; give a manifest from `multislice render --output` or "
                          "a stack config") from None
    except yaml.YAMLError as exc:
        first = (str(exc).splitlines() or [""])[0]
        raise RenderError(f"--diff {path}: cannot read it ({first})") from None
    if isinstance(doc, dict) and "resources" in doc and "manifest_version" in doc:
        resources = doc["resources"]
        if not isinstance(resources, list) or not all(
                isinstance(r, dict) and isinstance(r.get("type"), str) for r in resources):
            raise RenderError(f"--diff {path}: 'resources' is not a list of rendered resources "
                              "(each a mapping with a 'type'); render the base again")
        return doc
    if isinstance(doc, dict) and "config" in doc:
        return build_manifest(path, root)
    raise RenderError(
        f"--diff {path}: neither a manifest from `multislice render --output` (has "
        "'manifest_version' and 'resources') nor a stack config (has 'config:')"
    )


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Leaves by path (`inputs.allows[0].protocol`); JSON-object strings are opened up too."""
    if isinstance(value, str) and value.startswith("{"):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            return _flatten(parsed, prefix + "(json)")
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key in sorted(value):
            out.update(_flatten(value[key], f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(value, list) and value:
        out = {}
        for index, item in enumerate(value):
            out.update(_flatten(item, f"{prefix}[{index}]"))
        return out
    return {prefix: value}


def _show(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def _field_lines(path: str, old: Any, new: Any) -> list[str]:
    if isinstance(old, str) and isinstance(new, str) and ("\n" in old or "\n" in new):
        lines = [f"~   {path}: (text)"]
        for line in difflib.unified_diff(old.splitlines(), new.splitlines(), lineterm="", n=1):
            if not line.startswith(("---", "+++")):
                lines.append(f"{line[:1] or ' '}     {line[1:]}")
        return lines
    out = []
    if old is not _MISSING:
        out.append(f"-   {path}: {_show(old)}")
    if new is not _MISSING:
        out.append(f"+   {path}: {_show(new)}")
    return out


_MISSING = object()
_COMPARED = ("parent", "custom", "depends_on", "inputs", "api_request")


def _compared(resource: dict[str, Any]) -> dict[str, Any]:
    out = {key: resource[key] for key in _COMPARED if key in resource}
    if "depends_on" in out:  # a dependency on the archive is the same one whatever its hash
        out["depends_on"] = [_SHA256.sub("<sha256>", str(d)) for d in out["depends_on"]]
    return out


_ARCHIVE_NAME = re.compile(r"(^|/)code/[0-9a-f]{64}\.tar\.gz$")
_ARCHIVE_FIELDS = ("inputs.name", "inputs.source.")  # what its content hash alone changes


def _is_archive(resource: dict[str, Any]) -> bool:
    """The experiment's code archive: a bucket object named by the sha256 of its content."""
    return (resource["type"] == BUCKET_OBJECT
            and bool(_ARCHIVE_NAME.search(str((resource.get("inputs") or {}).get("name", "")))))


def _archive_file_lines(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Which files of the experiment the new archive changes, adds and removes."""
    before, after = old.get("archive_files"), new.get("archive_files")
    if not isinstance(before, dict) or not isinstance(after, dict):
        side = "base" if not isinstance(before, dict) else "new"
        return [f"~   files: not listed in the {side} manifest (it has no archive_files: render "
                "it again with this version of multislice)"]
    changed = sorted(f for f in before.keys() & after.keys() if before[f] != after[f])
    added, removed = sorted(after.keys() - before.keys()), sorted(before.keys() - after.keys())
    if not (changed or added or removed):
        return [f"~   files: none changed (of {len(after)}): only how the archive is packed or "
                "named differs"]
    lines = [f"~   files: {len(changed)} changed, {len(added)} added, {len(removed)} removed "
             f"(of {len(after)} in the new archive)"]
    lines += [f"~     {f}" for f in changed]
    lines += [f"+     {f}" for f in added]
    lines += [f"-     {f}" for f in removed]
    return lines


# Inputs whose change makes the provider delete and re-create the resource (ForceNew in the
# provider's schema: GCP names and placements cannot change). Everything else updates in place.
_NAMING = ("name", "project")
REPLACED_BY = {
    "gcp:compute/network:Network": (*_NAMING, "autoCreateSubnetworks"),
    "gcp:compute/subnetwork:Subnetwork": (*_NAMING, "network", "region"),
    "gcp:compute/firewall:Firewall": (*_NAMING, "network"),
    "gcp:compute/router:Router": (*_NAMING, "network", "region"),
    "gcp:compute/routerNat:RouterNat": (*_NAMING, "router", "region"),
    "gcp:storage/bucket:Bucket": (*_NAMING, "location"),
    "gcp:storage/bucketObject:BucketObject": ("name", "bucket", "source", "content"),
    "gcp:storage/bucketIAMMember:BucketIAMMember": ("bucket", "role", "member"),
    "gcp:projects/iAMMember:IAMMember": ("project", "role", "member"),
    "gcp:serviceaccount/account:Account": ("project", "accountId"),
    "gcp:projects/service:Service": ("project", "service"),
    # orchestration gke (infra/gke/resources.py): nodeCount and the JobSet's spec by replace_on_changes
    "gcp:container/cluster:Cluster": (*_NAMING, "location", "network", "subnetwork",
                                      "privateClusterConfig", "ipAllocationPolicy"),
    NODE_POOL: ("name", "project", "location", "cluster", "nodeLocations", "nodeConfig",
                "placementPolicy", "nodeCount"),
    JOBSET: ("metadata", "spec"),
    "kubernetes:core/v1:Namespace": ("metadata",),
    "kubernetes:core/v1:ConfigMap": ("metadata", "data"),
    "gcp:serviceaccount/iAMMember:IAMMember": ("serviceAccountId", "role", "member"),
}
_SHA256 = re.compile(r"\b[0-9a-f]{64}\b")


def _replaced_by(resource: dict[str, Any]) -> tuple[str, ...]:
    if _is_queued_resource(resource):
        from infra.tpu_vm.request import IMMUTABLE_FIELDS

        return IMMUTABLE_FIELDS
    return REPLACED_BY.get(resource["type"], ())  # the checks (dynamic too) hold nothing


def _is_queued_resource(resource: dict[str, Any]) -> bool:
    """The queued resource among the dynamic resources (the others are preview's checks)."""
    return (resource["type"] == DYNAMIC and resource.get("custom", True)
            and "queued_resource_id" in (resource.get("inputs") or {}))


def _normalizer(manifest: dict[str, Any]) -> Any:
    """Names derived from the stack (bucket, ms-STACK-..., runs/STACK, launch/STACK.json) as
    placeholders, so two stacks compare by what differs besides their names."""
    stack = str(manifest.get("stack") or "")
    bucket = str((manifest.get("outputs") or {}).get("bucket") or "")
    pairs = [(bucket, "<bucket>")] if bucket else []
    if stack:
        pairs += [(f"ms-{stack}", "ms-<stack>"), (f"runs/{stack}", "runs/<stack>"),
                  (f'"stack": "{stack}"', '"stack": "<stack>"'),
                  (f"launch/{stack}.json", "launch/<stack>.json")]

    def norm(value: Any) -> Any:
        if isinstance(value, str):
            if stack and value == stack:
                return "<stack>"
            for old, new in pairs:
                value = value.replace(old, new)
            return value
        if isinstance(value, dict):
            return {norm(k): norm(v) for k, v in value.items()}
        if isinstance(value, list):
            return [norm(v) for v in value]
        return value

    return norm


def _role(resource: dict[str, Any], norm: Any) -> tuple[str, str]:
    """What the resource is in the stack: its type and name with the stack's names (and the
    archive's content hash) taken out; the same role in two stacks or two commits."""
    return resource["type"], _SHA256.sub("<sha256>", norm(resource["name"]))


@dataclass
class ResourceChange:
    type: str
    name: str
    kind: str  # added | removed | replaced | rewritten (a bucket object) | updated | changed
    # (a component: no provider)
    forced_by: list[str]
    fields: list[str]  # top-level inputs that differ
    paths: list[str] = field(default_factory=list)  # every flattened input path that differs


def _input_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    before, after = old.get("inputs") or {}, new.get("inputs") or {}
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


def _short_value(value: Any) -> str:
    text = _show(value)
    return text if len(text) <= 40 else text[:37] + "..."


# The node metadata holds only the toolkit's boot files (infra/boot/) and where the spec lives: a
# change there is a new toolkit version, and the TPU API cannot change a node's metadata.
_BOOT_FILES = "metadata changed: the toolkit's boot files (infra/boot/startup.sh, launch.py)"


KEEPS_WITH_NEW_SPEC = ("verdict: keeps the queued resource; the VMs restart their trainers on "
                      "the new launch spec (saved at a step boundary, resumed from it)")


def verdict(changes: list[ResourceChange], old_qr: dict[str, Any] | None,
            new_qr: dict[str, Any] | None, qr_names: frozenset[str] = frozenset()) -> str:
    """One line for the reviewer: does this change keep the queued resource (the slices)?
    `qr_names`: the queued resource's names (the other dynamic resources are preview's checks);
    empty: any dynamic resource."""
    qr = next((c for c in changes if c.type == DYNAMIC
               and (not qr_names or c.name in qr_names)), None)
    if new_qr is None and old_qr is not None:
        return "verdict: DELETES the queued resource: the job gives up its capacity"
    if old_qr is None and new_qr is not None:
        return "verdict: CREATES the queued resource (new stack): the job queues for capacity"
    if qr is not None and qr.kind == "replaced":
        assert old_qr is not None and new_qr is not None
        was, now = old_qr.get("inputs") or {}, new_qr.get("inputs") or {}
        why = ", ".join(
            f"{f} {_short_value(was.get(f))} -> {_short_value(now.get(f))}"
            if not isinstance(was.get(f), dict | list) and not isinstance(now.get(f), dict | list)
            else _BOOT_FILES if f == "metadata" else f"{f} changed" for f in qr.forced_by)
        return (f"verdict: REPLACES the queued resource ({why}): the job gives up its capacity "
                "and queues again")
    spec = next((c for c in changes if c.type == BUCKET_OBJECT and "/launch/" in f"/{c.name}"),
                None)
    if spec is not None:
        return KEEPS_WITH_NEW_SPEC
    return "verdict: keeps the queued resource"


GKE_KEEPS_WITH_NEW_SPEC = (
    "verdict: keeps the TPU node pools and the JobSet; its pods restart their trainers on the new "
    "launch spec (saved at a step boundary, resumed from it); a run that has ended is replaced "
    "by a new JobSet")
GKE_WORKLOAD_KEEPS_WITH_NEW_SPEC = (
    "verdict: keeps the JobSet and its place in the queue; its pods restart their trainers on "
    "the new launch spec (saved at a step boundary, resumed from it); a run that has ended is "
    "replaced by a new JobSet, which queues again")
GKE_NEW_RUN = (
    "verdict: keeps the TPU node pools; a new launch spec is a new run: REPLACES the JobSet on "
    "the same nodes (its pods save at a step boundary, the new pods resume from it)")


def gke_verdict(changes: list[ResourceChange], owns_pools: bool = True,
                has_jobset: bool = True) -> str:
    """One line for the reviewer of a GKE stack: are the node pools (the slices) kept? A
    workload stack (`owns_pools` false) runs on the admin's pools: its verdict is its JobSet's;
    a capacity stack (`has_jobset` false) has pools and no JobSet."""
    pools = [c for c in changes if c.type == NODE_POOL]
    jobset = next((c for c in changes if c.type == JOBSET), None)
    # the launch spec object (BUCKET/launch/STACK.json) rewritten: what a running JobSet's pods
    # follow in place (infra/gke/live_run.py)
    respec = any(c.type == BUCKET_OBJECT and "/launch/" in c.name for c in changes)
    added = [c.name for c in pools if c.kind == "added"]
    removed = [c.name for c in pools if c.kind == "removed"]
    replaced = [c for c in pools if c.kind == "replaced"]
    if not owns_pools:
        return _workload_verdict(jobset, respec)
    if not has_jobset and added and not removed and not replaced and \
            all(c.kind == "added" for c in changes):
        return f"verdict: CREATES {len(added)} TPU node pool(s) (new capacity stack)"
    if replaced:
        forced = sorted({f for c in replaced for f in c.forced_by})
        return (f"verdict: REPLACES {len(replaced)} TPU node pool(s) ({', '.join(forced)} "
                "changed): the job gives up those slices' capacity and waits for new nodes")
    if jobset is not None and jobset.kind == "added" and not removed and added:
        return "verdict: CREATES the TPU node pools and the JobSet (new stack)"
    if jobset is not None and jobset.kind == "removed":
        return "verdict: DELETES the JobSet" + (" and the TPU node pools" if removed else "")
    parts = []
    if added or removed:
        parts.append(f"adds node pools {', '.join(added)}" if added else
                     f"DELETES node pools {', '.join(removed)}")
    from infra.gke.manifest import LAUNCH_SPEC_ANNOTATION

    # The pods' template carries the launch spec's digest: a run ends when its trainer
    # finishes, so a later spec reaches the nodes as a new JobSet.
    new_run_only = jobset is not None and jobset.kind == "replaced" and bool(jobset.paths) and all(
        LAUNCH_SPEC_ANNOTATION in path for path in jobset.paths)
    if new_run_only and not (added or removed):
        return GKE_NEW_RUN
    if jobset is not None and jobset.kind == "replaced":
        parts.append("REPLACES the JobSet (its spec cannot change in place): every pod restarts "
                     "and resumes from the last checkpoint")
    if parts:
        kept = "keeps the other TPU node pools" if added or removed else "keeps the TPU node pools"
        return f"verdict: {kept}; {'; '.join(parts)}"
    if has_jobset and respec:
        return GKE_KEEPS_WITH_NEW_SPEC
    return "verdict: keeps the TPU node pools" + (" and the JobSet" if has_jobset else "")


def _workload_verdict(jobset: ResourceChange | None, respec: bool = False) -> str:
    """A workload stack's verdict: the pools are the admin's; its JobSet is what changes."""
    from infra.gke.manifest import LAUNCH_SPEC_ANNOTATION

    if jobset is None:
        return (GKE_WORKLOAD_KEEPS_WITH_NEW_SPEC if respec else
                "verdict: keeps the JobSet (the node pools are the admin's)")
    if jobset.kind == "added":
        return ("verdict: CREATES the JobSet (new stack): it waits in its queue for the admin's "
                "pools")
    if jobset.kind == "removed":
        return "verdict: DELETES the JobSet: its Workload leaves the queue"
    if jobset.paths and all(LAUNCH_SPEC_ANNOTATION in path for path in jobset.paths):
        return ("verdict: a new launch spec is a new run: REPLACES the JobSet on the admin's "
                "pools (its pods save at a step boundary, the new pods resume from it; the new "
                "JobSet queues again)")
    return ("verdict: REPLACES the JobSet (its spec cannot change in place): it queues again, "
            "and every pod resumes from the last checkpoint")


def diff_manifests(old: dict[str, Any], new: dict[str, Any]) -> str:
    """Resource-by-resource differences from `old` to `new`, matched by role, one field per line,
    each resource marked in place or replaced (and by which field), then a verdict line."""
    old_norm, new_norm = _normalizer(old), _normalizer(new)

    def keyed(manifest: dict[str, Any], norm: Any) -> dict[tuple[str, str], dict[str, Any]]:
        return {_role(r, norm): r for r in manifest.get("resources", [])}

    before, after = keyed(old, old_norm), keyed(new, new_norm)
    lines: list[str] = []
    changes: list[ResourceChange] = []
    for key in sorted(before.keys() | after.keys()):
        typ = key[0]
        if key not in before:
            resource = after[key]
            changes.append(ResourceChange(typ, resource["name"], "added", [], []))
            lines.append(f"+ {typ} {resource['name']} (added)")
            for path, value in _flatten(_compared(new_norm(resource))).items():
                if isinstance(value, str) and "\n" in value:
                    value = f"<text, {len(value.splitlines())} lines>"
                lines += _field_lines(path, _MISSING, value)
            continue
        if key not in after:
            changes.append(ResourceChange(typ, before[key]["name"], "removed", [], []))
            lines.append(f"- {typ} {before[key]['name']} (removed)")
            continue
        was, now = old_norm(before[key]), new_norm(after[key])
        archive = _is_archive(before[key]) and _is_archive(after[key])
        old_fields, new_fields = _flatten(_compared(was)), _flatten(_compared(now))
        field_lines = []
        for path in sorted(old_fields.keys() | new_fields.keys()):
            a, b = old_fields.get(path, _MISSING), new_fields.get(path, _MISSING)
            if a != b and not (archive and path.startswith(_ARCHIVE_FIELDS)):
                field_lines += _field_lines(path, a, b)
        changed = _input_changes(was, now)
        if archive and "name" in changed:
            field_lines = _archive_file_lines(before[key], after[key]) + field_lines
        if not field_lines:
            continue
        forced = [f for f in changed if f in _replaced_by(after[key])]
        if not after[key].get("custom", True):
            kind = "changed"
            only_deps = {p.split("[")[0] for p in old_fields.keys() ^ new_fields.keys()
                         | {p for p in old_fields.keys() & new_fields.keys()
                            if old_fields[p] != new_fields[p]}} <= {"depends_on"}
            label = ("component: what it depends on changed; it has no cloud resource of its own"
                     if only_deps else "component changed")
        elif archive and "name" in changed:
            kind, label = "rewritten", ("new object, old one deleted: the code archive is named "
                                        "by its content")
        elif forced and after[key]["type"] == BUCKET_OBJECT:
            kind, label = "rewritten", (f"rewritten as a new object: {', '.join(forced)} changed; "
                                        "a bucket object cannot change in place")
        elif forced:
            kind, label = "replaced", f"REPLACED: {', '.join(forced)} cannot change in place"
        else:
            kind = "updated"
            label = f"updated in place: {', '.join(changed)}" if changed else "updated in place"
        differing = sorted(p for p in old_fields.keys() | new_fields.keys()
                           if old_fields.get(p, _MISSING) != new_fields.get(p, _MISSING))
        changes.append(ResourceChange(typ, after[key]["name"], kind, forced, changed, differing))
        lines.append(f"~ {typ} {after[key]['name']} ({label})")
        lines += field_lines
    old_out = _flatten(old_norm(old.get("outputs") or {}))
    new_out = _flatten(new_norm(new.get("outputs") or {}))
    output_lines = []
    for path in sorted(old_out.keys() | new_out.keys()):
        a, b = old_out.get(path, _MISSING), new_out.get(path, _MISSING)
        if a != b:
            output_lines += _field_lines(path, a, b)
    if output_lines:
        lines.append("~ stack outputs (changed)")
        lines += output_lines
    counts = {k: sum(c.kind == k for c in changes)
              for k in ("added", "removed", "replaced", "rewritten")}
    in_place = sum(c.kind in ("updated", "changed") for c in changes)
    if changes or output_lines:
        lines.append(f"{counts['added']} added, {counts['removed']} removed, "
                     f"{counts['replaced']} replaced, {counts['rewritten']} objects rewritten, "
                     f"{in_place} updated in place"
                     + (", outputs changed" if output_lines else ""))
    else:
        lines.append("no changes")

    def queued(manifest: dict[str, Any], norm: Any) -> dict[str, Any] | None:
        return next((norm(r) for r in manifest.get("resources", [])
                     if _is_queued_resource(r)), None)

    types = {r["type"] for m in (old, new) for r in m.get("resources", [])}
    if types & {NODE_POOL, JOBSET}:
        said = gke_verdict(changes, owns_pools=NODE_POOL in types, has_jobset=JOBSET in types)
    else:
        said = verdict(changes, queued(old, old_norm), queued(new, new_norm),
                       frozenset(r["name"] for m in (old, new) for r in m.get("resources", [])
                                 if _is_queued_resource(r)))
    # two stacks compared (--diff OTHER) are two runs by definition: only a stack's own change
    # of run or model is told
    same_stack = old.get("stack") == new.get("stack")
    lines.append(with_run_verdict(said, run_verdict(old, new) if same_stack else None))
    return "\n".join(lines) + "\n"


def with_run_verdict(said: str, run: str | None) -> str:
    """The verdict, its "resume" claim replaced by what happens to the run when it is more."""
    if run is None:
        return said
    for resumes in (" (saved at a step boundary, resumed from it)",
                    " (its pods save at a step boundary, the new pods resume from it)"):
        said = said.replace(resumes, "")
    return f"{said}: {run}"


def base_manifest(ref: str, stack_file: Path, root: Path = ROOT) -> tuple[dict[str, Any],
                                                                         list[str]]:
    """For --diff-base: (the stack's manifest as the git ref renders it, `base:` lines). The
    base's code archive gets its file list here when the ref's render predates archive_files."""
    from infra.packaging.archive import archive_files
    from scripts.render_base import render_base

    with render_base(ref, stack_file, root) as base:
        if base.manifest is None:
            return {"manifest_version": MANIFEST_VERSION, "resources": [], "outputs": {}}, base.notes
        manifest = load_other(base.manifest, base.project)
        for resource in manifest.get("resources", []):
            if not _is_archive(resource) or isinstance(resource.get("archive_files"), dict):
                continue
            source = (resource.get("inputs") or {}).get("source") or {}
            asset = source.get("file_asset") if isinstance(source, dict) else None
            if isinstance(asset, str) and (base.project / asset).is_file():
                resource["archive_files"] = archive_files(base.project / asset)
        return manifest, base.notes


# ---- command -----------------------------------------------------------------------------------


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "render",
        help="offline manifest of a stack (Pulumi mock runtime, no credentials)",
        description="Every resource the Pulumi program would create for a stack, with its "
        "inputs and the full TPU API request, rendered offline under Pulumi's mock runtime (no "
        "CLI, no credentials). The output is byte-stable, so a diff of two renders shows exactly "
        "what a change does; --diff OTHER prints that diff.",
        epilog="Exit codes: 0 rendered, 1 the program failed, 2 invalid stack config or arguments.",
    )
    parser.add_argument("stack_config", type=Path, metavar="STACK_CONFIG",
                        help="a Pulumi.<stack>.yaml stack config")
    parser.add_argument("--json", action="store_true",
                        help="print the manifest as JSON instead of YAML")
    base = parser.add_mutually_exclusive_group()
    base.add_argument("--diff", type=Path, metavar="OTHER",
                      help="print the differences from OTHER (stack config or rendered "
                      "manifest) to this stack, instead of the manifest")
    base.add_argument("--diff-base", metavar="REF",
                      help="print the differences from this stack config as the git ref REF "
                      "has it (branch, tag or sha), rendered by REF's own code as CI's "
                      "render-diff job does; the working tree is not touched")
    parser.add_argument("--output", type=Path, metavar="FILE",
                        help="write the manifest to FILE (with --diff: as well as the diff)")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from infra.stack_config.schema import StackConfigError
    from scripts.render_base import BaseRefError

    notes: list[str] = []
    try:
        manifest = build_manifest(args.stack_config)
        other = load_other(args.diff) if args.diff is not None else None
        if args.diff_base is not None:
            other, notes = base_manifest(args.diff_base, args.stack_config)
    except (RenderError, StackConfigError, BaseRefError) as exc:
        report_error("render", exc)
        return EXIT_USAGE
    except Exception as exc:  # the program itself broke: say where, keep the traceback short
        report_error("render", f"the Pulumi program failed for {args.stack_config}: "
                     f"{type(exc).__name__}: {exc}")
        return EXIT_PROGRAM
    text = dump(manifest, "json" if args.json else "yaml")
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text)
    if other is not None:
        sys.stdout.write("".join(f"{note}\n" for note in notes) + diff_manifests(other, manifest))
    elif args.output is None:
        sys.stdout.write(text)
    return EXIT_OK
