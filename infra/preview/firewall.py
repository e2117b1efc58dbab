"""Whether Cloud NGFW lets a packet through, from a network's rules as the Compute API reads them.

Google's documented evaluation order ("Evaluation order for firewall policies and rules"):
hierarchical firewall policies (organization, then folders from the top), then, in the network's
`networkFirewallPolicyEnforcementOrder`, either VPC firewall rules, the global network firewall
policy and the regional one (AFTER_CLASSIC_FIREWALL, the default), or the two policies before
the VPC rules (BEFORE_CLASSIC_FIREWALL); then the implied rules (ingress denied, egress allowed).

- In a policy, rules are taken by priority (lowest number first); the first that matches decides:
  `allow` or `deny` ends the evaluation, `goto_next` passes it to the next stage, and
  `apply_security_profile_group` allows (after an inspection this check cannot judge).
- Among VPC firewall rules the matching rule of the highest priority decides, a deny winning over
  an allow of the same priority, and ends the evaluation.

A VPC ingress rule matches a source by its ranges, or by the source's network tags or service
account; one rule's targets are its tags or service accounts, or every instance. Policy rules
match sources by ranges (and secure tags, which the slices' hosts do not carry) and targets by
service accounts (or secure tags). What this check cannot know (address groups, FQDNs, regions,
threat lists) is taken as not matching a host of the slices.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

PROTOCOL_NUMBERS = {"6": "tcp", "17": "udp", "1": "icmp", "132": "sctp", "50": "esp", "51": "ah"}
ALL_PORTS = (0, 65535)


@dataclass(frozen=True)
class Host:
    """One side of a connection: an address, and for a VM of the network its tags and account."""

    ip: str
    tags: frozenset[str] = frozenset()
    service_account: str | None = None  # None: not an instance of the network (an API, say)


@dataclass(frozen=True)
class Rule:
    """A VPC firewall rule or a firewall policy rule, in one shape."""

    where: str  # for a message: "VPC firewall rule tpu-internal (priority 1000)"
    priority: int
    direction: str  # INGRESS | EGRESS
    action: str  # allow | deny | goto_next
    protocols: tuple[tuple[str, tuple[tuple[int, int], ...]], ...]  # (protocol, port ranges)
    src_ranges: tuple[str, ...] = ()
    src_tags: frozenset[str] = frozenset()
    src_accounts: frozenset[str] = frozenset()
    src_other: bool = False  # sources this check cannot evaluate (secure tags, groups, FQDNs)
    dst_ranges: tuple[str, ...] = ()
    target_tags: frozenset[str] = frozenset()
    target_accounts: frozenset[str] = frozenset()
    target_secure_tags: bool = False

    def applies_to(self, host: Host) -> bool:
        if self.target_secure_tags:
            return False  # the slices' hosts carry no secure tags
        if not (self.target_tags or self.target_accounts):
            return True
        return bool(self.target_tags & host.tags) or host.service_account in self.target_accounts

    def source_matches(self, src: Host) -> bool:
        if not (self.src_ranges or self.src_tags or self.src_accounts or self.src_other):
            return True
        if _in_ranges(src.ip, self.src_ranges):
            return True
        if src.service_account is None:
            return False
        return bool(self.src_tags & src.tags) or src.service_account in self.src_accounts

    def carries(self, protocol: str, port: int | None) -> bool:
        for proto, ranges in self.protocols:
            if proto not in ("all", protocol):
                continue
            if not ranges or port is None or any(lo <= port <= hi for lo, hi in ranges):
                return True
        return False

    def matches(self, src: Host, dst: Host, protocol: str, port: int | None) -> bool:
        if not self.carries(protocol, port):
            return False
        if self.direction == "INGRESS":
            return self.applies_to(dst) and self.source_matches(src)
        return self.applies_to(src) and (not self.dst_ranges or _in_ranges(dst.ip, self.dst_ranges))


@dataclass(frozen=True)
class Stage:
    """One step of the evaluation: a policy's rules, or the network's VPC firewall rules."""

    name: str
    rules: tuple[Rule, ...]
    vpc: bool = False


@dataclass
class Verdict:
    allowed: bool
    by: str


@dataclass
class Estate:
    """A network's firewall, as evaluated for one region."""

    stages: list[Stage] = field(default_factory=list)

    def decide(self, direction: str, src: Host, dst: Host, protocol: str,
               port: int | None) -> Verdict:
        for stage in self.stages:
            rules = [r for r in stage.rules
                     if r.direction == direction and r.matches(src, dst, protocol, port)]
            if not rules:
                continue
            if stage.vpc:
                best = min(r.priority for r in rules)
                top = [r for r in rules if r.priority == best]
                rule = next((r for r in top if r.action == "deny"), top[0])
                return Verdict(rule.action == "allow", rule.where)
            rule = min(rules, key=lambda r: r.priority)
            if rule.action == "goto_next":
                continue
            return Verdict(rule.action != "deny", rule.where)
        if direction == "INGRESS":
            return Verdict(False, "the implied rule that denies all ingress")
        return Verdict(True, "the implied rule that allows all egress")

    def first_refusal(self, direction: str, src: Host, dst: Host,
                      protocols: Sequence[str] = ("tcp", "udp", "icmp")) -> str | None:
        """None when every port of every protocol passes; else what refuses which, in words."""
        for protocol in protocols:
            for port in self._probe_ports(protocol):
                verdict = self.decide(direction, src, dst, protocol, port)
                if not verdict.allowed:
                    where = protocol if port is None else f"{protocol} port {port}"
                    return f"{where} is denied by {verdict.by}"
        return None

    def first_allowance(self, direction: str, src: Host, dst: Host,
                        protocols: Sequence[str] = ("tcp", "udp")) -> str | None:
        """None when no port of these protocols passes; else what lets which through, in
        words."""
        for protocol in protocols:
            for port in self._probe_ports(protocol):
                verdict = self.decide(direction, src, dst, protocol, port)
                if verdict.allowed:
                    where = protocol if port is None else f"{protocol} port {port}"
                    return f"{where} is allowed by {verdict.by}"
        return None

    def _probe_ports(self, protocol: str) -> list[int | None]:
        """One port of every stretch over which no rule's port ranges change (0 and each range's
        ends), so a few evaluations cover all 65,536 ports."""
        if protocol == "icmp":
            return [None]
        points = {ALL_PORTS[0]}
        for stage in self.stages:
            for rule in stage.rules:
                for proto, ranges in rule.protocols:
                    if proto in ("all", protocol):
                        for lo, hi in ranges:
                            points.add(lo)
                            if hi < ALL_PORTS[1]:
                                points.add(hi + 1)
        return sorted(points)


