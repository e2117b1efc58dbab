"""`multislice babysit`: keep a queued resource alive, and the action log every command writes.

SUSPENDED and FAILED queued resources still hold quota and never come back on their own, so the
babysitter deletes them and creates the same request again. With a stack config the spec is
rebuilt from it exactly as the Pulumi program builds it (what GET returns is not relied on);
without one it is the resource's own, read back before deletion.

The spec is never only in memory: it is written to the spec file (next to `--log`, else under
.multislice/babysit/) *before* the delete, and marked done once the create went through. A rerun
that finds the resource missing and a pending spec file creates it from that file, so a crash or a
failed create between delete and create loses nothing. Creates retry transient errors (429, 5xx,
timeouts) with backoff; a 404 on delete means already gone.

A queued resource that is missing for another reason (never created, or `pulumi destroy`) is left
alone unless `recreate_missing` is set. Recreations are bounded (`max_retries`, counted since the
last ACTIVE) and spaced by exponential backoff. A request still ACCEPTED or WAITING_FOR_RESOURCES
`max_wait_s` after its creation is cancelled (deleted) instead of waiting forever.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.tpu_vm.api import BROKEN_STATES, QUEUED_STATES
from scripts.tpu.target import (
    EXIT_API,
    EXIT_BAD_STATE,
    EXIT_OK,
    EXIT_TIMEOUT,
    EXIT_USAGE,
    NOT_FOUND,
    Target,
    get_queued_resource,
    polling_for,
    retry_for,
    state_detail,
)

# Fields the API sets on a Node; cleared from a spec read back before it is sent again.
NODE_OUTPUT_FIELDS = ("name", "state", "health_description", "create_time", "network_endpoints",
                      "health", "id", "api_version", "symptoms", "queued_resource",
                      "multislice_node")


class ActionLog:
    """Timestamped lines on the console and, with a path, one JSON object per line in a file."""

    def __init__(self, console: Any, path: Path | None = None,
                 clock: Callable[[], float] = time.time, subject: str = "queued_resource") -> None:
        self.console = console
        self.path = path
        self.clock = clock
        self.subject = subject  # the JSON key naming what is babysat (a JobSet on GKE)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def record(self, action: str, target: Target, reason: str, **fields: Any) -> dict[str, Any]:
        now = self.clock()
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))
        entry = {"time": round(now, 3), "action": action, self.subject: target.name,
                 "reason": reason, **fields}
        self.console.print(f"{stamp} {action:<9} {target.qr_id}: {reason}", highlight=False,
                           markup=False, soft_wrap=True)
        if self.path is not None:
            with self.path.open("a") as handle:
                handle.write(json.dumps(entry, sort_keys=True) + "\n")
        return entry


@dataclass(frozen=True)
class BabysitPolicy:
    interval_s: float = 30.0
    max_retries: int = 5
    backoff_s: float = 30.0
    backoff_max_s: float = 900.0
    max_wait_s: float | None = None  # None: wait for capacity forever
    timeout_s: float | None = None  # None: babysit until interrupted
    until_active: bool = False
    recreate_missing: bool = False  # create the queued resource when it does not exist
    op_timeout_s: float = 600.0
    spec_file: Path | None = None  # where the spec is persisted before every delete

    def backoff(self, attempt: int) -> float:
        """Delay before recreation number `attempt` (0-based): backoff_s * 2**attempt, capped."""
        return min(self.backoff_s * (2**attempt), self.backoff_max_s)


def recreate_spec(qr: Any) -> Any:
    """A copy of `qr` without the fields the API sets, ready for CreateQueuedResource."""
    from google.cloud import tpu_v2

    spec = tpu_v2.QueuedResource.deserialize(tpu_v2.QueuedResource.serialize(qr))
    for name in ("name", "create_time", "state"):
        delattr(spec, name)
    for node_spec in spec.tpu.node_spec:
        for name in NODE_OUTPUT_FIELDS:
            delattr(node_spec.node, name)
    return spec


def spec_digest(spec: Any) -> str:
    """sha256 of the spec's canonical JSON: equal digests mean the same request was sent."""
    from google.cloud import tpu_v2

    canonical = json.dumps(tpu_v2.QueuedResource.to_dict(spec), sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def default_spec_file(target: Target, log: Path | None) -> Path:
    """Next to the action log when there is one, else .multislice/babysit/QR.spec.json."""
    if log is not None:
        return log.with_name(f"{log.name}.spec.json")
    return Path(".multislice") / "babysit" / f"{target.project}-{target.zone}-{target.qr_id}.spec.json"


def write_spec_file(path: Path, doc: dict[str, Any]) -> None:
    """A babysitter's spec file, written atomically (a crash leaves the old file or the new
    one, never half of one), with the time it was saved."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {**doc, "saved": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def save_spec(path: Path, target: Target, spec: Any, source: str, pending: bool) -> None:
    """The queued resource's spec, before a delete (pending) and after its create."""
    from google.cloud import tpu_v2

    write_spec_file(path, {"queued_resource": target.name, "source": source,
                           "pending_create": pending,
                           "spec": json.loads(tpu_v2.QueuedResource.to_json(spec))})


class SpecFileError(ValueError):
    """A spec file that is not this babysitter's record of its target; the message says why."""


def read_spec_doc(path: Path | None, key: str, target: str) -> dict[str, Any] | None:
    """What a babysitter wrote at `path` for `target` (its `key` field), or None when there is
    no file yet. Anything else there is a SpecFileError, since babysit would overwrite it: a
    directory, a file it cannot read, one that is not its JSON, or another target's record."""
    if path is None or not os.path.lexists(path):
        return None
    if not path.is_file():
        raise SpecFileError(f"--spec-file {path}: exists and is not a regular file; name a file "
                            "babysit may write (a rerun reads it back)")
    from infra.stack_config.userfile import UserFileError, read_text

    try:
        doc = json.loads(read_text(path, "--spec-file"))
    except (UserFileError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SpecFileError(f"--spec-file {path}: not a spec file babysit wrote ({exc}); it "
                            "would be overwritten: name another file or remove it") from None
    if not isinstance(doc, dict) or doc.get(key) != target:
        found = doc.get(key) if isinstance(doc, dict) else type(doc).__name__
        raise SpecFileError(f"--spec-file {path}: holds {key} {found!r}, not {target}: babysit "
                            "keeps one target's record per file; give this target's own file")
    return doc


def load_pending_spec(path: Path | None, target: Target) -> Any | None:
    """The spec of a create that a previous run left pending for this target, if any."""
    from google.cloud import tpu_v2

    doc = read_spec_doc(path, "queued_resource", target.name)
    if doc is None or not doc.get("pending_create"):
        return None
    try:
        return tpu_v2.QueuedResource.from_json(json.dumps(doc["spec"]))
    except Exception as exc:  # noqa: BLE001 - a hand-edited record: one line
        raise SpecFileError(f"--spec-file {path}: its spec is not a queued resource "
                            f"({type(exc).__name__}); remove the file or fix it") from None


def spec_from_stack(target: Target) -> tuple[Any, str]:
    """(QueuedResource, archive sha256) as the Pulumi program would request it for this stack."""
    from google.cloud import tpu_v2

    from infra.packaging.archive import build_archive
    from infra.packaging.experiment import check_experiment_dir
    from infra.stack_config import manifest
    from infra.stack_config.stack_file import find_project_root
    from infra.tpu_vm.request import build_queued_resource_request

    cfg = target.stack
    experiment = Path(cfg.experiment_dir)
    if not experiment.is_absolute():
        experiment = find_project_root(target.stack_file.parent) / experiment
    problems = check_experiment_dir(experiment)
    if problems:
        raise ValueError("; ".join(problems))
    sha256 = build_archive(experiment).sha256
    request = build_queued_resource_request(manifest.queued_resource_spec(cfg))
    return tpu_v2.QueuedResource(request["queued_resource"]), sha256


def waiting_since(qr: Any, first_seen: float, now_wall: float) -> float:
    """Seconds the request has been queued: from its create_time, else from when we first saw it."""
    if "create_time" in qr:
        return max(0.0, now_wall - qr.create_time.timestamp())
    return max(0.0, now_wall - first_seen)


def delete(client: Any, target: Target, policy: BabysitPolicy) -> None:
    """Force-delete and wait until GET answers 404 (the id is free for the create); a 404 on
    the delete itself (already gone) is success."""
    from google.api_core import exceptions

    from infra.tpu_vm.api import wait_until_gone

    try:
        operation = client.delete_queued_resource(
            request={"name": target.name, "force": True}, retry=retry_for(target),
            timeout=target.request_timeout_s)
        operation.result(polling=polling_for(min(policy.interval_s, 2.0), policy.op_timeout_s))
    except exceptions.NotFound:
        return
    left = wait_until_gone(client, target.name, policy.op_timeout_s, min(policy.interval_s, 2.0),
                           target.request_timeout_s, retry_for(target))
    if left is not None:
        raise RuntimeError(f"{target.name} was still {left} {policy.op_timeout_s:.0f}s after "
                           "its delete; not creating it again yet")


def create(client: Any, target: Target, spec: Any, policy: BabysitPolicy) -> None:
    """Create, retrying transient errors. A 409 means it exists (an earlier try went through, or
    the delete had not): the next poll sees its real state."""
    from google.api_core import exceptions

    try:
        operation = client.create_queued_resource(
            parent=target.parent, queued_resource_id=target.qr_id, queued_resource=spec,
            retry=retry_for(target), timeout=target.request_timeout_s)
        operation.result(polling=polling_for(min(policy.interval_s, 2.0), policy.op_timeout_s))
    except exceptions.Conflict:
        return


def babysit(
    client: Any,
    target: Target,
    policy: BabysitPolicy,
    log: ActionLog,
    clock: Callable[[], float] = time.monotonic,
    wall: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Watch and heal until stopped; see the module docstring. Returns the CLI exit code."""
    start = clock()
    retries = 0
    last_state: str | None = None
    first_seen = wall()
    log.record("start", target, f"babysitting (max {policy.max_retries} recreations, "
               f"backoff {policy.backoff_s:g}s doubling to {policy.backoff_max_s:g}s, "
               f"max wait {policy.max_wait_s if policy.max_wait_s is not None else 'none'}, "
               f"spec file {policy.spec_file or 'none'})")
    spec, unbuildable = _spec_from_stack_or_none(target, log)  # None: read it from the API
    source = "stack config" if spec is not None else "read from the API"
    try:
        pending = load_pending_spec(policy.spec_file, target)
    except SpecFileError as exc:
        log.record("refuse", target, str(exc))
        return EXIT_USAGE
    while True:
        qr = get_queued_resource(client, target)
        state = qr.state.state.name if qr is not None else NOT_FOUND
        if pending is not None:
            if qr is None:
                log.record("resume", target, f"a previous run deleted it and did not finish "
                           f"the create: creating it from {policy.spec_file}",
                           spec_sha256=spec_digest(pending))
                create(client, target, pending, policy)
            save_spec(policy.spec_file, target, pending, "resumed", pending=False)
            pending = None
            last_state = None
            continue
        if qr is not None and source != "stack config":
            spec, source = recreate_spec(qr), "read from the API"
        if state != last_state:
            detail = state_detail(qr) if qr is not None else ""
            log.record("observe", target, f"state {state}" + (f" ({detail})" if detail else ""),
                       state=state)
            if state in QUEUED_STATES and last_state not in QUEUED_STATES:
                first_seen = wall()
            last_state = state

        if state == "ACTIVE":
            retries = 0
            if policy.until_active:
                log.record("done", target, "ACTIVE (--until-active)", state=state)
                return EXIT_OK
        elif state == NOT_FOUND and not policy.recreate_missing:
            why = ("was deleted outside babysit (pulumi destroy?), so it is not recreated"
                   if spec is not None else "does not exist; create it with `pulumi up`")
            log.record("error", target, f"{target.name} {why}; --recreate-missing (with "
                       "--stack-config) creates a missing queued resource", state=state)
            return EXIT_API
        elif state in BROKEN_STATES or state == NOT_FOUND:
            if spec is None:  # missing, never read, and the stack config cannot rebuild it
                log.record("error", target, f"{target.name} does not exist and no spec was ever "
                           f"read from it; {unbuildable}", state=NOT_FOUND)
                return EXIT_API
            if retries >= policy.max_retries:
                log.record("give_up", target,
                           f"state {state} after {retries} recreation(s); --max-retries "
                           f"{policy.max_retries} reached, leaving it for a human", state=state)
                return EXIT_BAD_STATE
            if policy.spec_file is not None:
                save_spec(policy.spec_file, target, spec, source, pending=True)
            if state != NOT_FOUND:
                why = (f"state {state} ({state_detail(qr) or 'no detail from the API'}) still "
                       "holds quota and never recovers by itself")
                log.record("delete", target, why, state=state, attempt=retries + 1,
                           spec_file=str(policy.spec_file) if policy.spec_file else None)
                delete(client, target, policy)
            delay = policy.backoff(retries)
            log.record("backoff", target, f"waiting {delay:g}s before recreation "
                       f"{retries + 1}/{policy.max_retries}", seconds=delay)
            sleep(delay)
            log.record("create", target, f"recreate {retries + 1}/{policy.max_retries} with the "
                       f"same spec after {state}", attempt=retries + 1,
                       spec_sha256=spec_digest(spec))
            create(client, target, spec, policy)
            if policy.spec_file is not None:
                save_spec(policy.spec_file, target, spec, source, pending=False)
            retries += 1
            last_state = None
            continue
        elif state in QUEUED_STATES and policy.max_wait_s is not None:
            waited = waiting_since(qr, first_seen, wall())
            if waited > policy.max_wait_s:
                log.record("cancel", target,
                           f"still {state} {waited:.0f}s after creation, past --max-wait "
                           f"{policy.max_wait_s:g}s: deleting the request; raise --max-wait or "
                           "pick another zone/capacity and `pulumi up` again", state=state,
                           waited_s=round(waited, 1))
                delete(client, target, policy)
                return EXIT_TIMEOUT

        if policy.timeout_s is not None and clock() - start >= policy.timeout_s:
            log.record("stop", target, f"--timeout {policy.timeout_s:g}s reached; state {state}",
                       state=state)
            return EXIT_OK
        sleep(policy.interval_s)


def _spec_from_stack_or_none(target: Target, log: ActionLog) -> tuple[Any | None, str]:
    """(spec, "") rebuilt from the stack config when one was given; else (None, why not), and
    recreations reuse the spec read from the API."""
    if target.stack is None:
        return None, "no stack config was given: pass --stack-config so it can be rebuilt"
    try:
        spec, sha256 = spec_from_stack(target)
    except ValueError as exc:
        log.record("warn", target, f"the stack config {target.stack_file} cannot rebuild the "
                   f"spec ({exc}); recreations will reuse the spec read from the API")
        return None, f"the stack config {target.stack_file} cannot rebuild it: {exc}"
    log.record("spec", target, f"recreations use the spec rebuilt from {target.stack_file} "
               f"(its VMs train what {target.stack.names.launch_spec_uri} names, written by `pulumi up`: "
               f"experiment archive {sha256[:12]} for this checkout)",
               spec_sha256=spec_digest(spec))
    return spec, ""
