"""Kueue's view of a stack's JobSets: `multislice status` says whether a workload is admitted,
pending (why, and its place in the queue) or evicted (and by what), and `multislice queue` lists
the workloads of a capacity's team namespaces, or a workload stack's own namespace.

Read through the Kubernetes API with the official client: Kueue's Workload objects
(kueue.x-k8s.io/v1beta1, served by every Kueue from v0.5 to the pinned v0.19, one per JobSet,
owned by it), their conditions as Kueue sets them (QuotaReserved, Admitted, Evicted, Preempted,
Finished, with Kueue's own reason and message), `status.admission` (ClusterQueue and flavors),
and the pending workloads' positions from Kueue's visibility API
(visibility.kueue.x-k8s.io/v1beta1 .../localqueues/LQ/pendingworkloads). What the reader may not
read (the visibility API needs its own RBAC) leaves that column empty; it is never an error.
The rights a researcher needs are README's namespace Role ("Who needs which roles").
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from infra.gke.topology import ACCELERATOR_LABEL, TOPOLOGY_LABEL, TPU_RESOURCE

KUEUE, VERSION, WORKLOADS = "kueue.x-k8s.io", "v1beta1", "workloads"
VISIBILITY = "/apis/visibility.kueue.x-k8s.io/v1beta1"
# Kueue's Preempted condition reasons (v0.19 pkg/workload/preemption), in words
PREEMPTED_BY = {
    "InClusterQueue": "a higher priority in its ClusterQueue",
    "InCohortReclamation": "its cohort reclaiming quota it had borrowed",
    "InCohortReclaimWhileBorrowing": "a borrowing workload of its cohort with a higher priority",
    "InCohortFairSharing": "its cohort's fair sharing",
}


@dataclass
class WorkloadRow:
    namespace: str
    name: str
    jobset: str  # the JobSet that owns it
    state: str  # admitted | pending | evicted | finished
    local_queue: str
    cluster_queue: str
    flavor: str
    shape: str  # accelerator and topology the pods select
    chips: int
    priority: int
    priority_class: str
    age_s: float
    position: str  # "3 in LocalQueue, 5 in ClusterQueue" while pending, when readable
    why: str  # Kueue's own message: why it waits, or what evicted it

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        """One line for `status`."""
        if self.state == "admitted":
            return f"admitted by ClusterQueue {self.cluster_queue} (flavor {self.flavor})"
        if self.state == "finished":
            return "finished (its quota is free)"
        place = f", {self.position}" if self.position else ""
        head = "evicted" if self.state == "evicted" else "pending"
        return (f"{head} in LocalQueue {self.namespace}/{self.local_queue}{place}: "
                f"{self.why or 'not yet considered by Kueue'}")


def _conditions(workload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c.get("type", ""): c for c in (workload.get("status") or {}).get("conditions") or []}


def _true(conditions: dict[str, dict[str, Any]], kind: str) -> bool:
    return conditions.get(kind, {}).get("status") == "True"


def _created(workload: dict[str, Any]) -> float:
    stamp = (workload.get("metadata") or {}).get("creationTimestamp")
    if not stamp:
        return time.time()
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def row_of(workload: dict[str, Any], now: float | None = None) -> WorkloadRow:
    meta, spec = workload.get("metadata") or {}, workload.get("spec") or {}
    status = workload.get("status") or {}
    conditions = _conditions(workload)
    owner = next((o.get("name", "") for o in meta.get("ownerReferences") or []
                  if o.get("kind") == "JobSet"), "")
    chips, shape = 0, ""
    for pod_set in spec.get("podSets") or []:
        pod = ((pod_set.get("template") or {}).get("spec")) or {}
        per_pod = sum(int(((c.get("resources") or {}).get("requests") or {}).get(
            TPU_RESOURCE, 0)) for c in pod.get("containers") or [])
        chips += int(pod_set.get("count", 1)) * per_pod
        selector = pod.get("nodeSelector") or {}
        shape = shape or " ".join(v for k, v in selector.items()
                                  if k in (ACCELERATOR_LABEL, TOPOLOGY_LABEL))
    admission = status.get("admission") or {}
    flavors = {f for a in admission.get("podSetAssignments") or []
               for f in (a.get("flavors") or {}).values()}
    if _true(conditions, "Finished"):
        state, why = "finished", conditions["Finished"].get("message", "")
    elif _true(conditions, "Admitted"):
        state, why = "admitted", ""
    elif _true(conditions, "Evicted"):
        state = "evicted"
        preempted = conditions.get("Preempted", {})
        by = PREEMPTED_BY.get(preempted.get("reason", "")) if _true(
            conditions, "Preempted") else None
        why = (f"preempted by {by}" if by else
               f"evicted ({conditions['Evicted'].get('reason', '')})") + \
            f": {conditions['Evicted'].get('message', '')}"
    else:
        state = "pending"
        why = (conditions.get("QuotaReserved") or conditions.get("Admitted") or {}).get(
            "message", "")
    return WorkloadRow(
        namespace=meta.get("namespace", ""), name=meta.get("name", ""), jobset=owner,
        state=state, local_queue=spec.get("queueName", ""),
        cluster_queue=admission.get("clusterQueue", ""), flavor=", ".join(sorted(flavors)),
        shape=shape, chips=chips, priority=int(spec.get("priority") or 0),
        priority_class=spec.get("priorityClassName", ""),
        age_s=max(0.0, (now or time.time()) - _created(workload)), position="",
        why=" ".join(str(why).split())[:300])


def _positions(api: Any, namespace: str, local_queue: str) -> dict[str, str]:
    """Workload name -> its place, from Kueue's visibility API; {} when it cannot be read."""
    from kubernetes import client

    try:
        request = api.param_serialize(
            "GET", f"{VISIBILITY}/namespaces/{{namespace}}/localqueues/{{name}}/pendingworkloads",
            path_params={"namespace": namespace, "name": local_queue},
            header_params={"Accept": "application/json"}, auth_settings=["BearerToken"])
        response = api.call_api(*request)
        response.read()
        if response.status != 200:
            return {}
        answer = json.loads(response.data or b"{}")
    except (client.ApiException, ValueError, OSError):
        return {}
    places = {}
    for item in (answer or {}).get("items") or []:
        name = (item.get("metadata") or {}).get("name", "")
        places[name] = (f"{item.get('positionInLocalQueue', 0) + 1} in LocalQueue, "
                        f"{item.get('positionInClusterQueue', 0) + 1} in ClusterQueue")
    return places


