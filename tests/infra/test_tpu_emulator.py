"""The TPU API emulator as the real client sees it (other parts' status/babysit tests reuse it)."""

import subprocess
import sys

import pytest
from google.api_core import exceptions
from google.cloud import tpu_v2

from infra.tpu_api import make_tpu_client
from scripts.testing.tpu_emulator import TpuEmulator

PARENT = "projects/p/locations/us-central2-b"


def _create(client, qr_id, slices=2, accel="v4-16"):
    return _create_op(client, qr_id, slices, accel).result(timeout=5)


def _create_op(client, qr_id, slices=2, accel="v4-16"):
    spec = {"node": {"accelerator_type": accel, "runtime_version": "rt"}}
    if slices > 1:
        spec["multislice_params"] = {"node_count": slices, "node_id_prefix": qr_id}
    else:
        spec["node_id"] = qr_id
    request = tpu_v2.CreateQueuedResourceRequest(
        parent=PARENT,
        queued_resource_id=qr_id,
        queued_resource={"tpu": {"node_spec": [{"parent": PARENT, **spec}]}},
    )
    return client.create_queued_resource(request=request)


def _state(client, qr_id):
    return client.get_queued_resource(name=f"{PARENT}/queuedResources/{qr_id}").state.state.name


def test_worker_endpoints_are_configurable_per_slice_and_host():
    ports = {(0, 0): 2201, (0, 1): 2202, (1, 0): 2203, (1, 1): 2204}
    with TpuEmulator(endpoint_fn=lambda qr, s, h: ("127.0.0.1", ports[(s, h)])) as emu:
        client = make_tpu_client(emu.url)
        _create(client, "qr")
        emu.set_state("qr", "ACTIVE")
        nodes = list(client.list_nodes(parent=PARENT))
        assert [n.name.rsplit("/", 1)[1] for n in nodes] == ["qr-0", "qr-1"]
        got = {n.name[-1]: [(e.ip_address, e.port) for e in n.network_endpoints] for n in nodes}
        assert got == {
            "0": [("127.0.0.1", 2201), ("127.0.0.1", 2202)],
            "1": [("127.0.0.1", 2203), ("127.0.0.1", 2204)],
        }
        assert all(n.state.name == "READY" for n in nodes)


def test_unknown_resources_are_404_and_duplicates_409():
    with TpuEmulator() as emu:
        client = make_tpu_client(emu.url)
        with pytest.raises(exceptions.NotFound):
            client.get_queued_resource(name=f"{PARENT}/queuedResources/nope")
        with pytest.raises(exceptions.NotFound):
            client.get_node(name=f"{PARENT}/nodes/nope")
        _create(client, "qr", slices=1, accel="v4-8")
        with pytest.raises(exceptions.Conflict):
            _create(client, "qr", slices=1, accel="v4-8")


def test_a_suspending_resource_has_preempted_nodes_and_a_suspended_one_none_nor_a_reset():
    from google.api_core import exceptions

    with TpuEmulator() as emu:
        client = make_tpu_client(emu.url)
        _create(client, "qr")
        emu.set_state("qr", "ACTIVE")
        emu.set_state("qr", "SUSPENDING")
        assert client.get_node(name=f"{PARENT}/nodes/qr-0").state.name == "PREEMPTED"
        emu.set_state("qr", "SUSPENDED")
        assert _state(client, "qr") == "SUSPENDED"
        with pytest.raises(exceptions.NotFound):  # the API deletes a suspended request's nodes
            client.get_node(name=f"{PARENT}/nodes/qr-0")
        with pytest.raises(exceptions.BadRequest, match="only an ACTIVE queued resource"):
            client.reset_queued_resource(name=f"{PARENT}/queuedResources/qr")


