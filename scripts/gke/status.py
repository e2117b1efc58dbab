"""The JobSet of a GKE stack as `multislice status` and `watch` show it: its state, how often
JobSet restarted it, its pods slice by slice, and which launch spec each pod runs.

Read through the Kubernetes API with the official client: the JobSet (jobset.x-k8s.io/v1alpha2)
and the pods JobSet labels with its name (jobset.sigs.k8s.io/jobset-name), placed by their
labels jobset.sigs.k8s.io/job-index (the slice) and batch.kubernetes.io/job-completion-index
(the pod's index in it).
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from infra.gke.manifest import REPLICATED_JOB
from scripts.gke.cluster import ClusterError
from scripts.tpu.target import EXIT_API, EXIT_BAD_STATE, EXIT_OK, EXIT_TIMEOUT, NOT_FOUND

GROUP, VERSION, PLURAL = "jobset.x-k8s.io", "v1alpha2", "jobsets"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
SLICE_LABEL = "jobset.sigs.k8s.io/job-index"
INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
# The reason JobSet (v0.12.0 failure_policy.go) gives a JobSet a FailJobSet rule failed: here
# only the rule for the trainer's deterministic exits (infra/gke/manifest.py) has that action.
FAIL_JOBSET_REASON = "FailJobSetFailurePolicyAction"
_ERROR_LINE = re.compile(r"^(error[: ]|\w*(Error|Exception)\b|F\d{4} |ERROR)")


def last_error_line(text: str) -> str:
    """The last line of a trainer's log that says why it ended: the trainer's own `error:`
    line, an exception (a traceback's last line), or absl's fatal line; "" when none does."""
    from scripts.logs import printable

    lines = [line.strip() for line in text.splitlines() if line.strip()]
    found = [line for line in lines if _ERROR_LINE.match(line)]
    return printable(found[-1][:300]) if found else ""


@dataclass
class PodRow:
    name: str
    slice: int
    index: int
    phase: str  # Pending | Running | Succeeded | Failed | Unknown
    ready: bool
    node: str
    container_restarts: int
    spec_generation: str = ""  # from the pod's report in the bucket (HOST.spec)
    spec_state: str = ""
    exit_code: int | None = None  # the trainer container's, once it terminated


@dataclass
class JobSetSnapshot:
    name: str
    namespace: str
    state: str  # Running | Pending | Completed | Failed | Suspended
    reason: str
    restarts: int
    slices: int
    pods_per_slice: int
    pods: list[PodRow] = field(default_factory=list)
    restarts_towards_max: int = 0  # status.restartsCountTowardsMax: what maxRestarts bounds
    max_restarts: int = 0
    failure: str = ""  # a failed JobSet: its failing pod, exit code, last error line and log
    queue: str = ""  # a queued JobSet: Kueue's word (admitted, pending and why, evicted by what)

    @property
    def deterministic_failure(self) -> bool:
        """Failed by the failure policy's FailJobSet rule: the trainer's exit 2 (bad config) or
        3 (diverged), which fails the same way however often it is recreated."""
        return self.state == "Failed" and self.reason.startswith(FAIL_JOBSET_REASON)

    @property
    def ready_pods(self) -> int:
        return sum(p.phase == "Running" and p.ready for p in self.pods)

    @property
    def all_ready(self) -> bool:
        return self.ready_pods == self.slices * self.pods_per_slice

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _condition(jobset: dict[str, Any]) -> tuple[str, str]:
    """(state, reason) from the JobSet's conditions, as its controller sets them."""
    for condition in (jobset.get("status") or {}).get("conditions") or []:
        if condition.get("status") == "True" and condition.get("type") in (
                "Completed", "Failed", "Suspended"):
            return condition["type"], str(condition.get("reason") or condition.get("message")
                                          or "")
    return "", ""


def snapshot(api: Any, namespace: str, name: str) -> JobSetSnapshot | None:
    """None when the JobSet does not exist."""
    from kubernetes import client

    try:
        jobset = client.CustomObjectsApi(api).get_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name)
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise
    replicated = (jobset.get("spec") or {}).get("replicatedJobs") or []
    if len(replicated) != 1:
        names = [str(r.get("name", "?"))[:40] for r in replicated[:5] if isinstance(r, dict)]
        raise ClusterError(
            f"JobSet {namespace}/{name} has {len(replicated)} replicated jobs {names}; the one "
            f"this toolkit renders has exactly one ({REPLICATED_JOB!r}): another tool's JobSet holds this "
            "stack's name, or the stack's namespace is shared. Rename one of them "
            "(multislice:gke.namespace, or the stack)")
    (rjob,) = replicated
    pods = client.CoreV1Api(api).list_namespaced_pod(
        namespace, label_selector=f"{JOBSET_NAME_LABEL}={name}").items
    rows = []
    for pod in pods:
        labels = pod.metadata.labels or {}
        if labels.get(JOBSET_NAME_LABEL) != name:
            continue  # the selector, again: an older server may ignore it
        statuses = (pod.status.container_statuses or []) if pod.status else []
        rows.append(PodRow(
            name=pod.metadata.name,
            slice=int(labels.get(SLICE_LABEL, -1)),
            index=int(labels.get(INDEX_LABEL, -1)),
            phase=(pod.status.phase if pod.status and pod.status.phase else "Unknown"),
            ready=bool(statuses) and all(s.ready for s in statuses),
            node=(pod.spec.node_name if pod.spec and pod.spec.node_name else ""),
            container_restarts=sum(s.restart_count or 0 for s in statuses),
            exit_code=next((s.state.terminated.exit_code for s in statuses
                            if s.state and s.state.terminated), None),
        ))
    rows.sort(key=lambda r: (r.slice, r.index, r.name))
    state, reason = _condition(jobset)
    if not state:
        state = "Running" if any(r.phase == "Running" for r in rows) else "Pending"
    status = jobset.get("status") or {}
    return JobSetSnapshot(
        name=name, namespace=namespace, state=state, reason=reason,
        restarts=int(status.get("restarts") or 0),
        slices=int(rjob["replicas"]),
        pods_per_slice=int(rjob["template"]["spec"]["parallelism"]),
        pods=rows,
        restarts_towards_max=int(status.get("restartsCountTowardsMax") or 0),
        max_restarts=int(((jobset.get("spec") or {}).get("failurePolicy") or {})
                         .get("maxRestarts") or 0),
    )


