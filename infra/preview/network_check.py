"""A shared network (`multislice:network`), checked at preview against what the slices need.

A platform team's VPC (in the stack's project or a Shared VPC host project) is used as it is:
the stack creates nothing in it and never modifies or deletes it. What the seed's guidance needs
of it is checked before anything is created, one line per problem:

- MTU 8896 (the overview: DCN traffic between slices wants jumbo frames);
- the subnet, in the stack's region and of that network, with Private Google Access on (the
  hosts have no external IPs; the bucket is reached through it);
- an ingress rule that lets the slices' hosts reach each other on every port (tcp, udp and
  icmp, or all): from a network tag the hosts carry (the stack's own, or one of
  `multislice:tags`) or from the subnet's range, to the hosts (all instances, or their tag);
- with `egress: nat`, a Cloud NAT on a router of that network in the region that covers the
  subnet; with `egress: none` no NAT is needed (the environment is published before the boot).

`NetworkCheck` is a dynamic resource whose provider's `check` runs on every preview and up
(infra/preview/check_only.py). It reads the Compute Engine API (v1) with the deployer's credentials,
or `MULTISLICE_COMPUTE_API_ENDPOINT` when set (the tests' stand-in), as the TPU API's override.
"""

from __future__ import annotations

import ipaddress
import json
import os
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pulumi
import pulumi.dynamic
from pulumi.dynamic import CheckFailure, CheckResult

from infra.preview.check_only import CheckOnlyProvider

COMPUTE_ENDPOINT_ENV = "MULTISLICE_COMPUTE_API_ENDPOINT"
COMPUTE_API = "https://compute.googleapis.com/compute/v1"
NEEDED_MTU = 8896
SCOPES = ("https://www.googleapis.com/auth/cloud-platform",)
_ALL_PORTS = ("tcp", "udp", "icmp")


def _covers_every_port(allowed: list[dict[str, Any]]) -> bool:
    protocols = {a.get("IPProtocol") for a in allowed if not a.get("ports")}
    return "all" in protocols or set(_ALL_PORTS) <= protocols


def internal_rule(firewalls: list[dict[str, Any]], network: str, tags: list[str],
                  subnet_range: str) -> dict[str, Any] | None:
    """The first enabled ingress rule of `network` that lets hosts carrying `tags` (in
    `subnet_range`) reach each other on every port, or None."""
    subnet = ipaddress.ip_network(subnet_range, strict=False) if subnet_range else None
    for rule in firewalls:
        if rule.get("network", "").rsplit("/", 1)[-1] != network.rsplit("/", 1)[-1] or \
                rule.get("direction", "INGRESS") != "INGRESS" or rule.get("disabled") or \
                not _covers_every_port(rule.get("allowed") or []):
            continue
        targets = rule.get("targetTags") or []
        if targets and not set(targets) & set(tags):
            continue
        if set(rule.get("sourceTags") or []) & set(tags):
            return rule
        for source in rule.get("sourceRanges") or []:
            if subnet is not None and subnet.subnet_of(ipaddress.ip_network(source, strict=False)):
                return rule
    return None


def nat_covers(routers: list[dict[str, Any]], network: str, subnet_link: str) -> bool:
    for router in routers:
        if router.get("network", "").rsplit("/", 1)[-1] != network.rsplit("/", 1)[-1]:
            continue
        for nat in router.get("nats") or []:
            mode = nat.get("sourceSubnetworkIpRangesToNat", "")
            if mode.startswith("ALL_SUBNETWORKS"):
                return True
            if any(s.get("name", "").rsplit("/", 1)[-1] == subnet_link.rsplit("/", 1)[-1]
                   for s in nat.get("subnetworks") or []):
                return True
    return False


