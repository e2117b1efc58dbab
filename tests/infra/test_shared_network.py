"""A TPU-VM stack on a platform team's network (multislice:network): nothing of the network is
declared, the queued resource uses the named subnet, and preview checks the network through a
Compute API stand-in."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from infra.preview.network_check import NetworkCheckProvider
from scripts.emulators.compute_api import ComputeApi
from tests.infra.conftest import base_config
from tests.infra.pulumi_mocks import run_program

HOST = "platform-host"
NET = f"projects/{HOST}/global/networks/training"
SUBNET = f"projects/{HOST}/regions/us-central2/subnetworks/training-us-central2"


def shared(**changes):
    return base_config(network={"project": HOST, "name": "training",
                                "subnet": "training-us-central2"}, tags=["tpu-hosts"], **changes)


def test_a_stack_on_a_shared_network_declares_none_of_it(project_root):
    mocks, _ = run_program(shared(), project_root)
    assert not [r for r in mocks.resources if r.typ.startswith(("gcp:compute/network",
                                                                "gcp:compute/subnetwork",
                                                                "gcp:compute/router",
                                                                "gcp:compute/firewall"))]
    spec = mocks.queued_resource().inputs
    assert (spec["network"], spec["subnetwork"]) == (NET, SUBNET)
    [check] = [r for r in mocks.of_type("pulumi-python:dynamic:Resource")
               if r.name.endswith("-network-check")]
    assert check.inputs["tags"] == ["ms-exp-slice", "tpu-hosts"]
    assert check.inputs["host_project"] == HOST and check.inputs["egress"] == "nat"


def good_network(api: ComputeApi) -> None:
    api.resources[f"projects/{HOST}/global/networks/training"] = {
        "name": "training", "mtu": 8896, "selfLink": f"https://x/{NET}"}
    api.resources[f"projects/{HOST}/regions/us-central2/subnetworks/training-us-central2"] = {
        "name": "training-us-central2", "network": f"https://x/{NET}",
        "ipCidrRange": "10.20.0.0/20", "privateIpGoogleAccess": True,
        "selfLink": f"https://x/{SUBNET}"}
    api.collections[f"projects/{HOST}/global/firewalls"] = [
        {"name": "allow-ssh", "network": f"https://x/{NET}", "direction": "INGRESS",
         "allowed": [{"IPProtocol": "tcp", "ports": ["22"]}], "sourceRanges": ["35.235.240.0/20"]},
        {"name": "tpu-internal", "network": f"https://x/{NET}", "direction": "INGRESS",
         "allowed": [{"IPProtocol": "tcp"}, {"IPProtocol": "udp"}, {"IPProtocol": "icmp"}],
         "sourceTags": ["tpu-hosts"], "targetTags": ["tpu-hosts"]}]
    api.collections[f"projects/{HOST}/regions/us-central2/routers"] = [
        {"name": "nat-router", "network": f"https://x/{NET}", "nats": [
            {"name": "nat", "sourceSubnetworkIpRangesToNat": "LIST_OF_SUBNETWORKS",
             "subnetworks": [{"name": f"https://x/{SUBNET}"}]}]}]


@pytest.fixture
def compute(monkeypatch) -> Iterator[ComputeApi]:
    with ComputeApi() as api:
        monkeypatch.setenv("MULTISLICE_COMPUTE_API_ENDPOINT", api.url)
        good_network(api)
        yield api


PROPS = {"host_project": HOST, "network": "training", "subnet": "training-us-central2",
         "region": "us-central2", "zone": "us-central2-b", "tags": ["ms-exp-slice", "tpu-hosts"],
         "egress": "nat"}


PROPS["service_account"] = ACCOUNT = "ms-exp@team-proj.iam.gserviceaccount.com"


def reasons(**changes) -> list[str]:
    return [f.reason for f in NetworkCheckProvider().check({}, {**PROPS, **changes}).failures]


def warnings(**changes) -> list[str]:
    return NetworkCheckProvider().check({}, {**PROPS, **changes}).inputs["warnings"]


def test_a_network_that_has_what_the_slices_need_passes(compute):
    assert reasons() == []


def per_stack_rule(api: ComputeApi) -> None:
    """The README's rule: the stack's own tag on both ends, nothing else of the platform's."""
    vpc_rules(api)[1] = rule("ms-exp-internal", allowed=[{"IPProtocol": "all"}],
                             sourceTags=["ms-exp-slice"], targetTags=["ms-exp-slice"])


