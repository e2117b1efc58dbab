"""A shared network (`multislice:network`), checked at preview against what the slices need.

A platform team's VPC (in the stack's project or a Shared VPC host project) is used as it is:
the stack creates nothing in it and never modifies or deletes it. What the seed's guidance needs
of it is checked before anything is created, one line per finding, each with a name
(`FINDINGS`):

- `mtu`: 8896 (the overview: DCN traffic between slices wants jumbo frames); a warning with its
  measured cost unless the stack asks for `strict`, since it is a performance choice;
- `subnet-network`, `private-google-access`: the subnet, in the stack's region and of that
  network, with Private Google Access on (the hosts have no external IPs);
- `internal-ingress`, `internal-egress`: two hosts of the subnet with the stack's tags and
  service account reach each other on every port of tcp, udp and icmp, as Cloud NGFW evaluates
  the network's VPC firewall rules and the firewall policies in effect on it
  (infra/preview/firewall.py);
- `open-to-others`: a host of the subnet that is not this stack's (the platform's shared tags
  but not the stack's own `ms-STACK-slice` tag, another service account) reaches none of the
  hosts' tcp or udp ports: JAX's coordination service and the TPU runtime's DCN transfers
  authenticate no peer, so a host that reaches those ports can join or disturb the job (a
  warning unless `strict`);
- `google-apis-egress`: they reach private.googleapis.com or restricted.googleapis.com on 443;
- `nat`: with `egress: nat`, a Cloud NAT on a router of that network in the region that covers
  the subnet (with `egress: none` none is needed: the environment is published before the boot).

A finding the stack names in `warn_only` is a warning: a platform team may know better (an
address group or an inspection this check cannot judge). `mtu` and `open-to-others` are
warnings unless the stack asks for `strict`. Warnings go into the checked inputs
(`pulumi preview --diff` shows them) and to the provider's stderr.

`NetworkCheck` is a dynamic resource whose provider's `check` runs on every preview and up
(infra/preview/check_only.py). It reads the Compute API (v1) with the deployer's credentials,
or `MULTISLICE_COMPUTE_API_ENDPOINT` when set (the tests' stand-in), as the TPU API's override.
"""

from __future__ import annotations

import ipaddress
import json
import os
import sys
import typing
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi.dynamic
from pulumi.dynamic import CheckFailure, CheckResult

from infra.preview.check_only import CheckOnlyProvider
from infra.preview.firewall import Estate, Host, estate
from infra.stack_config.schema import NetworkFinding

COMPUTE_ENDPOINT_ENV = "MULTISLICE_COMPUTE_API_ENDPOINT"
COMPUTE_API = "https://compute.googleapis.com/compute/v1"
NEEDED_MTU = 8896
SCOPES = ("https://www.googleapis.com/auth/cloud-platform",)


FINDINGS = typing.get_args(NetworkFinding)  # what each finding is called in warn_only
# Warnings unless the stack asks for strict: the MTU is a performance choice, and a platform
# rule open to every host of the subnet (GCP's own default-allow-internal form) is common and
# trusts the platform's other tenants, which the README's per-stack rule does not.
WARNED_BY_DEFAULT = ("mtu", "open-to-others")
# Where the hosts reach Google APIs through Private Google Access (Google's "Configure Private
# Google Access"): the VIPs of private.googleapis.com and restricted.googleapis.com.
GOOGLE_API_VIPS = {"private.googleapis.com": "199.36.153.8",
                   "restricted.googleapis.com": "199.36.153.4"}
# `benchmarks/mtu.py --repeats 3`, median, on a 2-core machine: one TCP stream through a veth
# pair between two network namespaces with segmentation offloads off, MTU 1460 against 8896
# (9.0 and 14.5 Gbit/s): the cost is per packet, the CPU's work on each.
MTU_COST = ("one TCP stream moved 0.62x what it moves at 8896, measured per packet on a CPU by "
            "benchmarks/mtu.py")


@dataclass(frozen=True)
class Finding:
    key: str  # one of FINDINGS: what multislice:network.warn_only names
    line: str


