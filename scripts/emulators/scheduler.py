"""Which node of a GKE cluster a pod may be scheduled on: kube-scheduler's NodeSelector and
TaintToleration filters (Kubernetes' "Assigning Pods to Nodes" and "Taints and Tolerations"), over
the nodes of TPU node pools as GKE makes them.

Test and rehearsal support, never production. A node of a TPU pool carries the pool's
node_config.labels, GKE's own labels (cloud.google.com/gke-nodepool, gke-tpu-accelerator,
gke-tpu-topology) and taints: the pool's node_config.taints (the GKE API's NO_SCHEDULE is
Kubernetes' NoSchedule) and google.com/tpu=present:NoSchedule, which GKE puts on TPU nodes. A pod
fits a node when every key of its nodeSelector is a label of the node with that value, and every
NoSchedule or NoExecute taint of the node is tolerated: a toleration matches a taint when its key
is the taint's (an empty key with operator Exists matches every key), its operator is Exists or
Equal with the taint's value, and its effect is the taint's or empty.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from infra.gke.topology import (
    ACCELERATOR_LABEL,
    NODE_POOL_LABEL,
    TOPOLOGY_LABEL,
    TPU_RESOURCE,
)

GKE_TAINT_EFFECTS = {"NO_SCHEDULE": "NoSchedule", "NO_EXECUTE": "NoExecute",
                     "PREFER_NO_SCHEDULE": "PreferNoSchedule"}


@dataclass
class Node:
    name: str
    labels: dict[str, str]
    taints: list[dict[str, str]] = field(default_factory=list)
    pod: str | None = None  # a TPU node runs one pod that requests all its chips


def nodes_of_pool(pool: dict[str, Any], accelerator: str) -> list[Node]:
    """The nodes GKE makes for one TPU node pool (infra/gke/manifest.py node_pool's inputs)."""
    config = pool["node_config"]
    labels = {**config.get("labels", {}), NODE_POOL_LABEL: pool["name"],
              ACCELERATOR_LABEL: accelerator,
              TOPOLOGY_LABEL: pool["placement_policy"]["tpu_topology"]}
    taints = [{"key": t["key"], "value": t["value"], "effect": GKE_TAINT_EFFECTS[t["effect"]]}
              for t in config.get("taints", [])]
    taints.append({"key": TPU_RESOURCE, "value": "present", "effect": "NoSchedule"})
    count = pool.get("node_count") or pool["autoscaling"]["total_max_node_count"]
    return [Node(f"{pool['name']}-{i}", dict(labels), list(taints)) for i in range(count)]


def tolerates(tolerations: list[dict[str, Any]], taint: dict[str, str]) -> bool:
    for t in tolerations:
        operator = t.get("operator", "Equal")
        key_ok = t.get("key", "") == taint["key"] or (not t.get("key") and operator == "Exists")
        value_ok = operator == "Exists" or t.get("value", "") == taint.get("value", "")
        effect_ok = not t.get("effect") or t["effect"] == taint["effect"]
        if key_ok and value_ok and effect_ok:
            return True
    return False


def unfit(pod_spec: dict[str, Any], node: Node) -> str | None:
    """Why the pod cannot be scheduled on the node, as kube-scheduler words it, or None."""
    if node.pod is not None:
        return "Insufficient google.com/tpu"
    selector = pod_spec.get("nodeSelector") or {}
    if any(node.labels.get(k) != v for k, v in selector.items()):
        return "didn't match Pod's node affinity/selector"
    for taint in node.taints:
        if taint["effect"] in ("NoSchedule", "NoExecute") and \
                not tolerates(pod_spec.get("tolerations") or [], taint):
            return f"had untolerated taint {{{taint['key']}: {taint['value']}}}"
    return None


def schedule(pod: str, pod_spec: dict[str, Any], nodes: list[Node]) -> tuple[Node | None, str]:
    """Bind the pod to the first node it fits; otherwise None and the scheduler's event."""
    reasons: dict[str, int] = {}
    for node in nodes:
        why = unfit(pod_spec, node)
        if why is None:
            node.pod = pod
            return node, f"Successfully assigned {pod} to {node.name}"
        reasons[why] = reasons.get(why, 0) + 1
    detail = ", ".join(f"{n} node(s) {why}" for why, n in sorted(reasons.items()))
    return None, f"0/{len(nodes)} nodes are available: {detail}"