@pytest.mark.parametrize("estate, opened", [
    (lambda api: None, "tcp port 0 is allowed by VPC firewall rule tpu-internal"),
    (lambda api: vpc_rules(api).__setitem__(1, rule(
        "default-allow-internal", allowed=[{"IPProtocol": "all"}],
        sourceRanges=["10.20.0.0/20"])), "VPC firewall rule default-allow-internal"),
    (per_stack_rule, None),
    (lambda api: (per_stack_rule(api), vpc_rules(api).append(rule(
        "coordinator-from-anyone-inside", allowed=[{"IPProtocol": "tcp", "ports": ["8482"]}],
        sourceRanges=["10.0.0.0/8"], targetTags=["tpu-hosts"]))),
     "tcp port 8482 is allowed by VPC firewall rule coordinator-from-anyone-inside"),
], ids=["the platform's shared tag", "the subnet's range", "the stack's own tag",
        "one port from the whole range"])
def test_a_rule_that_lets_other_stacks_hosts_in_is_a_warning_or_under_strict_a_refusal(
        compute, estate, opened):
    # A host of the subnet with the platform's tags but not the stack's own, and another
    # account: JAX's coordination service would take its connection.
    estate(compute)
    assert reasons() == []
    said = [w for w in warnings() if "[open-to-others" in w]
    if opened is None:
        assert said == [] and reasons(strict=True) == []
        return
    [line] = said
    assert line.startswith("multislice:network [open-to-others, a warning by default; strict: "
                           "true refuses it]: hosts of other stacks reach the slices' hosts")
    assert opened in line and "from the tag ms-exp-slice to the tag ms-exp-slice" in line, line
    [refused] = reasons(strict=True)
    assert opened in refused and "warn_only: [open-to-others]" in refused
    assert reasons(strict=True, warn_only=["open-to-others"]) == []


@pytest.mark.parametrize("breakage, says", [
    (lambda api: api.resources[
        f"projects/{HOST}/regions/us-central2/subnetworks/training-us-central2"].update(
        privateIpGoogleAccess=False), "has Private Google Access off"),
    (lambda api: api.collections[f"projects/{HOST}/global/firewalls"].pop(),
     "cannot reach each other on training: ingress tcp port 0 is denied by the implied rule"),
    (lambda api: api.collections[f"projects/{HOST}/global/firewalls"][1].update(
        allowed=[{"IPProtocol": "tcp", "ports": ["8470"]}]), "ingress tcp port 0 is denied"),
    (lambda api: api.collections[f"projects/{HOST}/regions/us-central2/routers"].clear(),
     "egress 'nat', but no Cloud NAT of training in us-central2 covers subnet"),
    (lambda api: api.resources.pop(f"projects/{HOST}/global/networks/training"),
     "network training of project platform-host does not exist"),
    (lambda api: api.resources.pop(
        f"projects/{HOST}/regions/us-central2/subnetworks/training-us-central2"),
     "subnet training-us-central2 does not exist in us-central2"),
], ids=["private google access", "no internal rule", "rule on one port", "no nat",
        "no network", "no subnet"])
def test_each_thing_the_network_lacks_is_one_line(compute, breakage, says):
    breakage(compute)
    found = reasons()
    assert len(found) == 1 and says in found[0] and "\n" not in found[0], found


def test_egress_none_needs_no_nat_and_a_range_rule_serves_as_well(compute):
    compute.collections[f"projects/{HOST}/regions/us-central2/routers"].clear()
    assert reasons(egress="none") == []
    compute.collections[f"projects/{HOST}/global/firewalls"][1] = {
        "name": "subnet-internal", "network": f"https://x/{NET}", "direction": "INGRESS",
        "allowed": [{"IPProtocol": "all"}], "sourceRanges": ["10.0.0.0/8"]}
    assert reasons(egress="none", tags=["ms-exp-slice"]) == []


def test_a_shared_network_keeps_the_stacks_network_keys_out(project_root):
    from infra.stack_config.schema import StackConfig
    from infra.stack_config.validation import stack_problems

    cfg = StackConfig.model_validate({"stack": "exp", **shared(subnet_cidr="10.1.0.0/20",
                                                               ssh_from_iap=True)})
    problems = stack_problems(cfg)[0]
    assert any(p.startswith("subnet_cidr: '10.1.0.0/20' is for the stack's own subnet")
               for p in problems)
    assert any(p.startswith("ssh_from_iap: a firewall rule in the stack's own VPC")
               for p in problems)


def vpc_rules(api: ComputeApi) -> list[dict]:
    return api.collections[f"projects/{HOST}/global/firewalls"]


def rule(name: str, **fields) -> dict:
    return {"name": name, "network": f"https://x/{NET}", "direction": "INGRESS",
            "priority": 1000, **fields}