def collection(get: Callable[[str], Any], path: str) -> list[dict[str, Any]]:
    """Every item of a Compute API list, page after page (nextPageToken)."""
    items: list[dict[str, Any]] = []
    token = None
    while True:
        page = get(path + (f"?pageToken={urllib.parse.quote(token)}" if token else "")) or {}
        items.extend(page.get("items") or [])
        token = page.get("nextPageToken")
        if not token:
            return items


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


def firewall_estate(get: Callable[[str], Any], project: str, name: str, region: str,
                    network: dict[str, Any]) -> Estate:
    """The network's VPC firewall rules and the firewall policies in effect on it in `region`."""
    link = network.get("selfLink") or f"{COMPUTE_API}/projects/{project}/global/networks/{name}"
    rules = [r for r in collection(get, f"projects/{project}/global/firewalls")
             if r.get("network", "").rsplit("/", 1)[-1] == name]
    global_ = get(f"projects/{project}/global/networks/{name}/getEffectiveFirewalls") or {}
    regional = get(f"projects/{project}/regions/{region}/firewallPolicies/getEffectiveFirewalls"
                   f"?network={urllib.parse.quote(link, safe='')}") or {}
    policies = [*(global_.get("firewallPolicys") or []),
                *(p for p in regional.get("firewallPolicys") or []
                  if p.get("type") in ("NETWORK_REGIONAL", "SYSTEM_REGIONAL"))]
    return estate({**network, "selfLink": link}, rules, policies)


def traffic_findings(fw: Estate, subnet_range: str, tags: list[str], account: str | None,
                     name: str) -> list[Finding]:
    """Host to host on every port of tcp, udp and icmp, both ways of the firewall, and https to
    Google APIs, for two hosts of the subnet carrying the stack's tags and service account."""
    subnet = ipaddress.ip_network(subnet_range or "10.0.0.0/8", strict=False)
    a, b = (Host(str(subnet.network_address + n), frozenset(tags), account or "") for n in (2, 3))
    findings = []
    fix = (f"allow tcp, udp and icmp between them (from the tag {tags[0]}, the subnet's "
           f"{subnet}{', or their account ' + account if account else ''}), as the seed's "
           "internal rule does, or add the platform's tag to multislice:tags")
    refused = fw.first_refusal("INGRESS", a, b)
    if refused:
        findings.append(Finding("internal-ingress", f"the slices' hosts cannot reach each other "
                                f"on {name}: ingress {refused}; {fix}"))
    refused = fw.first_refusal("EGRESS", a, b)
    if refused:
        findings.append(Finding("internal-egress", f"the slices' hosts cannot reach each other "
                                f"on {name}: egress {refused}; {fix}"))
    own, shared = tags[0], sorted(set(tags[1:]) - {tags[0]})
    stranger = Host(str(subnet.network_address + 4), frozenset(shared), "another-stack")
    opened = fw.first_allowance("INGRESS", stranger, a)
    if opened:
        carrying = f"the tag(s) {', '.join(shared)}" if shared else "no tag of this stack"
        findings.append(Finding(
            "open-to-others", f"hosts of other stacks reach the slices' hosts on {name}: "
            f"ingress from a host of the subnet with {carrying} and another service account, "
            f"{opened}; JAX's coordination service and the DCN transfers authenticate no peer, "
            f"so such a host can join or disturb the job: open the ports only between this "
            f"stack's own hosts, from the tag {own} to the tag {own} (README: a platform team's "
            "network)"))
    verdicts = {api: fw.decide("EGRESS", a, Host(vip), "tcp", 443)
                for api, vip in GOOGLE_API_VIPS.items()}
    if not any(v.allowed for v in verdicts.values()):
        findings.append(Finding("google-apis-egress", "the hosts cannot reach Google APIs (the "
                                "bucket, the TPU API) on " + name + ": egress tcp port 443 to " +
                                " and ".join(f"{api} ({GOOGLE_API_VIPS[api]}) is denied by {v.by}"
                                             for api, v in verdicts.items())
                                + "; allow it to one of them"))
    return findings


