"""Kubernetes NetworkPolicy semantics (kubernetes.io, "Network Policies", networking.k8s.io/v1)
over a set of policies: whether a connection from one endpoint to another is allowed. A test
oracle, written from the published rules:

- a pod is isolated for ingress (egress) when a policy in its namespace selects it and lists
  Ingress (Egress) in policyTypes; a non-isolated direction allows everything;
- an isolated direction allows what any rule of any policy selecting the pod allows (rules add
  up, never subtract); a connection needs the source's egress and the destination's ingress;
- a peer is a podSelector (the policy's namespace), a namespaceSelector (with a podSelector: pods
  so labelled in those namespaces), or an ipBlock (cidr less except) for addresses off the
  cluster's pod network; a rule without `to`/`from` matches every peer, without `ports` every port.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Endpoint:
    """A pod (namespace and labels, its namespace's labels) or an address off the pod network."""

    ip: str
    namespace: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    namespace_labels: dict[str, str] = field(default_factory=dict)

    @property
    def is_pod(self) -> bool:
        return self.namespace is not None


def _selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        have, op, values = labels.get(e["key"]), e["operator"], e.get("values") or []
        if (op == "In" and have not in values) or (op == "NotIn" and have in values) or \
                (op == "Exists" and have is None) or (op == "DoesNotExist" and have is not None):
            return False
    return True


def _peer_matches(peer: dict[str, Any], policy_namespace: str, other: Endpoint) -> bool:
    if "ipBlock" in peer:
        if other.is_pod:
            return False
        address = ipaddress.ip_address(other.ip)
        block = peer["ipBlock"]
        return address in ipaddress.ip_network(block["cidr"]) and not any(
            address in ipaddress.ip_network(cidr) for cidr in block.get("except") or [])
    if not other.is_pod:
        return False
    if "namespaceSelector" in peer:
        if not _selects(peer["namespaceSelector"], other.namespace_labels):
            return False
    elif other.namespace != policy_namespace:
        return False
    return _selects(peer.get("podSelector"), other.labels)


def _port_matches(ports: list[dict[str, Any]] | None, protocol: str, port: int) -> bool:
    if not ports:
        return True
    return any(p.get("protocol", "TCP") == protocol and (
        "port" not in p or p["port"] == port or p.get("endPort", -1) >= port >= p["port"])
        for p in ports)


def _direction_allows(policies: list[dict[str, Any]], pod: Endpoint, other: Endpoint,
                      direction: str, protocol: str, port: int) -> bool:
    key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    selecting = [p for p in policies if p["metadata"]["namespace"] == pod.namespace
                 and _selects(p["spec"].get("podSelector"), pod.labels)
                 and direction in p["spec"].get("policyTypes", ["Ingress"])]
    if not selecting:
        return True
    return any((not rule.get(peers_key) or any(
        _peer_matches(peer, policy["metadata"]["namespace"], other)
        for peer in rule[peers_key])) and _port_matches(rule.get("ports"), protocol, port)
        for policy in selecting for rule in policy["spec"].get(key) or [])


def allowed(policies: list[dict[str, Any]], source: Endpoint, destination: Endpoint,
            protocol: str, port: int) -> bool:
    egress = not source.is_pod or _direction_allows(policies, source, destination, "Egress",
                                                    protocol, port)
    ingress = not destination.is_pod or _direction_allows(policies, destination, source,
                                                          "Ingress", protocol, port)
    return egress and ingress