ALL_INTERNAL = [{"IPProtocol": "tcp", "ports": ["0-65535"]},
                {"IPProtocol": "udp", "ports": ["0-65535"]}, {"IPProtocol": "icmp"}]


def policy(kind: str, name: str, *rules: dict) -> dict:
    return {"type": kind, "name": name, "displayName": name, "rules": list(rules)}


def policy_rule(priority: int, action: str, direction: str = "INGRESS", **match) -> dict:
    targets = match.pop("targetServiceAccounts", None)
    return {"priority": priority, "action": action, "direction": direction,
            "match": {"layer4Configs": [{"ipProtocol": "all"}], **match},
            **({"targetServiceAccounts": targets} if targets else {})}


@pytest.mark.parametrize("estate", [
    # GCP's own default-allow-internal: every port written as a range, from a wide range
    lambda api: vpc_rules(api).__setitem__(1, rule(
        "default-allow-internal", allowed=ALL_INTERNAL, sourceRanges=["10.0.0.0/8"],
        priority=65534)),
    # keyed on the hosts' service account, both ways
    lambda api: vpc_rules(api).__setitem__(1, rule(
        "by-account", allowed=[{"IPProtocol": "all"}], sourceServiceAccounts=[ACCOUNT],
        targetServiceAccounts=[ACCOUNT])),
    # protocol numbers, as the API accepts them
    lambda api: vpc_rules(api).__setitem__(1, rule(
        "by-number", allowed=[{"IPProtocol": "6"}, {"IPProtocol": "17"}, {"IPProtocol": "1"}],
        sourceTags=["tpu-hosts"])),
    # no VPC rule at all: a global network firewall policy allows the subnet
    lambda api: (vpc_rules(api).pop(), api.policies.__setitem__(("training", None), [policy(
        "NETWORK", "platform-global", policy_rule(1000, "allow", srcIpRanges=["10.20.0.0/20"]))])),
    # a regional network firewall policy, its rule aimed at the hosts' account
    lambda api: (vpc_rules(api).pop(), api.policies.__setitem__(("training", "us-central2"), [
        policy("NETWORK_REGIONAL", "platform-us-central2", policy_rule(
            10, "allow", srcIpRanges=["10.20.0.0/16"], targetServiceAccounts=[ACCOUNT]))])),
    # the organisation's policy passes internal traffic on (goto_next) and denies the rest
    lambda api: api.policies.__setitem__(("training", None), [policy(
        "HIERARCHY", "org-guard", policy_rule(100, "goto_next", srcIpRanges=["10.0.0.0/8"]),
        policy_rule(200, "deny", srcIpRanges=["0.0.0.0/0"]))]),
    # egress locked down, with the subnet and Private Google Access's VIPs let out
    lambda api: vpc_rules(api).extend([
        rule("deny-all-egress", direction="EGRESS", denied=[{"IPProtocol": "all"}],
             destinationRanges=["0.0.0.0/0"], priority=65000),
        rule("allow-internal-egress", direction="EGRESS", allowed=[{"IPProtocol": "all"}],
             destinationRanges=["10.20.0.0/20"]),
        rule("allow-google-apis", direction="EGRESS", allowed=[
            {"IPProtocol": "tcp", "ports": ["443"]}], destinationRanges=["199.36.153.8/30"])]),
    # the internal rule on the last of many pages
    lambda api: (setattr(api, "page_size", 2), vpc_rules(api).__setitem__(slice(1, 1), [
        rule(f"ssh-{n}", allowed=[{"IPProtocol": "tcp", "ports": ["22"]}],
             sourceRanges=["35.235.240.0/20"]) for n in range(5)])),
], ids=["default-allow-internal form", "service accounts", "protocol numbers",
        "global network policy", "regional network policy", "hierarchical goto_next",
        "egress locked down", "pagination"])
def test_a_platform_network_written_in_any_real_form_passes(compute, estate):
    estate(compute)
    assert reasons() == []