def network_findings(props: dict[str, Any], get: Callable[[str], Any]) -> list[Finding]:
    """What the named network and subnet lack for the stack; `get(path)` answers a Compute API
    path (projects/...) with its JSON, or None for a 404."""
    project, name, subnet_name = props["host_project"], props["network"], props["subnet"]
    region, where = props["region"], f"network {name} of project {props['host_project']}"
    network = get(f"projects/{project}/global/networks/{name}")
    if network is None:
        return [Finding("", f"{where} does not exist, or the deployer may not read it "
                        "(roles/compute.networkViewer on that project); check network.name and "
                        "network.project")]
    problems = []
    mtu = int(network.get("mtu") or 1460)
    if mtu != NEEDED_MTU:
        problems.append(Finding("mtu", f"{where} has MTU {mtu}, not the {NEEDED_MTU} DCN traffic "
                                f"between slices is best with (at MTU 1460, {MTU_COST}); ask its "
                                "team to raise it (`gcloud compute networks update --mtu` while "
                                "no VM uses it)"))
    subnet = get(f"projects/{project}/regions/{region}/subnetworks/{subnet_name}")
    if subnet is None:
        return [*problems, Finding("", f"subnet {subnet_name} does not exist in {region} of "
                                   f"project {project} (the slices' zone {props['zone']} is in "
                                   f"{region}); check network.subnet")]
    if subnet.get("network", "").rsplit("/", 1)[-1] != name:
        problems.append(Finding("subnet-network", f"subnet {subnet_name} belongs to network "
                                f"{subnet.get('network', '?').rsplit('/', 1)[-1]}, not {name}"))
    if not subnet.get("privateIpGoogleAccess"):
        problems.append(Finding("private-google-access", f"subnet {subnet_name} has Private "
                                "Google Access off; the hosts have no external IP and reach the "
                                "bucket only through it: ask its team to turn it on (`gcloud "
                                "compute networks subnets update "
                                "--enable-private-ip-google-access`)"))
    fw = firewall_estate(get, project, name, region, network)
    problems += traffic_findings(fw, subnet.get("ipCidrRange", ""), props["tags"],
                                 props.get("service_account"), name)
    if props["egress"] == "nat":
        routers = collection(get, f"projects/{project}/regions/{region}/routers")
        if not nat_covers(routers, name, subnet.get("selfLink", subnet_name)):
            problems.append(Finding("nat", f"egress 'nat', but no Cloud NAT of {name} in "
                                    f"{region} covers subnet {subnet_name}, so a host could not "
                                    "build its environment: set multislice:egress: none (and "
                                    "publish it with `multislice env-publish`), or ask its team "
                                    "for a NAT"))
    return problems


def network_problems(props: dict[str, Any], get: Callable[[str], Any]) -> tuple[list[str],
                                                                                 list[str]]:
    """(refusals, warnings), one line each: a finding the stack names in
    multislice:network.warn_only is a warning, and so is the MTU unless it asks for strict."""
    errors, warnings = [], []
    named = set(props.get("warn_only") or [])
    for finding in network_findings(props, get):
        if finding.key in named:
            warnings.append(f"multislice:network [{finding.key}, a warning by warn_only]: "
                            f"{finding.line}")
        elif finding.key in WARNED_BY_DEFAULT and not props.get("strict"):
            warnings.append(f"multislice:network [{finding.key}, a warning by default; strict: "
                            f"true refuses it]: {finding.line}")
        else:
            tail = (f" (a platform team that knows better: multislice:network.warn_only: "
                    f"[{finding.key}])") if finding.key else ""
            errors.append(f"multislice:network: {finding.line}{tail}")
    return errors, warnings


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
        warnings: list[str] = []
        try:
            problems, warnings = network_problems(news, compute_getter())
        except RuntimeError as exc:
            problems = [f"multislice:network: {exc}"]
        except Exception:  # noqa: BLE001 - no credentials: the queued resource's create says so
            problems = []
        for line in warnings:  # shown with the check's inputs by `pulumi preview --diff`
            print(f"warning: {line}", file=sys.stderr)
        return CheckResult({**news, "warnings": warnings},
                           [CheckFailure("network", line) for line in problems])

    def resource_id(self, props: dict[str, Any]) -> str:
        return f"{props['host_project']}/{props['network']}/{props['subnet']}"


class NetworkCheck(pulumi.dynamic.Resource):
    def __init__(self, name: str, props: dict[str, Any],
                 opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__(NetworkCheckProvider(), name, props, opts)
