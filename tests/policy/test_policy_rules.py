"""Each policy of the pack, called directly with the argument objects pulumi-policy builds."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from pulumi_policy import PolicyResource, ResourceValidationArgs, StackValidationArgs
from pulumi_policy.proxy import unknown_checking_proxy

POLICY_DIR = Path(__file__).resolve().parents[2] / "policy"
sys.path.insert(0, str(POLICY_DIR))
import multislice_policies as mp  # noqa: E402

STACK = "dev"
UNKNOWN = "04da6b54-80e4-46f7-96ec-b56ff0331ba9"  # the engine's sentinel for unknown values
DEDICATED_SA = "trainer@my-proj.iam.gserviceaccount.com"
DEFAULT_SA = "123456789012-compute@developer.gserviceaccount.com"
GOOD_LABELS = {"multislice-stack": STACK, "team": "research"}


def urn(type_: str, name: str, stack: str = STACK) -> str:
    return f"urn:pulumi:{stack}::multislice::{type_}::{name}"


def args(type_: str, props: dict[str, Any], name: str = "r", stack: str = STACK,
         config: dict[str, Any] | None = None) -> ResourceValidationArgs:
    return ResourceValidationArgs(type_, unknown_checking_proxy(props), urn(type_, name, stack),
                                  name, None, None, config)


def violations(check, a) -> list[str]:
    found: list[str] = []
    check(a, lambda message, urn=None: found.append(message))
    return found


def queued_resource_props(*, node_count: int = 2, external_ips: bool = False,
                          sa_email: str | None = DEDICATED_SA,
                          labels: dict[str, str] | None = None) -> dict[str, Any]:
    """The queued-resource dynamic resource's inputs: infra's flat spec."""
    labels = GOOD_LABELS if labels is None else labels
    spec: dict[str, Any] = {
        "__provider": "pickled-provider-state",
        "project": "p", "zone": "us-east5-b", "queued_resource_id": "ms-dev-qr",
        "accelerator_type": "v5litepod-16", "runtime_version": "v2-alpha-tpuv5-lite",
        "slices": node_count, "node_prefix": "ms-dev", "network": "net", "subnetwork": "sub",
        "enable_external_ips": external_ips, "labels": labels, "tags": ["ms-dev-slice"],
        "metadata": {"startup-script": "#!/bin/bash"}, "capacity": "spot",
    }
    if sa_email is not None:
        spec["service_account_email"] = sa_email
    return spec


# --- no-open-ingress ---------------------------------------------------------------------------

@pytest.mark.parametrize("ranges", [["0.0.0.0/0"], ["10.0.0.0/8", "::/0"]])
def test_ingress_from_anywhere_is_rejected(ranges):
    props = {"network": "net", "sourceRanges": ranges, "allows": [{"protocol": "tcp"}]}
    found = violations(mp.check_no_open_ingress, args(mp.FIREWALL, props, "fw"))
    assert len(found) == 1 and urn(mp.FIREWALL, "fw") in found[0]


@pytest.mark.parametrize("props", [
    {"sourceTags": ["tpu"], "targetTags": ["tpu"], "allows": [{"protocol": "tcp"}]},
    {"sourceRanges": ["35.235.240.0/20"], "allows": [{"protocol": "tcp", "ports": ["22"]}]},
    {"direction": "EGRESS", "destinationRanges": ["0.0.0.0/0"], "allows": [{"protocol": "all"}]},
    {"sourceRanges": ["0.0.0.0/0"], "disabled": True},
])
def test_tag_iap_egress_and_disabled_rules_pass(props):
    assert violations(mp.check_no_open_ingress, args(mp.FIREWALL, props)) == []


# --- no-tpu-external-ips -----------------------------------------------------------------------

def test_queued_resource_with_external_ips_is_rejected():
    a = args(mp.DYNAMIC, queued_resource_props(external_ips=True), "qr")
    found = violations(mp.check_no_external_ips, a)
    assert len(found) == 1 and "enableExternalIps" in found[0] and "'dev'" in found[0]


def test_tpu_vm_with_external_ips_is_rejected():
    props = {"networkConfig": {"enableExternalIps": True}, "zone": "us-central2-b"}
    assert len(violations(mp.check_no_external_ips, args(mp.TPU_VM, props))) == 1


def test_external_ips_pass_only_in_allowed_stacks():
    props = queued_resource_props(external_ips=True)
    config = {"allowExternalIpsStacks": ["debug"]}
    assert violations(mp.check_no_external_ips, args(mp.DYNAMIC, props, stack="debug",
                                                     config=config)) == []
    assert len(violations(mp.check_no_external_ips, args(mp.DYNAMIC, props, stack="prod",
                                                         config=config))) == 1


def test_internal_only_queued_resource_and_other_dynamic_resources_pass():
    assert violations(mp.check_no_external_ips,
                      args(mp.DYNAMIC, queued_resource_props(external_ips=False))) == []
    other = {"__provider": "x", "networkConfig": {"enableExternalIps": True}}
    assert violations(mp.check_no_external_ips, args(mp.DYNAMIC, other)) == []


# --- bucket-public-access-prevention -----------------------------------------------------------

@pytest.mark.parametrize("value", [None, "inherited"])
def test_bucket_without_enforced_prevention_is_rejected(value):
    props = {"location": "US", "labels": GOOD_LABELS}
    if value is not None:
        props["publicAccessPrevention"] = value
    found = violations(mp.check_bucket_public_access_prevention, args(mp.BUCKET, props))
    assert len(found) == 1 and repr(value) in found[0]


def test_bucket_with_enforced_prevention_passes():
    props = {"location": "US", "publicAccessPrevention": "enforced"}
    assert violations(mp.check_bucket_public_access_prevention, args(mp.BUCKET, props)) == []


# --- trainer-bucket-writes-conditioned --------------------------------------------------------

TRAINER = "serviceAccount:ms-exp-tpu@my-proj.iam.gserviceaccount.com"


@pytest.mark.parametrize("role", ["roles/storage.objectUser", "roles/storage.objectAdmin"])
def test_an_unconditional_object_write_for_the_hosts_account_is_rejected(role):
    props = {"bucket": "b", "role": role, "member": TRAINER}
    found = violations(mp.check_trainer_bucket_writes_conditioned,
                       args(mp.BUCKET_IAM[0], props))
    assert len(found) == 1 and role in found[0] and TRAINER in found[0]
    binding = {"bucket": "b", "role": role, "members": ["user:a@x.com", TRAINER]}
    assert len(violations(mp.check_trainer_bucket_writes_conditioned,
                          args(mp.BUCKET_IAM[1], binding))) == 1


def test_a_conditioned_write_a_read_or_another_members_write_passes():
    cond = {"title": "t", "expression": 'resource.name.startsWith("projects/_/buckets/b/objects/runs/exp/")'}
    for props in ({"bucket": "b", "role": "roles/storage.objectUser", "member": TRAINER,
                   "condition": cond},
                  {"bucket": "b", "role": "roles/storage.objectViewer", "member": TRAINER},
                  {"bucket": "b", "role": "roles/storage.objectUser", "member": "user:a@x.com"}):
        assert violations(mp.check_trainer_bucket_writes_conditioned,
                          args(mp.BUCKET_IAM[0], props)) == []


# --- no-default-compute-service-account --------------------------------------------------------

@pytest.mark.parametrize("type_,props", [
    (mp.INSTANCE, {"serviceAccount": {"email": DEFAULT_SA, "scopes": ["cloud-platform"]}}),
    (mp.INSTANCE, {"serviceAccount": {"scopes": ["cloud-platform"]}}),
    ("gcp:storage/bucketIAMMember:BucketIAMMember",
     {"bucket": "b", "role": "roles/storage.admin", "member": f"serviceAccount:{DEFAULT_SA}"}),
    (mp.DYNAMIC, queued_resource_props(sa_email=DEFAULT_SA)),
    (mp.DYNAMIC, queued_resource_props(sa_email=None)),
    (mp.TPU_VM, {"acceleratorType": "v4-8"}),
])
def test_default_compute_service_account_is_rejected(type_, props):
    assert len(violations(mp.check_no_default_compute_service_account, args(type_, props))) == 1


@pytest.mark.parametrize("type_,props", [
    (mp.INSTANCE, {"serviceAccount": {"email": DEDICATED_SA}}),
    (mp.INSTANCE, {"machineType": "e2-small"}),
    (mp.DYNAMIC, queued_resource_props()),
    (mp.DYNAMIC, queued_resource_props(sa_email=UNKNOWN)),  # created in the same preview
    (mp.TPU_VM, {"serviceAccount": {"email": DEDICATED_SA}}),
    ("gcp:storage/bucketIAMMember:BucketIAMMember",
     {"bucket": "b", "role": "roles/storage.objectAdmin", "member": f"serviceAccount:{DEDICATED_SA}"}),
])
def test_dedicated_or_absent_service_account_passes(type_, props):
    assert violations(mp.check_no_default_compute_service_account, args(type_, props)) == []


def test_unknown_values_during_preview_do_not_hide_a_known_default_account():
    props = {"network": UNKNOWN, "serviceAccount": {"email": DEFAULT_SA}}
    assert len(violations(mp.check_no_default_compute_service_account,
                          args(mp.INSTANCE, props))) == 1


# --- required-labels ---------------------------------------------------------------------------

def test_missing_labels_are_named():
    props = {"publicAccessPrevention": "enforced", "labels": {"team": "research"}}
    found = violations(mp.check_required_labels, args(mp.BUCKET, props))
    assert len(found) == 1 and "['multislice-stack']" in found[0]


def test_queued_resource_nodes_need_labels_too():
    a = args(mp.DYNAMIC, queued_resource_props(labels={}))
    assert len(violations(mp.check_required_labels, a)) == 1
    assert violations(mp.check_required_labels,
                      args(mp.DYNAMIC, queued_resource_props())) == []


def test_required_label_list_is_configurable():
    props = {"labels": GOOD_LABELS}
    assert violations(mp.check_required_labels, args(mp.BUCKET, props)) == []
    config = {"requiredLabels": ["owner"]}
    found = violations(mp.check_required_labels, args(mp.BUCKET, props, config=config))
    assert len(found) == 1 and "['owner']" in found[0]
    assert violations(mp.check_required_labels,
                      args(mp.FIREWALL, {}, config=config)) == []


def node_pool_props(*, sa_email: str | None = DEDICATED_SA,
                    labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A GKE TPU slice node pool's inputs (infra/gke/manifest.py:node_pool, camelCase)."""
    node_config: dict[str, Any] = {"machineType": "ct5lp-hightpu-4t",
                                   "labels": GOOD_LABELS if labels is None else labels}
    if sa_email is not None:
        node_config["serviceAccount"] = sa_email
    return {"cluster": "c", "nodeCount": 4, "nodeConfig": node_config,
            "placementPolicy": {"type": "COMPACT", "tpuTopology": "4x4"}}