@pytest.mark.parametrize("estate, key, says", [
    (lambda api: vpc_rules(api).append(rule(
        "deny-all", denied=[{"IPProtocol": "all"}], sourceRanges=["0.0.0.0/0"], priority=900)),
     "internal-ingress", "ingress tcp port 0 is denied by VPC firewall rule deny-all (priority "
     "900)"),
    (lambda api: vpc_rules(api).append(rule(
        "deny-same-priority", denied=[{"IPProtocol": "udp"}], sourceTags=["tpu-hosts"])),
     "internal-ingress", "udp port 0 is denied by VPC firewall rule deny-same-priority"),
    (lambda api: vpc_rules(api).extend([
        rule("deny-all-egress", direction="EGRESS", denied=[{"IPProtocol": "all"}],
             destinationRanges=["0.0.0.0/0"], priority=65000),
        rule("allow-google-apis", direction="EGRESS", allowed=[{"IPProtocol": "all"}],
             destinationRanges=["199.36.153.4/30"])]),
     "internal-egress", "egress tcp port 0 is denied by VPC firewall rule deny-all-egress"),
    (lambda api: vpc_rules(api).extend([
        rule("deny-all-egress", direction="EGRESS", denied=[{"IPProtocol": "all"}],
             destinationRanges=["0.0.0.0/0"], priority=65000),
        rule("allow-internal-egress", direction="EGRESS", allowed=[{"IPProtocol": "all"}],
             destinationRanges=["10.0.0.0/8"])]),
     "google-apis-egress", "egress tcp port 443 to private.googleapis.com (199.36.153.8) is "
     "denied by VPC firewall rule deny-all-egress"),
    (lambda api: vpc_rules(api).__setitem__(1, rule(
        "other-team", allowed=[{"IPProtocol": "all"}], sourceRanges=["10.20.0.0/20"],
        targetServiceAccounts=["other@team-b.iam.gserviceaccount.com"])),
     "internal-ingress", "denied by the implied rule that denies all ingress"),
    (lambda api: vpc_rules(api).__setitem__(1, rule(
        "high-ports", allowed=[{"IPProtocol": "tcp", "ports": ["1024-65535"]},
                               {"IPProtocol": "udp"}, {"IPProtocol": "icmp"}],
        sourceTags=["tpu-hosts"])),
     "internal-ingress", "tcp port 0 is denied"),
    (lambda api: api.policies.__setitem__(("training", None), [policy(
        "HIERARCHY", "org-guard", policy_rule(100, "deny", srcIpRanges=["0.0.0.0/0"],
                                              layer4Configs=[{"ipProtocol": "udp"}]))]),
     "internal-ingress", "udp port 0 is denied by rule 100 of hierarchical firewall policy "
     "org-guard"),
    (lambda api: (api.resources[f"projects/{HOST}/global/networks/training"].update(
        networkFirewallPolicyEnforcementOrder="BEFORE_CLASSIC_FIREWALL"),
        api.policies.__setitem__(("training", None), [policy(
            "NETWORK", "platform-global", policy_rule(1000, "deny",
                                                      srcIpRanges=["10.0.0.0/8"]))])),
     "internal-ingress", "rule 1000 of global network firewall policy platform-global"),
], ids=["higher-priority deny", "deny beats allow at one priority", "egress deny-all",
        "google apis egress", "allow aimed at another account", "ports 1024 and up",
        "hierarchical deny", "network policy before classic"])
def test_a_broken_platform_network_is_refused_in_one_line_naming_the_rule(compute, estate, key,
                                                                             says):
    estate(compute)
    found = reasons()
    assert len(found) == 1 and says in found[0] and "\n" not in found[0], found
    assert f"multislice:network.warn_only: [{key}]" in found[0]
    # the platform team that knows better makes it a warning, named in the output
    assert reasons(warn_only=[key]) == []
    [warned] = [w for w in warnings(warn_only=[key]) if f"[{key}," in w]
    assert warned.startswith(f"multislice:network [{key}, a warning by warn_only]") and says in warned


def test_a_small_mtu_is_a_warning_with_its_cost_unless_the_stack_asks_for_strict(compute):
    compute.resources[f"projects/{HOST}/global/networks/training"].update(mtu=1460)
    assert reasons() == []
    [warned] = [w for w in warnings() if w.startswith("multislice:network [mtu,")]
    assert warned.startswith("multislice:network [mtu, a warning by default; strict: true "
                             "refuses it]: network training of project platform-host has MTU "
                             "1460, not the 8896")
    assert "one TCP stream moved 0.62x what it moves at 8896" in warned
    [refused] = [r for r in reasons(strict=True) if "MTU" in r]
    assert "has MTU 1460" in refused and "warn_only: [mtu]" in refused


def test_warn_only_names_only_findings_the_check_makes(project_root):
    from pydantic import ValidationError

    from infra.stack_config.schema import StackConfig

    with pytest.raises(ValidationError) as caught:
        StackConfig.model_validate({"stack": "exp", **base_config(network={
            "project": HOST, "name": "training", "subnet": "training-us-central2",
            "warn_only": ["firewall"]})})
    assert "internal-ingress" in str(caught.value) and "'firewall'" in str(caught.value)