def _in_ranges(ip: str, ranges: Iterable[str]) -> bool:
    address = ipaddress.ip_address(ip)
    for text in ranges:
        try:
            if address in ipaddress.ip_network(text, strict=False):
                return True
        except ValueError:
            continue
    return False


def _port_ranges(ports: Iterable[str]) -> tuple[tuple[int, int], ...]:
    ranges = []
    for text in ports:
        lo, _, hi = str(text).partition("-")
        ranges.append((int(lo), int(hi or lo)))
    return tuple(ranges)


def _protocol(name: Any) -> str:
    text = str(name).lower()
    return PROTOCOL_NUMBERS.get(text, text)


def vpc_rule(rule: dict[str, Any]) -> Rule | None:
    """A VPC firewall rule (compute#firewall), or None when it is disabled."""
    if rule.get("disabled"):
        return None
    action, entries = ("allow", rule.get("allowed")) if rule.get("allowed") else (
        "deny", rule.get("denied") or [])
    direction = rule.get("direction", "INGRESS")
    return Rule(
        where=f"VPC firewall rule {rule.get('name', '?')} (priority {rule.get('priority', 1000)})",
        priority=int(rule.get("priority", 1000)), direction=direction, action=action,
        protocols=tuple((_protocol(e.get("IPProtocol")), _port_ranges(e.get("ports") or []))
                        for e in entries),
        src_ranges=tuple(rule.get("sourceRanges") or ()),
        src_tags=frozenset(rule.get("sourceTags") or ()),
        src_accounts=frozenset(rule.get("sourceServiceAccounts") or ()),
        dst_ranges=tuple(rule.get("destinationRanges") or ()),
        target_tags=frozenset(rule.get("targetTags") or ()),
        target_accounts=frozenset(rule.get("targetServiceAccounts") or ()))


