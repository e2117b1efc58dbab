"""`multislice babysit` of a GKE stack: recreate its JobSet when it has Failed.

JobSet restarts its pods itself (disruptions without limit, crashes up to trainer.max_restarts),
but a Failed JobSet stays Failed: its pods are gone and the node pools sit idle until someone acts.
The babysitter does what a person would: deletes the Failed JobSet (foreground: its Jobs and pods
first) and creates the same object again, so the new pods resume from the last checkpoint. The
object is the one `pulumi up` applied, read back (metadata down to name, namespace, labels and
annotations; no status), and written to the spec file before the delete: a rerun that finds the
JobSet missing and that file pending creates it from the file, so a crash between delete and
create loses nothing. A JobSet failed by the trainer's exit 2 or 3 (the failure policy's
FailJobSet: a bad config or a diverged run) would fail the same way every time: babysit stops
there (exit 3, one line naming the pod, its exit code and its last error line), never
recreating it. Other failures are bounded by `--max-retries` (reset once every pod runs) and
the backoff. Completed is the run's end: babysit exits 0. A missing JobSet with no pending spec
(`pulumi destroy`) is left alone.

Other actors: the delete carries the Failed JobSet's UID as a precondition, so a JobSet someone
else recreated meanwhile (a second babysitter, `pulumi up`) is never deleted (409 Conflict);
a create answered AlreadyExists is someone else's recreation. Both are logged and watched on.

Every action is a timestamped line and, with --log, a JSON line (scripts/tpu/babysit.ActionLog).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scripts.gke.status import GROUP, PLURAL, VERSION, snapshot
from scripts.tpu.babysit import (
    ActionLog,
    BabysitPolicy,
    SpecFileError,
    read_spec_doc,
    write_spec_file,
)
from scripts.tpu.target import EXIT_API, EXIT_BAD_STATE, EXIT_OK, EXIT_USAGE

KEPT_METADATA = ("name", "namespace", "labels", "annotations")


@dataclass(frozen=True)
class JobSetTarget:
    """What ActionLog names: `name` namespace/jobset, `qr_id` the JobSet's name."""

    name: str
    qr_id: str


def recreate_body(jobset: dict[str, Any]) -> dict[str, Any]:
    """The JobSet as `pulumi up` applied it: what the server added (uid, resourceVersion,
    managedFields, status...) taken out, so it can be created again."""
    meta = {k: v for k, v in jobset["metadata"].items() if k in KEPT_METADATA and v}
    return {"apiVersion": jobset["apiVersion"], "kind": jobset["kind"], "metadata": meta,
            "spec": jobset["spec"]}


def default_spec_file(namespace: str, name: str, log: Path | None) -> Path:
    if log is not None:
        return log.with_name(f"{log.name}.spec.json")
    return Path(".multislice") / "babysit" / f"jobset-{namespace}-{name}.spec.json"


def _save(path: Path, body: dict[str, Any], pending: bool) -> None:
    write_spec_file(path, {"jobset": f"{body['metadata']['namespace']}/{body['metadata']['name']}",
                           "pending_create": pending, "object": body})


def _pending(path: Path | None, target: JobSetTarget) -> dict[str, Any] | None:
    """The JobSet a previous run deleted and did not create again, from its spec file. Only the
    stack's own JobSet is ever created: a file holding anything else is a SpecFileError."""
    doc = read_spec_doc(path, "jobset", target.name)
    if doc is None or not doc.get("pending_create"):
        return None
    body = doc.get("object")
    namespace, name = target.name.split("/", 1)
    meta = body.get("metadata") if isinstance(body, dict) else None
    found = (body.get("apiVersion"), body.get("kind"), meta.get("namespace"), meta.get("name")) \
        if isinstance(meta, dict) else None
    if found != (f"{GROUP}/{VERSION}", "JobSet", namespace, name) or \
            not isinstance(body.get("spec"), dict):
        raise SpecFileError(f"--spec-file {path}: holds {found or 'no object'}, not the JobSet "
                            f"{target.name} ({GROUP}/{VERSION}) that babysit saved; it creates "
                            "nothing else: remove the file or give this stack's")
    return body


def _get(custom: Any, namespace: str, name: str) -> dict[str, Any] | None:
    from kubernetes import client

    try:
        return custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise


def _delete_and_wait(custom: Any, namespace: str, name: str, uid: str | None,
                     timeout_s: float, sleep: Callable[[float], None],
                     clock: Callable[[], float]) -> bool:
    """Delete the JobSet whose UID is `uid` and wait until it is gone. False when the object
    of that name is another one (409: recreated meanwhile by someone else): nothing deleted."""
    from kubernetes import client

    try:
        custom.delete_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name,
            body=client.V1DeleteOptions(propagation_policy="Foreground",
                                        preconditions=client.V1Preconditions(uid=uid)))
    except client.ApiException as exc:
        if exc.status == 409:
            return False
        if exc.status != 404:
            raise
    deadline = clock() + timeout_s
    while (found := _get(custom, namespace, name)) is not None:
        if uid and found["metadata"].get("uid") != uid:
            return True  # ours is gone; the one there now is someone else's recreation
        if clock() > deadline:
            raise TimeoutError(f"JobSet {namespace}/{name} still exists {timeout_s:g}s after "
                               "its deletion (a finalizer, pods that do not end?)")
        sleep(1.0)
    return True


