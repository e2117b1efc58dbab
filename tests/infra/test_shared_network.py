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


def reasons(**changes) -> list[str]:
    return [f.reason for f in NetworkCheckProvider().check({}, {**PROPS, **changes}).failures]


def test_a_network_that_has_what_the_slices_need_passes(compute):
    assert reasons() == []


@pytest.mark.parametrize("breakage, says", [
    (lambda api: api.resources[f"projects/{HOST}/global/networks/training"].update(mtu=1460),
     "has MTU 1460; the slices need 8896"),
    (lambda api: api.resources[
        f"projects/{HOST}/regions/us-central2/subnetworks/training-us-central2"].update(
        privateIpGoogleAccess=False), "has Private Google Access off"),
    (lambda api: api.collections[f"projects/{HOST}/global/firewalls"].pop(),
     "no enabled ingress rule of training lets the slices' hosts reach each other"),
    (lambda api: api.collections[f"projects/{HOST}/global/firewalls"][1].update(
        allowed=[{"IPProtocol": "tcp", "ports": ["8470"]}]), "no enabled ingress rule"),
    (lambda api: api.collections[f"projects/{HOST}/regions/us-central2/routers"].clear(),
     "egress 'nat', but no Cloud NAT of training in us-central2 covers subnet"),
    (lambda api: api.resources.pop(f"projects/{HOST}/global/networks/training"),
     "network training of project platform-host does not exist"),
    (lambda api: api.resources.pop(
        f"projects/{HOST}/regions/us-central2/subnetworks/training-us-central2"),
     "subnet training-us-central2 does not exist in us-central2"),
], ids=["mtu", "private google access", "no internal rule", "rule on one port", "no nat",
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