def test_gke_tpu_node_pools_need_a_dedicated_account_and_labels():
    for props in (node_pool_props(sa_email=None), node_pool_props(sa_email=DEFAULT_SA)):
        assert len(violations(mp.check_no_default_compute_service_account,
                              args(mp.NODE_POOL, props))) == 1
    assert len(violations(mp.check_required_labels,
                          args(mp.NODE_POOL, node_pool_props(labels={})))) == 1
    good = args(mp.NODE_POOL, node_pool_props())
    assert violations(mp.check_no_default_compute_service_account, good) == []
    assert violations(mp.check_required_labels, good) == []
    # a CPU pool (no TPU topology) is not a slice: only the account string check applies
    cpu = {"nodeConfig": {"machineType": "e2-standard-4"}}
    assert violations(mp.check_required_labels, args(mp.NODE_POOL, cpu)) == []


@pytest.mark.parametrize("private", [False, None])
def test_a_gke_cluster_without_private_nodes_is_rejected(private):
    props = {"privateClusterConfig": {"enablePrivateNodes": private}} if private is not None \
        else {}
    found = violations(mp.check_no_external_ips, args(mp.CLUSTER, props))
    assert len(found) == 1 and "enablePrivateNodes" in found[0]
    assert violations(mp.check_no_external_ips, args(mp.CLUSTER, {
        "privateClusterConfig": {"enablePrivateNodes": True}})) == []