def host_of(pod_name: str) -> str:
    """The host name a pod's start-up script logs under: the pod's name without the suffix
    Kubernetes adds (JOBSET-RJOB-J-P-xxxxx -> JOBSET-RJOB-J-P)."""
    return pod_name.rsplit("-", 1)[0]


def failure_detail(snap: JobSetSnapshot, cfg: Any, client: Any = None) -> str:
    """For a failed JobSet: the first pod that failed, its exit code, the trainer's last error
    line from its log in the bucket, and where that log is. One line."""
    failed = [p for p in snap.pods if p.phase == "Failed" or p.exit_code not in (None, 0)]
    if not failed:
        return ("no failed pod is left to name (JobSet deletes them on a restart); the pods' "
                f"logs are under {cfg.names.run_dir}/logs/")
    pod = failed[0]
    uri = f"{cfg.names.run_dir}/logs/{host_of(pod.name)}.log"
    line = ""
    try:
        from google.cloud import storage

        client = client or storage.Client(project=cfg.project)
        blob = client.bucket(cfg.names.bucket).get_blob(uri.removeprefix(
            f"gs://{cfg.names.bucket}/"))
        if blob is not None:
            from scripts.logs import tail_text

            line = last_error_line(tail_text(blob))
    except Exception as exc:  # the bucket is a detail of the answer, not a reason to fail it
        line = f"(cannot read the log: {type(exc).__name__})"
    code = "no exit code" if pod.exit_code is None else f"exit {pod.exit_code}"
    return f"pod {pod.name} ({code}): {line or 'no error line in its log'}; log: {uri}"


def _queue_line(api: Any, namespace: str, name: str) -> str:
    """Kueue's word on the JobSet, or why it cannot be had (never an error of `status`)."""
    from kubernetes import client

    from scripts.gke.queue import workload_of

    try:
        row = workload_of(api, namespace, name)
    except client.ApiException as exc:
        return (f"cannot read Kueue's Workloads in {namespace} (HTTP {exc.status}): README's "
                "namespace Role lists the read of workloads.kueue.x-k8s.io")
    return row.summary() if row else "no Kueue Workload for it (not queued yet, or no Kueue)"


def _with_specs(snap: JobSetSnapshot, report: Any) -> None:
    """Each pod's launch spec, from what its startup script reported (its host name is the
    pod's name without the 5-character suffix Kubernetes adds)."""
    by_host = {h.host: h for h in report.hosts}
    for pod in snap.pods:
        host = by_host.get(pod.name.rsplit("-", 1)[0]) or by_host.get(pod.name)
        if host is not None:
            pod.spec_generation = host.generation + ("" if host.current else " (old)")
            pod.spec_state = host.state


_STYLE = {"Running": "green", "Completed": "green", "Failed": "red", "Pending": "yellow",
          "Suspended": "yellow"}


