"""TPU7x (Ironwood) on the road that serves it, GKE: every table entry the toolkit uses, the
workload policy its multi-host pools are placed by, its two JAX devices a chip, and the TPU-VM
road's refusal. Each fact's source is where the table is (infra/stack_config/topology.py,
infra/gke/topology.py)."""

from __future__ import annotations

import pytest

from infra.gke import capacity as gke_capacity
from infra.gke import manifest as gke_manifest
from infra.gke.cluster_check import min_version
from infra.gke.topology import GkeTopologyError, gke_slice
from infra.stack_config.schema import StackConfig
from infra.stack_config.topology import GIB, flop_per_dcn_bit_per_host, parse_accelerator_type
from infra.stack_config.validation import stack_problems
from tests.infra.conftest import base_config
from tests.infra.pulumi_mocks import run_program
from tests.infra.test_gke import gke_config
from tests.infra.test_gke_kinds import IMAGE, capacity_config, workload_config

NODE_POOL = "gcp:container/nodePool:NodePool"
RESOURCE_POLICY = "gcp:compute/resourcePolicy:ResourcePolicy"
CLUSTER = "gcp:container/cluster:Cluster"


def tpu7x(**overrides) -> dict:
    """A kind-all stack of 2 x tpu7x-128 on a cluster it creates."""
    return gke_config(**{
        "zone": "us-central1-c", "accelerator_type": "tpu7x-128",
        "gke": {"create_cluster": True, "image": IMAGE},
        "trainer": {"config": "tiny", "steps": 20, "mesh": {"ici_fsdp": 128},
                    "overrides": {"train.global_batch_size": 256}}, **overrides})


@pytest.mark.parametrize("name, chips, hosts, devices", [
    ("tpu7x-8", 4, 1, 8), ("tpu7x-16", 8, 2, 16), ("tpu7x-128", 64, 16, 128),
    ("tpu7x-256", 128, 32, 256), ("tpu7x-512", 256, 64, 512), ("v7x-128", 64, 16, 128)])
def test_a_tpu7x_name_counts_tensorcores_and_each_chip_shows_two_devices(name, chips, hosts,
                                                                         devices):
    topo = parse_accelerator_type(name)
    assert (topo.family, topo.chips, topo.hosts, topo.devices) == ("tpu7x", chips, hosts, devices)


def test_the_planner_reads_tpu7x_hbm_compute_and_dcn_from_its_page():
    topo = parse_accelerator_type("tpu7x-128")
    assert topo.hbm_bytes_per_chip == 192 * GIB
    assert topo.peak_bf16_flops_per_chip == 2307e12
    assert topo.host_dcn_bits_per_s == 400e9  # 100 Gbps a chip, 4 chips a VM
    assert flop_per_dcn_bit_per_host(topo) == pytest.approx(4 * 2307e12 / 400e9)
    from scripts.plan.planner import hardware_for

    hw = hardware_for("tpu7x-128")
    assert hw.hbm_bytes_per_device == 96 * GIB  # a chip's HBM over its two devices
    assert hw.peak_flops_per_device == pytest.approx(2307e12 / 2)
    assert "TPU7x page" in hw.dcn_source and hw.host_dcn_gbps == 400


@pytest.mark.parametrize("name, topology, nodes", [
    ("tpu7x-16", "2x2x2", 2), ("tpu7x-128", "4x4x4", 16), ("tpu7x-256", "4x4x8", 32),
    ("tpu7x-512", "4x8x8", 64)])
def test_a_tpu7x_slice_is_a_gke_pool_of_its_machine_type_label_and_workload_policy(
        name, topology, nodes):
    shape = gke_slice(parse_accelerator_type(name))
    assert (shape.accelerator, shape.machine_type, shape.topology, shape.nodes,
            shape.chips_per_node, shape.workload_policy) == (
        "tpu7x", "tpu7x-standard-4t", topology, nodes, 4, True)


def test_a_single_host_tpu7x_slice_is_no_multislice_pool():
    with pytest.raises(GkeTopologyError, match="'tpu7x-8' is a single-host slice"):
        gke_slice(parse_accelerator_type("tpu7x-8"))


def test_tpu7x_needs_gke_1_34_and_a_created_cluster_asks_for_it(project_root):
    assert min_version("on-demand", "tpu7x") == "1.34.0-gke.2201000"
    assert min_version("on-demand", "v5litepod") == "1.28.0"
    mocks, _ = run_program(tpu7x(), project_root)
    assert mocks.one(CLUSTER).inputs["minMasterVersion"] == "1.34.0-gke.2201000"


def test_tpu7x_pools_name_a_high_throughput_workload_policy_of_their_topology(project_root):
    mocks, _ = run_program(tpu7x(), project_root)
    (policy,) = mocks.of_type(RESOURCE_POLICY)
    assert policy.inputs["workloadPolicy"] == {"type": "HIGH_THROUGHPUT",
                                               "acceleratorTopology": "4x4x4"}
    assert policy.inputs["region"] == "us-central1"
    pools = [p for p in mocks.of_type(NODE_POOL) if p.name != "ms-exp-cpu"]
    assert len(pools) == 2
    for pool in pools:
        # the policy replaces the pool's TPU topology (GKE's Ironwood page)
        assert pool.inputs["placementPolicy"] == {"type": "COMPACT",
                                                  "policyName": policy.inputs["name"]}
        assert pool.inputs["nodeConfig"]["machineType"] == "tpu7x-standard-4t"
        assert pool.inputs["nodeCount"] == 16
    cfg = StackConfig.model_validate({"stack": "exp", **tpu7x()})
    pod = gke_manifest.jobset(cfg, "0" * 64)["spec"]["replicatedJobs"][0]["template"]["spec"][
        "template"]["spec"]
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] == "tpu7x"
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "4x4x4"
    (container,) = pod["containers"]
    assert container["resources"]["requests"] == {"google.com/tpu": 4}