# --- max-slices-per-stack ----------------------------------------------------------------------

def stack_args(*node_counts: int, config: dict[str, Any] | None = None) -> StackValidationArgs:
    resources = [
        PolicyResource(mp.DYNAMIC,
                       unknown_checking_proxy(queued_resource_props(node_count=n)),
                       urn(mp.DYNAMIC, f"qr{i}"), f"qr{i}", None, None, None, [], {})
        for i, n in enumerate(node_counts)
    ]
    resources.append(PolicyResource(mp.BUCKET, unknown_checking_proxy({}), urn(mp.BUCKET, "b"),
                                    "b", None, None, None, [], {}))
    return StackValidationArgs(resources, config)


def test_slices_over_the_default_cap_are_rejected():
    found = violations(mp.check_slice_cap, stack_args(10, 7))
    assert len(found) == 1 and "17 TPU slices" in found[0] and "maxSlices=16" in found[0]
    assert violations(mp.check_slice_cap, stack_args(10, 6)) == []


def test_gke_node_pools_count_one_slice_each_toward_the_cap():
    pools = [PolicyResource(mp.NODE_POOL, unknown_checking_proxy(node_pool_props()),
                            urn(mp.NODE_POOL, f"s{i}"), f"s{i}", None, None, None, [], {})
             for i in range(17)]
    found = violations(mp.check_slice_cap, StackValidationArgs(pools, None))
    assert len(found) == 1 and "17 TPU slices" in found[0]