def renderable(namespace: str, name: str, snap: JobSetSnapshot | None) -> Any:
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table

    if snap is None:
        return Group(f"JobSet {namespace}/{name}: [red]{NOT_FOUND}[/red] (not created yet: "
                     "run pulumi up, or check multislice:gke.namespace)")
    style = _STYLE.get(snap.state)
    state = f"[{style}]{snap.state}[/{style}]" if style else snap.state
    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="bold")
    summary.add_column(overflow="fold")
    summary.add_row("JobSet", f"{snap.namespace}/{snap.name}")
    summary.add_row("state", state + (f"  ({snap.reason})" if snap.reason else ""))
    summary.add_row("restarts", f"{snap.restarts} (JobSet recreated every pod this often); "
                                f"{snap.restarts_towards_max} of max_restarts "
                                f"{snap.max_restarts} used (disruptions do not count)")
    if snap.failure:
        summary.add_row("failed", snap.failure)
    if snap.queue:
        summary.add_row("queue", escape(snap.queue))
    summary.add_row("pods", f"{snap.ready_pods} of {snap.slices} x {snap.pods_per_slice} "
                            "running and ready")
    table = Table()
    for column in ("slice", "pod", "phase", "ready", "node", "spec", "spec state"):
        table.add_column(column, overflow="fold")
    for pod in snap.pods:
        table.add_row(str(pod.slice), pod.name, pod.phase, "yes" if pod.ready else "no",
                      pod.node or "-", pod.spec_generation or "-", pod.spec_state or "-")
    return Group(summary, table)


def run_status(api: Any, cfg: Any, console: Any, as_json: bool = False,
               storage_client: Any = None) -> int:
    from infra.gke import manifest as gke_manifest
    from scripts.tpu.spec_report import read_spec_report, spec_renderable

    namespace, name = gke_manifest.namespace(cfg), cfg.names.jobset
    snap = snapshot(api, namespace, name)
    report = read_spec_report(cfg, storage_client)
    if snap is not None:
        _with_specs(snap, report)
        if snap.state == "Failed":
            snap.failure = failure_detail(snap, cfg, storage_client)
        if cfg.gke is not None and cfg.gke.queued:
            snap.queue = _queue_line(api, namespace, name)
    if as_json:
        payload = (snap.to_json() if snap else
                   {"name": name, "namespace": namespace, "state": NOT_FOUND})
        payload["launch_spec"] = report.to_json()
        from scripts.logs import logging_link

        payload["cloud_logging"] = logging_link(cfg)
        sys.stdout.write(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    else:
        from scripts.logs import logging_link

        console.print(renderable(namespace, name, snap))
        console.print(spec_renderable(report), soft_wrap=True)
        console.print(f"logs: multislice logs --stack-config FILE [--follow]; Cloud Logging: "
                      f"{logging_link(cfg)}", soft_wrap=True, markup=False)
    return EXIT_OK if snap is not None else EXIT_API


def _utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def run_watch(api: Any, cfg: Any, console: Any, interval_s: float = 10.0,
              timeout_s: float = 3600.0, clock: Callable[[], float] = time.monotonic,
              sleep: Callable[[float], None] = time.sleep) -> int:
    """Poll until every pod of every slice runs and is ready or the JobSet completed (0), the
    JobSet fails (3, with its failing pod's exit code, last error line and log) or the timeout
    (4; 0: none), printing a line at every change of state, restarts or ready pods."""
    from infra.gke import manifest as gke_manifest

    namespace, name = gke_manifest.namespace(cfg), cfg.names.jobset
    start, last = clock(), None
    while True:
        snap = snapshot(api, namespace, name)
        if snap is None:
            line = f"{NOT_FOUND} (not created yet, or another namespace)"
        else:
            line = (f"{snap.state}{f' ({snap.reason})' if snap.reason else ''}, "
                    f"{snap.ready_pods} of {snap.slices * snap.pods_per_slice} pods ready, "
                    f"restarts {snap.restarts}")
        if line != last:
            console.print(f"{_utc_now()} JobSet {namespace}/{name}: {line}", soft_wrap=True,
                          markup=False)
            last = line
        if snap is not None and snap.state == "Failed":
            console.print(f"{_utc_now()} JobSet {namespace}/{name}: "
                          f"{failure_detail(snap, cfg)}", soft_wrap=True, markup=False)
            return EXIT_BAD_STATE
        if snap is not None and snap.state == "Completed":
            return EXIT_OK  # the run finished: its pods are gone, nothing more will be ready
        if snap is not None and snap.state == "Running" and snap.all_ready:
            return EXIT_OK
        elapsed = clock() - start
        if timeout_s and elapsed >= timeout_s:
            console.print(f"{_utc_now()} JobSet {namespace}/{name}: still not every pod ready "
                          f"after {elapsed:.1f}s; giving up (--timeout {timeout_s:g})",
                          soft_wrap=True, markup=False)
            return EXIT_TIMEOUT
        sleep(min(interval_s, max(0.0, timeout_s - elapsed)) if timeout_s else interval_s)