def test_other_families_keep_their_pools_topology_and_no_workload_policy(project_root):
    mocks, _ = run_program(tpu7x(accelerator_type="v5litepod-16", trainer={
        "config": "tiny", "steps": 20, "mesh": {"ici_fsdp": 16},
        "overrides": {"train.global_batch_size": 32}}), project_root)
    assert not mocks.of_type(RESOURCE_POLICY)
    assert all(p.inputs["placementPolicy"] == {"type": "COMPACT", "tpuTopology": "4x4"}
               for p in mocks.of_type(NODE_POOL) if p.name != "ms-exp-cpu")


def test_a_capacity_stack_of_tpu7x_shapes_and_a_workload_stack_joining_it(project_root):
    capacity = capacity_config(shapes={"ir128": {"accelerator_type": "tpu7x-128", "slices": 2}},
                               teams={"team-a": {"quota": {"ir128": 128}}})
    del capacity["accelerator_type"], capacity["slices"], capacity["capacity"]
    del capacity["gke"]["team_namespaces"]
    cfg = StackConfig.model_validate({"stack": "plat", **capacity})
    assert [p["placement_policy"] for p in gke_capacity.node_pools(cfg)] == [
        {"type": "COMPACT", "policy_name": "ms-plat-ir128-wp"}] * 2
    assert [w["workload_policy"] for w in gke_capacity.workload_policies(cfg)] == [
        {"type": "HIGH_THROUGHPUT", "accelerator_topology": "4x4x4"}]
    assert not stack_problems(cfg)[0]
    workload = workload_config(local_queue="ir128")
    workload.update(accelerator_type="tpu7x-128", trainer={
        "config": "tiny", "steps": 20, "mesh": {"ici_fsdp": 128},
        "overrides": {"train.global_batch_size": 256}})
    joined = StackConfig.model_validate({"stack": "exp", **workload})
    assert not stack_problems(joined)[0]
    assert gke_manifest.pool_selector(joined) == {
        "cloud.google.com/gke-tpu-accelerator": "tpu7x",
        "cloud.google.com/gke-tpu-topology": "4x4x4"}


def test_an_ici_mesh_of_tpu7x_multiplies_to_its_devices_not_its_chips():
    bad = StackConfig.model_validate({"stack": "exp", **tpu7x(trainer={
        "config": "tiny", "steps": 20, "mesh": {"ici_fsdp": 64}})})
    assert any("64" in p and "128" in p for p in stack_problems(bad)[0]), stack_problems(bad)


def test_the_tpu_vm_road_refuses_tpu7x_in_one_line_naming_the_gke_kinds():
    raw = base_config(accelerator_type="tpu7x-128", slices=2, region="us-central1",
                      zone="us-central1-c", trainer={"config": "tiny", "steps": 20,
                                                     "mesh": {"ici_fsdp": 128}})
    (problem,) = stack_problems(StackConfig.model_validate({"stack": "exp", **raw}))[0]
    assert problem.startswith("accelerator_type: 'tpu7x-128' is TPU7X, which the Cloud TPU API "
                              "(queued resources, TPU VMs: orchestration 'tpu-vm') does not serve")
    assert "gke.kind 'all'" in problem and "'capacity'" in problem and "'workload'" in problem


@pytest.mark.slow  # a full render of the example (~10 s): the quick tier keeps its 3 minutes
def test_a_tpu7x_jobset_is_valid_against_the_pinned_crd_and_the_example_renders():
    from scripts import render
    from scripts.emulators.crd_admission import admit
    from tests.support.examples import ROOT

    cfg = StackConfig.model_validate({"stack": "exp", **tpu7x()})
    stored, refused = admit(gke_manifest.jobset(cfg, "0" * 64))
    assert not refused, refused
    (rjob,) = stored["spec"]["replicatedJobs"]
    assert (rjob["replicas"], rjob["template"]["spec"]["parallelism"]) == (2, 16)
    manifest = render.build_manifest(ROOT / "stacks" / "Pulumi.gke-tpu7x.yaml")
    types = {r["type"]: r for r in manifest["resources"]}
    policy = types[RESOURCE_POLICY]["inputs"]
    assert policy["workloadPolicy"] == {"type": "HIGH_THROUGHPUT",
                                        "acceleratorTopology": "4x4x4"}
    pools = [r["inputs"] for r in manifest["resources"] if r["type"] == NODE_POOL
             and r["inputs"]["nodeConfig"]["machineType"] == "tpu7x-standard-4t"]
    assert len(pools) == 2 and all(p["placementPolicy"]["policyName"] == policy["name"]
                                   for p in pools)
    assert types[CLUSTER]["inputs"]["minMasterVersion"] == "1.34.0-gke.2201000"