def read_workloads(api: Any, namespaces: list[str]) -> list[WorkloadRow]:
    from kubernetes import client

    rows = []
    objects = client.CustomObjectsApi(api)
    for namespace in namespaces:
        try:
            items = objects.list_namespaced_custom_object(KUEUE, VERSION, namespace,
                                                          WORKLOADS)["items"]
        except client.ApiException as exc:
            if exc.status == 404:
                continue  # no Kueue, or nothing queued there yet
            raise
        found = [row_of(item) for item in items]
        for queue in {r.local_queue for r in found if r.state in ("pending", "evicted")}:
            places = _positions(api, namespace, queue)
            for row in found:
                if row.local_queue == queue and row.name in places:
                    row.position = places[row.name]
        rows += found
    return sorted(rows, key=lambda r: (r.namespace, r.state != "admitted", -r.priority, r.name))


def workload_of(api: Any, namespace: str, jobset: str) -> WorkloadRow | None:
    """The Kueue Workload of one JobSet (None: no Kueue, or the JobSet is not queued)."""
    return next((r for r in read_workloads(api, [namespace]) if r.jobset == jobset), None)


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def run_queue(api: Any, cfg: Any, console: Any, as_json: bool = False) -> int:
    from infra.gke import manifest as gke_manifest

    assert cfg.gke is not None
    namespaces = (cfg.gke.team_names if cfg.gke.kind == "capacity"
                  else [gke_manifest.namespace(cfg)])
    rows = read_workloads(api, namespaces)
    if as_json:
        sys.stdout.write(json.dumps([r.to_json() for r in rows], indent=2) + "\n")
        return 0
    from rich.table import Table

    if not rows:
        console.print(f"no Kueue workload in {', '.join(namespaces)}", markup=False)
        return 0
    table = Table()
    for column in ("namespace", "JobSet", "state", "queue", "shape", "chips", "priority",
                   "age", "place", "why"):
        table.add_column(column, overflow="fold")
    for r in rows:
        table.add_row(r.namespace, r.jobset or r.name, r.state,
                      r.cluster_queue or r.local_queue, r.shape, str(r.chips),
                      f"{r.priority_class or '-'} ({r.priority})", _age(r.age_s),
                      r.position or "-", r.why or "-")
    console.print(table)
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "queue", help="list the Kueue workloads of a GKE stack's namespaces: state, shape, "
        "chips, priority, age, place in the queue and why each waits",
        description="A capacity stack's team namespaces, or a workload stack's own namespace: "
        "each Kueue Workload (one per JobSet) as admitted, pending (Kueue's reason and its place "
        "in the LocalQueue and ClusterQueue), evicted (by what) or finished. Exit 0, 1 (the "
        "Kubernetes API failed), 2 (bad arguments or stack).")
    from pathlib import Path

    parser.add_argument("--stack-config", type=Path, required=True, metavar="Pulumi.<stack>.yaml")
    parser.add_argument("--json", action="store_true", help="one JSON list instead of a table")
    parser.set_defaults(func=main)


def main(args: Any) -> int:
    from scripts.argtypes import UsageError
    from scripts.gke.cluster import ClusterError, ClusterSettingError, api_client
    from scripts.local.from_stack import load_stack

    try:
        cfg, _ = load_stack(args.stack_config, check_files=False)
    except UsageError as exc:
        print(f"multislice queue: {exc}", file=sys.stderr)
        return 2
    if cfg.orchestration != "gke" or cfg.gke is None:
        print(f"multislice queue: stack {cfg.stack!r} runs on TPU VMs (multislice:orchestration "
              "tpu-vm): queues are GKE's (Kueue); use `multislice status`", file=sys.stderr)
        return 2
    from rich.console import Console

    try:
        return run_queue(api_client(cfg), cfg, Console(), as_json=args.json)
    except ClusterSettingError as exc:
        print(f"multislice queue: {exc}", file=sys.stderr)
        return 2
    except ClusterError as exc:
        print(f"multislice queue: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # the API refused or failed: one line
        first = (str(exc).splitlines() or [""])[0][:300]
        print(f"multislice queue: the Kubernetes API failed: {type(exc).__name__}: {first}",
              file=sys.stderr)
        return 1