def test_slice_cap_is_configurable():
    assert len(violations(mp.check_slice_cap, stack_args(4, config={"maxSlices": 3}))) == 1
    assert violations(mp.check_slice_cap, stack_args(64, config={"maxSlices": 64})) == []


def test_policy_names_are_unique_and_all_checks_are_wired():
    policies = mp.build_policies()
    assert len({p.name for p in policies}) == len(policies) == 7


# --- the pack as the engine runs it ------------------------------------------------------------

def test_pack_serves_the_analyzer_protocol_and_reports_violations(tmp_path):
    """Start policy/__main__.py like `pulumi preview --policy-pack` does and call it over gRPC."""
    import subprocess

    import grpc
    from google.protobuf import json_format, struct_pb2
    from pulumi.runtime.proto import analyzer_pb2, analyzer_pb2_grpc

    def struct(props: dict[str, Any]) -> struct_pb2.Struct:
        return json_format.ParseDict(props, struct_pb2.Struct())

    proc = subprocess.Popen([sys.executable, str(POLICY_DIR / "__main__.py")], cwd=tmp_path,
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline().strip())
        stub = analyzer_pb2_grpc.AnalyzerStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        open_fw = analyzer_pb2.AnalyzeRequest(
            type=mp.FIREWALL, urn=urn(mp.FIREWALL, "fw"), name="fw",
            properties=struct({"sourceRanges": ["0.0.0.0/0"], "network": UNKNOWN}))
        names = [d.policyName for d in stub.Analyze(open_fw, timeout=30).diagnostics]
        assert names == ["no-open-ingress"]

        good = analyzer_pb2.AnalyzeRequest(
            type=mp.DYNAMIC, urn=urn(mp.DYNAMIC, "qr"), name="qr",
            properties=struct(queued_resource_props()))
        assert list(stub.Analyze(good, timeout=30).diagnostics) == []

        big = analyzer_pb2.AnalyzeStackRequest(resources=[analyzer_pb2.AnalyzerResource(
            type=mp.DYNAMIC, urn=urn(mp.DYNAMIC, "qr"), name="qr",
            properties=struct(queued_resource_props(node_count=32)))])
        diagnostics = stub.AnalyzeStack(big, timeout=30).diagnostics
        assert [d.policyName for d in diagnostics] == ["max-slices-per-stack"]
    finally:
        proc.kill()
        proc.wait()