def _create(custom: Any, namespace: str, body: dict[str, Any]) -> bool:
    """False when a JobSet of that name exists already (someone else recreated it)."""
    from kubernetes import client

    try:
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)
    except client.ApiException as exc:
        if exc.status == 409:
            return False
        raise
    return True


def babysit_jobset(api: Any, namespace: str, name: str, policy: BabysitPolicy, log: ActionLog,
                   clock: Callable[[], float] = time.monotonic,
                   sleep: Callable[[float], None] = time.sleep, cfg: Any = None) -> int:
    """Watch and heal until stopped; see the module docstring. Returns the CLI exit code.
    `cfg`: the stack, for the failing pod's log in its bucket."""
    from kubernetes import client

    custom = client.CustomObjectsApi(api)
    target = JobSetTarget(f"{namespace}/{name}", name)
    start, retries, last = clock(), 0, None
    log.record("start", target, f"babysitting JobSet {namespace}/{name} (max "
               f"{policy.max_retries} recreations, backoff {policy.backoff_s:g}s doubling to "
               f"{policy.backoff_max_s:g}s, spec file {policy.spec_file or 'none'})")
    while True:
        jobset = _get(custom, namespace, name)
        try:
            pending = _pending(policy.spec_file, target)
        except SpecFileError as exc:
            log.record("refuse", target, str(exc))
            return EXIT_USAGE
        if jobset is None and pending is not None:
            log.record("resume", target, f"a previous run deleted it and did not finish the "
                       f"create: creating it from {policy.spec_file}")
            if not _create(custom, namespace, pending):
                log.record("observe", target, "someone else created it meanwhile "
                           "(AlreadyExists): watching theirs")
            assert policy.spec_file is not None
            _save(policy.spec_file, pending, pending=False)
            continue
        snap = snapshot(api, namespace, name) if jobset is not None else None
        state = snap.state if snap is not None else "NOT_FOUND"
        line = f"{state}{f' ({snap.reason})' if snap and snap.reason else ''}"
        if line != last:
            log.record("observe", target, f"JobSet {line}" + (
                f", restarts {snap.restarts}" if snap is not None else ""), state=state)
            last = line
        if snap is not None and snap.state == "Running" and snap.all_ready:
            retries = 0
        if jobset is None:
            log.record("error", target, f"JobSet {namespace}/{name} does not exist (not created "
                       "yet, or `pulumi destroy`); it is not recreated: `pulumi up` creates it",
                       state=state)
            return EXIT_API
        if state == "Completed":
            log.record("done", target, "the run finished (JobSet Completed); nothing to babysit",
                       state=state)
            return EXIT_OK
        if state == "Failed" and snap.deterministic_failure:
            from scripts.gke.status import failure_detail

            log.record("give_up", target, f"JobSet Failed ({snap.reason}): the trainer exited "
                       "2 (bad config, topology or data) or 3 (diverged), which fails the same "
                       f"way every time; not recreating it. "
                       f"{failure_detail(snap, cfg) if cfg is not None else ''}. Fix "
                       "the stack and `pulumi up` (a new spec is a new JobSet)", state=state)
            return EXIT_BAD_STATE
        if state == "Failed":
            if retries >= policy.max_retries:
                log.record("give_up", target, f"JobSet Failed ({snap.reason}) after {retries} "
                           f"recreation(s); --max-retries {policy.max_retries} reached, leaving "
                           "it for a human (`multislice status`, the pods' logs in the bucket)",
                           state=state)
                return EXIT_BAD_STATE
            delay = policy.backoff(retries)
            log.record("backoff", target, f"waiting {delay:g}s before recreation "
                       f"{retries + 1}/{policy.max_retries}", seconds=delay)
            sleep(delay)
            body = recreate_body(jobset)
            if policy.spec_file is not None:
                _save(policy.spec_file, body, pending=True)
            began = clock()
            log.record("delete", target, f"JobSet Failed ({snap.reason}): a Failed JobSet never "
                       "runs again by itself; deleting it (foreground: its Jobs and pods first)",
                       state=state, attempt=retries + 1)
            uid = jobset["metadata"].get("uid")
            if not _delete_and_wait(custom, namespace, name, uid, policy.op_timeout_s, sleep,
                                    clock):
                if policy.spec_file is not None:
                    _save(policy.spec_file, body, pending=False)
                log.record("observe", target, "the JobSet there is no longer the Failed one "
                           f"(UID {uid} deleted and recreated by someone else: another "
                           "babysitter, pulumi up): deleted nothing, watching the new one",
                           state=state)
                last = None
                continue
            created = _create(custom, namespace, body)
            if policy.spec_file is not None:
                _save(policy.spec_file, body, pending=False)
            if not created:
                log.record("observe", target, "someone else created the JobSet between this "
                           "delete and create (AlreadyExists): watching theirs", state=state)
                last = None
                continue
            retries += 1
            took = clock() - began
            log.record("create", target, f"recreated the JobSet as `pulumi up` applied it "
                       f"({retries}/{policy.max_retries}) in {took:.2f}s; its pods resume from "
                       "the last checkpoint", attempt=retries, seconds=round(took, 3))
            last = None
            continue
        if policy.timeout_s is not None and clock() - start >= policy.timeout_s:
            log.record("stop", target, f"--timeout {policy.timeout_s:g}s reached; JobSet {line}",
                       state=state)
            return EXIT_OK
        sleep(policy.interval_s)
