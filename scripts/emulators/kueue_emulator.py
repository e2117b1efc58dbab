"""Kueue admitting JobSets to ClusterQueues' quotas: what a capacity stack applies (infra/gke/
manifest.py capacity_objects), acting on emulated JobSets.

Test and rehearsal support, never production. Semantics from Kueue's docs at the pinned version
(v0.19: "Run a JobSet", "Cluster Queue", "Cohort", "Local Queue", "Workload Priority",
"Resource Flavor", "Preemption"):

- A JobSet labelled `kueue.x-k8s.io/queue-name` is created suspended (Kueue's webhook) and
  becomes a Workload of its LocalQueue in the JobSet's namespace; no pod runs until it is
  admitted. A queue name no LocalQueue of that namespace has leaves it suspended, inadmissible.
- The LocalQueue's ClusterQueue admits a Workload when its namespace matches the ClusterQueue's
  `namespaceSelector`, a flavor of the queue suits its pods (the flavor's `nodeLabels` agree
  with their node selector; its `nodeTaints` are tolerated by the pods or by the flavor's own
  `tolerations`) and the requests fit: all or nothing, every pod's `google.com/tpu` request
  counted (replicas x parallelism x the container's request). Within the flavor's
  `nominalQuota` it fits by itself; beyond it, a ClusterQueue of a cohort (`cohortName`)
  borrows what the cohort's other queues leave unused, each lending at most its
  `lendingLimit` (unset: all its quota), and borrows at most its own `borrowingLimit` (unset:
  no bound); a queue without a cohort borrows nothing.
- Preemption, when a Workload does not fit: `reclaimWithinCohort: Any` evicts Workloads of
  other queues that borrow (newest first) when the Workload fits its own nominal quota;
  `withinClusterQueue: LowerPriority` evicts the queue's own Workloads of a lower priority
  (lowest, then newest, first). An evicted Workload's JobSet is suspended again (its pods are
  deleted: a disruption) and it waits in the queue as before.
- Order: higher WorkloadPriorityClass value first, then creation order. `BestEffortFIFO` lets
  a later Workload that fits pass one that does not; `StrictFIFO` does not.
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
class _Flavor:
    name: str
    node_labels: dict[str, str]
    node_taints: list[dict[str, str]]
    tolerations: list[dict[str, str]]
    nominal: int
    borrowing_limit: int | None
    lending_limit: int | None
    used: int = 0

    @property
    def borrowed(self) -> int:
        return max(0, self.used - self.nominal)

    @property
    def lendable(self) -> int:
        """What of its quota others may use now: its lending limit, less what it uses of it."""
        limit = self.nominal if self.lending_limit is None else self.lending_limit
        kept = self.nominal - limit  # used first
        return max(0, limit - max(0, min(self.used, self.nominal) - kept))


@dataclass
class _ClusterQueue:
    name: str
    namespaces: set[str]
    flavors: list[_Flavor]
    strict: bool
    cohort: str | None = None
    reclaim: bool = False
    preempt_lower: bool = False

    @property
    def quota(self) -> int:
        return sum(f.nominal for f in self.flavors)

    @property
    def used(self) -> int:
        return sum(f.used for f in self.flavors)


@dataclass
class _Workload:
    jobset: Any  # scripts.emulators.jobset_emulator.EmulatedJobSet, or one that records starts
    chips: int
    priority: int
    order: int
    queue: _ClusterQueue | None
    why_pending: str = ""
    flavor: _Flavor | None = None
    evictions: int = 0


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
                queue_flavors = []
                for flavor in group["flavors"]:
                    (tpu,) = [r for r in flavor["resources"] if r["name"] == TPU_RESOURCE]
                    found = flavors[flavor["name"]]
                    queue_flavors.append(_Flavor(
                        flavor["name"], found.get("nodeLabels", {}), found.get("nodeTaints", []),
                        found.get("tolerations", []), int(tpu["nominalQuota"]),
                        tpu.get("borrowingLimit"), tpu.get("lendingLimit")))
                selector = spec.get("namespaceSelector") or {}
                namespaces = {v for e in selector.get("matchExpressions", [])
                              if e["key"] == "kubernetes.io/metadata.name"
                              and e["operator"] == "In" for v in e["values"]}
                namespaces |= {v for k, v in (selector.get("matchLabels") or {}).items()
                               if k == "kubernetes.io/metadata.name"}
                preemption = spec.get("preemption") or {}
                kueue.cluster_queues[meta["name"]] = _ClusterQueue(
                    meta["name"], namespaces, queue_flavors,
                    spec.get("queueingStrategy") == "StrictFIFO", spec.get("cohortName"),
                    preemption.get("reclaimWithinCohort", "Never") != "Never",
                    preemption.get("withinClusterQueue", "Never") != "Never")
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

    def workload_of(self, jobset: Any) -> _Workload:
        return next(w for w in [*self.pending, *self.admitted] if w.jobset is jobset)

    def status(self, jobset: Any) -> str:
        """Admitted, or pending with the reason, as `kubectl get workloads` would say it."""
        workload = self.workload_of(jobset)
        if workload in self.admitted:
            assert workload.queue is not None and workload.flavor is not None
            return (f"admitted by ClusterQueue {workload.queue.name} (flavor "
                    f"{workload.flavor.name})")
        return f"pending: {workload.why_pending or 'not yet considered'}"

    def reconcile(self) -> None:
        """One pass: release what finished, then admit what fits, in order, preempting where
        the queue's policy lets a pending Workload."""
        for workload in list(self.admitted):
            if workload.jobset.state in ("Completed", "Failed"):
                self._release(workload)
                self._log(f"Workload {workload.jobset.name} finished ({workload.jobset.state}): "
                          f"{workload.chips} chips of ClusterQueue {workload.queue.name} free")
        blocked: set[str] = set()
        for workload in sorted(self.pending, key=lambda w: (-w.priority, w.order)):
            why = self._inadmissible(workload, blocked)
            if why and workload.queue is not None and not why.endswith("(inadmissible)") \
                    and self._preempt_for(workload):
                blocked.discard(workload.queue.name)
                why = self._inadmissible(workload, blocked)
            if why:
                if why != workload.why_pending:
                    workload.why_pending = why
                    self._log(f"Workload {workload.jobset.name} pending: {why}")
                continue
            self._admit(workload)

    # ---- quota ----

    def _cohort(self, queue: _ClusterQueue) -> list[_ClusterQueue]:
        if queue.cohort is None:
            return [queue]
        return [q for q in self.cluster_queues.values() if q.cohort == queue.cohort]

    def _suits(self, workload: _Workload, flavor: _Flavor) -> bool:
        selector = workload.jobset.pod_spec.get("nodeSelector") or {}
        if any(k in selector and selector[k] != v for k, v in flavor.node_labels.items()):
            return False
        pod_tolerations = [*workload.jobset.pod_spec.get("tolerations", []), *flavor.tolerations]
        return all(tolerates(pod_tolerations, taint) for taint in flavor.node_taints)

    def _fits(self, queue: _ClusterQueue, flavor: _Flavor, chips: int) -> bool:
        used = flavor.used + chips
        if used <= flavor.nominal:
            # within its own quota, if the chips are free: borrowers may hold what it lent
            # (reclaimWithinCohort takes them back)
            cohort = [f for q in self._cohort(queue) if (f := self._same(q, flavor)) is not None]
            return sum(f.used for f in cohort) + chips <= sum(f.nominal for f in cohort)
        if queue.cohort is None:
            return False
        borrow = used - flavor.nominal
        if flavor.borrowing_limit is not None and borrow > flavor.borrowing_limit:
            return False
        others = [f for q in self._cohort(queue) if q is not queue
                  if (f := self._same(q, flavor)) is not None]
        return borrow + sum(f.borrowed for f in others) <= sum(f.lendable for f in others)

    @staticmethod
    def _same(queue: _ClusterQueue, flavor: _Flavor) -> _Flavor | None:
        return next((f for f in queue.flavors if f.name == flavor.name), None)

    def _inadmissible(self, workload: _Workload, blocked: set[str]) -> str:
        queue = workload.queue
        if queue is None:
            return "its LocalQueue does not exist (inadmissible)"
        if workload.jobset.namespace not in queue.namespaces:
            return (f"namespace {workload.jobset.namespace} is not in ClusterQueue "
                    f"{queue.name}'s namespaceSelector (inadmissible)")
        suited = [f for f in queue.flavors if self._suits(workload, f)]
        if not suited:
            untolerated = [t["key"] for f in queue.flavors for t in f.node_taints
                           if not tolerates([*workload.jobset.pod_spec.get("tolerations", []),
                                             *f.tolerations], t)]
            if untolerated:
                return (f"untolerated taint {untolerated[0]} of ClusterQueue {queue.name}'s "
                        "flavor (inadmissible)")
            return (f"no flavor of ClusterQueue {queue.name} has the pods' node labels "
                    "(inadmissible)")
        if queue.name in blocked:
            return f"StrictFIFO: an older Workload of ClusterQueue {queue.name} waits first"
        for flavor in suited:
            if self._fits(queue, flavor, workload.chips):
                workload.flavor = flavor
                return ""
        if queue.strict:
            blocked.add(queue.name)
        flavor = suited[0]
        if queue.cohort is None:
            return (f"{workload.chips} chips do not fit ClusterQueue {queue.name}'s quota "
                    f"({queue.used} of {queue.quota} in use)")
        lendable = sum(f.lendable - f.borrowed for q in self._cohort(queue) if q is not queue
                       if (f := self._same(q, flavor)) is not None)
        return (f"{workload.chips} chips of flavor {flavor.name} do not fit ClusterQueue "
                f"{queue.name}'s quota ({flavor.used} of {flavor.nominal} in use) and what "
                f"cohort {queue.cohort} lends now ({max(0, lendable)} chips"
                + (f", borrowing limit {flavor.borrowing_limit}"
                   if flavor.borrowing_limit is not None else "") + ")")

    # ---- preemption ----

    def _preempt_for(self, workload: _Workload) -> bool:
        """Evict what the queue's policy lets `workload` take back; whether any was evicted."""
        queue = workload.queue
        assert queue is not None
        flavor = next((f for f in queue.flavors if self._suits(workload, f)), None)
        if flavor is None:
            return False
        victims: list[_Workload] = []
        if queue.reclaim and flavor.used + workload.chips <= flavor.nominal:
            victims = sorted((w for w in self.admitted if w.queue is not queue
                              and w.queue is not None and w.queue.cohort == queue.cohort
                              and w.flavor is not None and w.flavor.name == flavor.name
                              and w.flavor.borrowed > 0), key=lambda w: -w.order)
            why = f"reclaimed by ClusterQueue {queue.name} within cohort {queue.cohort}"
        elif queue.preempt_lower:
            victims = sorted((w for w in self.admitted if w.queue is queue
                              and w.priority < workload.priority),
                             key=lambda w: (w.priority, -w.order))
            why = f"preempted in ClusterQueue {queue.name} by a higher priority"
        evicted = False
        for victim in victims:
            if self._fits(queue, flavor, workload.chips):
                break
            self._evict(victim, f"{why} ({workload.jobset.namespace}/{workload.jobset.name})")
            evicted = True
        return evicted

    def _evict(self, workload: _Workload, why: str) -> None:
        self._release(workload)
        workload.evictions += 1
        workload.why_pending = f"evicted: {why}"
        self.pending.append(workload)
        self._log(f"Workload {workload.jobset.name} evicted: {why}; its JobSet is suspended "
                  "(pods deleted) until admitted again")
        suspend = getattr(workload.jobset, "suspend", None)
        if suspend is not None:
            suspend()
        workload.jobset.state = "Suspended"

    # ---- bookkeeping ----

    def _admit(self, workload: _Workload) -> None:
        queue, flavor = workload.queue, workload.flavor
        assert queue is not None and flavor is not None
        flavor.used += workload.chips
        self.pending.remove(workload)
        self.admitted.append(workload)
        workload.why_pending = ""
        spec = workload.jobset.pod_spec
        spec.setdefault("nodeSelector", {}).update(flavor.node_labels)
        spec["tolerations"] = [*spec.get("tolerations", []),
                               *(t for t in flavor.tolerations
                                 if t not in spec.get("tolerations", []))]
        borrowed = f", borrowing {flavor.borrowed} from cohort {queue.cohort}" \
            if flavor.borrowed else ""
        self._log(f"Workload {workload.jobset.name} admitted by ClusterQueue {queue.name} "
                  f"({queue.used} of {queue.quota} chips in use{borrowed}): JobSet unsuspended")
        workload.jobset.start()

    def _release(self, workload: _Workload) -> None:
        assert workload.flavor is not None
        workload.flavor.used -= workload.chips
        self.admitted.remove(workload)

    def _log(self, line: str) -> None:
        self.history.append(f"{time.strftime('%X')} kueue: {line}")
