"""Kueue admitting JobSets to a ClusterQueue's quota: what a platform team's capacity stack
applies (infra/gke/manifest.py capacity_objects), acting on emulated JobSets.

Test and rehearsal support, never production. Semantics from Kueue's docs at the pinned version
(v0.19: "Run a JobSet", "Cluster Queue", "Local Queue", "Workload Priority", "Resource Flavor"):

- A JobSet labelled `kueue.x-k8s.io/queue-name` is created suspended (Kueue's webhook) and
  becomes a Workload of its LocalQueue in the JobSet's namespace; no pod runs until it is
  admitted. A queue name no LocalQueue of that namespace has leaves it suspended, inadmissible.
- The LocalQueue's ClusterQueue admits a Workload when its namespace matches the ClusterQueue's
  `namespaceSelector` and its requests fit the flavor's `nominalQuota` less what admitted
  Workloads use: all or nothing, every pod's `google.com/tpu` request counted (replicas x
  parallelism x the container's request).
- Order: higher WorkloadPriorityClass value first, then creation order. `BestEffortFIFO` lets
  a later Workload that fits pass one that does not; `StrictFIFO` does not.
- A flavor's `nodeTaints` must be tolerated by the pod set, unless the flavor's own
  `tolerations` cover them ("Resource Flavor").
- Admission injects the flavor's `nodeLabels` into the pods' node selector and its
  `tolerations` into their tolerations, and unsuspends the JobSet (its controller then creates
  the pods); the quota is released when the JobSet finishes (Completed or Failed).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from infra.gke.manifest import PRIORITY_CLASS_LABEL, QUEUE_NAME_LABEL
from infra.gke.topology import TPU_RESOURCE
from scripts.emulators.scheduler import tolerates


@dataclass
class _ClusterQueue:
    name: str
    namespaces: set[str]
    quota: int
    node_labels: dict[str, str]
    strict: bool
    node_taints: list[dict[str, str]] = field(default_factory=list)
    tolerations: list[dict[str, str]] = field(default_factory=list)
    used: int = 0


@dataclass
class _Workload:
    jobset: Any  # scripts.emulators.jobset_emulator.EmulatedJobSet
    chips: int
    priority: int
    order: int
    queue: _ClusterQueue | None
    why_pending: str = ""


@dataclass
class EmulatedKueue:
    cluster_queues: dict[str, _ClusterQueue] = field(default_factory=dict)
    local_queues: dict[tuple[str, str], str] = field(default_factory=dict)
    priorities: dict[str, int] = field(default_factory=dict)
    pending: list[_Workload] = field(default_factory=list)
    admitted: list[_Workload] = field(default_factory=list)
    history: list[str] = field(default_factory=list)
    _order: Any = field(default_factory=itertools.count)

    @classmethod
    def from_objects(cls, objects: list[dict[str, Any]]) -> EmulatedKueue:
        """From the ResourceFlavor, ClusterQueue, LocalQueue and WorkloadPriorityClass objects
        an admin applied."""
        kueue = cls()
        flavors = {o["metadata"]["name"]: o["spec"]
                   for o in objects if o["kind"] == "ResourceFlavor"}
        for obj in objects:
            meta = obj["metadata"]
            if obj["kind"] == "ClusterQueue":
                spec = obj["spec"]
                (group,) = spec["resourceGroups"]
                (flavor,) = group["flavors"]
                quota = sum(r["nominalQuota"] for r in flavor["resources"]
                            if r["name"] == TPU_RESOURCE)
                selector = spec.get("namespaceSelector") or {}
                namespaces = {v for e in selector.get("matchExpressions", [])
                              if e["key"] == "kubernetes.io/metadata.name"
                              and e["operator"] == "In" for v in e["values"]}
                namespaces |= {v for k, v in (selector.get("matchLabels") or {}).items()
                               if k == "kubernetes.io/metadata.name"}
                found = flavors[flavor["name"]]
                kueue.cluster_queues[meta["name"]] = _ClusterQueue(
                    meta["name"], namespaces, quota, found.get("nodeLabels", {}),
                    spec.get("queueingStrategy") == "StrictFIFO",
                    found.get("nodeTaints", []), found.get("tolerations", []))
            elif obj["kind"] == "LocalQueue":
                kueue.local_queues[(meta["namespace"], meta["name"])] = \
                    obj["spec"]["clusterQueue"]
            elif obj["kind"] == "WorkloadPriorityClass":
                kueue.priorities[meta["name"]] = int(obj["value"])
        return kueue

    def submit(self, jobset: Any) -> None:
        """The JobSet is created: suspended until admitted."""
        labels = jobset.jobset["metadata"].get("labels") or {}
        queue_name = labels.get(QUEUE_NAME_LABEL)
        if queue_name is None:
            raise ValueError(f"JobSet {jobset.namespace}/{jobset.name} names no queue: Kueue "
                             "leaves it alone")
        cq_name = self.local_queues.get((jobset.namespace, queue_name))
        pod = jobset.pod_spec["containers"][0]["resources"]["requests"]
        chips = jobset.slices * jobset.nodes * int(pod.get(TPU_RESOURCE, 0))
        workload = _Workload(jobset, chips, self.priorities.get(
            labels.get(PRIORITY_CLASS_LABEL, ""), 0), next(self._order),
            self.cluster_queues.get(cq_name) if cq_name else None)
        jobset.state = "Suspended"
        self.pending.append(workload)
        self._log(f"JobSet {jobset.namespace}/{jobset.name} created suspended: a Workload of "
                  f"LocalQueue {jobset.namespace}/{queue_name} asking {chips} chips")

    def reconcile(self) -> None:
        """One pass: release what finished, then admit what fits, in order."""
        for workload in list(self.admitted):
            if workload.jobset.state in ("Completed", "Failed"):
                assert workload.queue is not None
                workload.queue.used -= workload.chips
                self.admitted.remove(workload)
                self._log(f"Workload {workload.jobset.name} finished ({workload.jobset.state}): "
                          f"{workload.chips} chips of ClusterQueue {workload.queue.name} free")
        blocked: set[str] = set()
        for workload in sorted(self.pending, key=lambda w: (-w.priority, w.order)):
            why = self._inadmissible(workload, blocked)
            if why:
                if why != workload.why_pending:
                    workload.why_pending = why
                    self._log(f"Workload {workload.jobset.name} pending: {why}")
                continue
            queue = workload.queue
            assert queue is not None
            queue.used += workload.chips
            self.pending.remove(workload)
            self.admitted.append(workload)
            workload.jobset.pod_spec.setdefault("nodeSelector", {}).update(queue.node_labels)
            workload.jobset.pod_spec["tolerations"] = [
                *workload.jobset.pod_spec.get("tolerations", []), *queue.tolerations]
            self._log(f"Workload {workload.jobset.name} admitted by ClusterQueue {queue.name} "
                      f"({queue.used} of {queue.quota} chips in use): JobSet unsuspended")
            workload.jobset.start()

    def _inadmissible(self, workload: _Workload, blocked: set[str]) -> str:
        queue = workload.queue
        if queue is None:
            return "its LocalQueue does not exist (inadmissible)"
        if workload.jobset.namespace not in queue.namespaces:
            return (f"namespace {workload.jobset.namespace} is not in ClusterQueue "
                    f"{queue.name}'s namespaceSelector (inadmissible)")
        untolerated = [taint for taint in queue.node_taints if not tolerates(
            [*workload.jobset.pod_spec.get("tolerations", []), *queue.tolerations], taint)]
        if untolerated:
            return (f"untolerated taint {untolerated[0]['key']} of ClusterQueue {queue.name}'s "
                    "flavor (inadmissible)")
        if queue.name in blocked:
            return f"StrictFIFO: an older Workload of ClusterQueue {queue.name} waits first"
        if queue.used + workload.chips > queue.quota:
            if queue.strict:
                blocked.add(queue.name)
            return (f"{workload.chips} chips do not fit ClusterQueue {queue.name}'s quota "
                    f"({queue.used} of {queue.quota} in use)")
        return ""

    def _log(self, line: str) -> None:
        self.history.append(f"{time.strftime('%X')} kueue: {line}")