def test_a_deleted_resource_lingers_in_deleting_and_keeps_its_id_until_it_is_gone():
    from google.api_core import exceptions

    with TpuEmulator(deleting_polls=2) as emu:
        client = make_tpu_client(emu.url)
        _create(client, "qr")
        name = f"{PARENT}/queuedResources/qr"
        client.delete_queued_resource(request={"name": name, "force": True}).result(timeout=5)
        assert _state(client, "qr") == "DELETING"  # the operation is done, the resource is not
        with pytest.raises(exceptions.Conflict):
            _create(client, "qr")
        assert _state(client, "qr") == "DELETING"
        with pytest.raises(exceptions.NotFound):
            client.get_queued_resource(name=name)
        _create(client, "qr")  # the id is free again
        assert _state(client, "qr") in ("ACCEPTED", "PROVISIONING", "ACTIVE")


def test_a_create_operation_is_done_only_after_a_few_polls():
    with TpuEmulator(create_polls=3) as emu:
        client = make_tpu_client(emu.url)
        op = _create_op(client, "qr")
        assert not op.done()
        op.result(timeout=10)
        assert emu.count_requests("GET", "/operations/") >= 3


def test_worker_metadata_is_what_jax_cluster_detection_parses():
    from scripts.testing.tpu_emulator import worker_metadata

    with TpuEmulator() as emu:
        client = make_tpu_client(emu.url)
        _create(client, "qr", slices=2)
        emu.set_state("qr", "ACTIVE")
        meta = emu.worker_metadata("qr", 1, 0)
    assert meta["agent-worker-number"] == "0"
    assert "MEGASCALE_SLICE_ID: '1'" in meta["tpu-env"].splitlines()
    assert "MEGASCALE_NUM_SLICES: '2'" in meta["tpu-env"].splitlines()
    coordinator = next(line for line in meta["tpu-env"].splitlines()
                       if line.startswith("MEGASCALE_COORDINATOR_ADDRESS"))
    assert coordinator == "MEGASCALE_COORDINATOR_ADDRESS: '10.130.0.2:8080'"  # slice 0, worker 0
    assert [w.split(":")[2] for w in meta["worker-network-endpoints"].split(",")] == \
        ["10.130.1.2", "10.130.1.3"]
    single = worker_metadata("v4-16", ["n-0"], [["10.0.0.2", "10.0.0.3"]], 0, 1)
    assert "MEGASCALE" not in single["tpu-env"] and single["agent-worker-number"] == "1"


def test_reset_of_an_active_resource_resets_its_vms_and_keeps_it_active():
    with TpuEmulator() as emu:
        client = make_tpu_client(emu.url)
        _create(client, "qr")
        emu.set_state("qr", "ACTIVE")
        client.reset_queued_resource(name=f"{PARENT}/queuedResources/qr").result(timeout=5)
        assert emu.resets == {"qr": 1}
        assert _state(client, "qr") == "ACTIVE"
        assert client.get_node(name=f"{PARENT}/nodes/qr-0").state.name == "READY"


def test_delete_without_force_of_an_active_resource_is_refused():
    with TpuEmulator() as emu:
        client = make_tpu_client(emu.url)
        _create(client, "qr")
        emu.set_state("qr", "ACTIVE")
        with pytest.raises(exceptions.BadRequest, match="force"):
            client.delete_queued_resource(name=f"{PARENT}/queuedResources/qr")


def test_injected_errors_reach_the_client_without_retry():
    with TpuEmulator() as emu:
        client = make_tpu_client(emu.url)
        emu.inject(status=503, count=1, method="GET")
        with pytest.raises(exceptions.ServiceUnavailable):
            client.get_queued_resource(name=f"{PARENT}/queuedResources/x", retry=None)


def test_list_queued_resources_shows_scripted_waiting_state():
    with TpuEmulator() as emu:
        client = make_tpu_client(emu.url)
        emu.script("qr", [("WAITING_FOR_RESOURCES", None)])
        _create(client, "qr", slices=1, accel="v5litepod-8")
        listed = list(client.list_queued_resources(parent=PARENT))
        assert [q.state.state.name for q in listed] == ["WAITING_FOR_RESOURCES"]


def test_runs_standalone_as_a_module(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "scripts.testing.tpu_emulator", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        url = line.split("MULTISLICE_TPU_API_ENDPOINT=")[1].strip().rstrip(")")
        client = make_tpu_client(url)
        assert list(client.list_queued_resources(parent=PARENT)) == []
    finally:
        proc.terminate()
        proc.wait(timeout=10)