def policy_rule(policy: str, rule: dict[str, Any], network_url: str) -> Rule | None:
    """A firewall policy rule (compute#firewallPolicyRule), or None when it is disabled or aimed at
    other networks."""
    targets = rule.get("targetResources") or []
    if rule.get("disabled") or (targets and not any(
            _same_network(t, network_url) for t in targets)):
        return None
    match = rule.get("match") or {}
    action = str(rule.get("action", "deny")).lower()
    if action == "apply_security_profile_group":
        action = "allow"
    other_sources = any(match.get(k) for k in (
        "srcSecureTags", "srcAddressGroups", "srcFqdns", "srcRegionCodes",
        "srcThreatIntelligences", "srcNetworks", "srcNetworkScope"))
    return Rule(
        where=f"rule {rule.get('priority', '?')} of {policy}",
        priority=int(rule.get("priority", 0)), direction=rule.get("direction", "INGRESS"),
        action=action,
        protocols=tuple((_protocol(c.get("ipProtocol")), _port_ranges(c.get("ports") or []))
                        for c in match.get("layer4Configs") or [{"ipProtocol": "all"}]),
        src_ranges=tuple(match.get("srcIpRanges") or ()), src_other=other_sources,
        dst_ranges=tuple(match.get("destIpRanges") or ()),
        target_accounts=frozenset(rule.get("targetServiceAccounts") or ()),
        target_secure_tags=bool(rule.get("targetSecureTags")))


def _same_network(url: str, network_url: str) -> bool:
    def tail(u: str) -> str:
        return u.split("/projects/", 1)[-1].removeprefix("projects/")
    return tail(url) == tail(network_url)


POLICY_KINDS = {"HIERARCHY": "hierarchical firewall policy",
                "NETWORK": "global network firewall policy",
                "NETWORK_REGIONAL": "regional network firewall policy",
                "SYSTEM_REGIONAL": "regional system firewall policy",
                "SYSTEM_GLOBAL": "global system firewall policy"}


def estate(network: dict[str, Any], vpc_rules: Sequence[dict[str, Any]],
           policies: Sequence[dict[str, Any]]) -> Estate:
    """The evaluation stages of `network`, from its VPC firewall rules and the effective firewall
    policies (networks.getEffectiveFirewalls' and regionNetworkFirewallPolicies'
    `firewallPolicys`, in the order the API returns them)."""
    network_url = network.get("selfLink", "")

    def stage_of(policy: dict[str, Any]) -> Stage:
        kind = POLICY_KINDS.get(policy.get("type", ""), "firewall policy")
        name = f"{kind} {policy.get('displayName') or policy.get('shortName') or policy.get('name', '?')}"
        rules = (policy_rule(name, r, network_url) for r in policy.get("rules") or [])
        return Stage(name, tuple(r for r in rules if r is not None))

    by_type: dict[str, list[Stage]] = {}
    for policy in policies:
        by_type.setdefault(policy.get("type", ""), []).append(stage_of(policy))
    vpc = Stage("VPC firewall rules", tuple(r for r in map(vpc_rule, vpc_rules) if r is not None),
                vpc=True)
    network_policies = by_type.get("NETWORK", []) + by_type.get("NETWORK_REGIONAL", [])
    ordered = network_policies + [vpc] if network.get(
        "networkFirewallPolicyEnforcementOrder") == "BEFORE_CLASSIC_FIREWALL" else [
        vpc, *network_policies]
    return Estate([*by_type.get("HIERARCHY", []), *by_type.get("SYSTEM_REGIONAL", []),
                   *by_type.get("SYSTEM_GLOBAL", []), *ordered])