def network_problems(props: dict[str, Any], get: Callable[[str], Any]) -> list[str]:
    """What the named network and subnet lack for the stack; `get(path)` answers a Compute API
    path (projects/...) with its JSON, or None for a 404."""
    project, name, subnet_name = props["host_project"], props["network"], props["subnet"]
    region, where = props["region"], f"network {name} of project {props['host_project']}"
    network = get(f"projects/{project}/global/networks/{name}")
    if network is None:
        return [f"multislice:network: {where} does not exist, or the deployer may not read it "
                "(roles/compute.networkViewer on that project); check network.name and "
                "network.project"]
    problems = []
    if int(network.get("mtu") or 1460) != NEEDED_MTU:
        problems.append(f"multislice:network: {where} has MTU {network.get('mtu') or 1460}; the "
                        f"slices need {NEEDED_MTU} (DCN traffic between slices): ask its team "
                        "to set it (`gcloud compute networks update --mtu` while no VM uses it)")
    subnet = get(f"projects/{project}/regions/{region}/subnetworks/{subnet_name}")
    if subnet is None:
        return [*problems, f"multislice:network: subnet {subnet_name} does not exist in "
                f"{region} of project {project} (the slices' zone {props['zone']} is in "
                f"{region}); check network.subnet"]
    if subnet.get("network", "").rsplit("/", 1)[-1] != name:
        problems.append(f"multislice:network: subnet {subnet_name} belongs to network "
                        f"{subnet.get('network', '?').rsplit('/', 1)[-1]}, not {name}")
    if not subnet.get("privateIpGoogleAccess"):
        problems.append(f"multislice:network: subnet {subnet_name} has Private Google Access "
                        "off; the hosts have no external IP and reach the bucket only through "
                        "it: ask its team to turn it on (`gcloud compute networks subnets "
                        "update --enable-private-ip-google-access`)")
    firewalls = (get(f"projects/{project}/global/firewalls") or {}).get("items") or []
    tags = props["tags"]
    if internal_rule(firewalls, name, tags, subnet.get("ipCidrRange", "")) is None:
        problems.append(f"multislice:network: no enabled ingress rule of {name} lets the slices' "
                        f"hosts reach each other on every port: allow tcp, udp and icmp from "
                        f"the tag {tags[0]} (or one of {', '.join(tags)}, or the subnet's "
                        f"{subnet.get('ipCidrRange', '?')}) to them, as the seed's internal "
                        "rule does; or add the platform's tag to multislice:tags")
    if props["egress"] == "nat":
        routers = (get(f"projects/{project}/regions/{region}/routers") or {}).get("items") or []
        if not nat_covers(routers, name, subnet.get("selfLink", subnet_name)):
            problems.append(f"multislice:network: egress 'nat', but no Cloud NAT of {name} in "
                            f"{region} covers subnet {subnet_name}, so a host could not build "
                            "its environment: set multislice:egress: none (and publish it "
                            "with `multislice env-publish`), or ask its team for a NAT")
    return problems


def compute_getter(timeout_s: float = 30.0) -> Callable[[str], Any]:
    """GET of a Compute API path with the deployer's credentials (or none against the stand-in);
    raises RuntimeError with one line on anything but 200 and 404."""
    base = os.environ.get(COMPUTE_ENDPOINT_ENV, "").strip().rstrip("/") or COMPUTE_API
    token = None
    if base == COMPUTE_API:
        import google.auth
        import google.auth.transport.requests

        credentials, _ = google.auth.default(scopes=SCOPES)
        credentials.refresh(google.auth.transport.requests.Request())
        token = credentials.token

    def get(path: str) -> Any:
        request = urllib.request.Request(f"{base}/{path}", headers={"Accept": "application/json"})
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as answer:
                return json.load(answer)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise RuntimeError(f"the Compute API answered HTTP {exc.code} for {path}; the "
                               "deployer needs roles/compute.networkViewer on the network's "
                               "project") from None
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"cannot ask {base} for {path}: {type(exc).__name__}") from None

    return get


class NetworkCheckProvider(CheckOnlyProvider):
    def check(self, _olds: dict[str, Any], news: dict[str, Any]) -> CheckResult:
        try:
            problems = network_problems(news, compute_getter())
        except RuntimeError as exc:
            problems = [f"multislice:network: {exc}"]
        except Exception:  # noqa: BLE001 - no credentials: the queued resource's create says so
            problems = []
        return CheckResult(news, [CheckFailure("network", line) for line in problems])

    def resource_id(self, props: dict[str, Any]) -> str:
        return f"{props['host_project']}/{props['network']}/{props['subnet']}"


class NetworkCheck(pulumi.dynamic.Resource):
    def __init__(self, name: str, props: dict[str, Any],
                 opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__(NetworkCheckProvider(), name, props, opts)
