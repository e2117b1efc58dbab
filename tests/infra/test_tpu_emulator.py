"""The TPU API emulator as the real client sees it (other parts' status/babysit tests reuse it)."""

import subprocess
import sys

import pytest
from google.api_core import exceptions
from google.cloud import tpu_v2

from infra.tpu_vm.api import make_tpu_client
from scripts.emulators.tpu_emulator import TpuEmulator

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
        assert _state(client, "qr") == "CREATING"  # a new request, from its first state


def test_a_create_operation_is_done_only_after_a_few_polls():
    with TpuEmulator(create_polls=3) as emu:
        client = make_tpu_client(emu.url)
        op = _create_op(client, "qr")
        assert not op.done()
        op.result(timeout=10)
        assert emu.count_requests("GET", "/operations/") >= 3


def test_worker_metadata_is_what_jax_cluster_detection_parses():
    from scripts.emulators.tpu_emulator import worker_metadata

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
    assert meta["worker-network-endpoints"] == "unknown:unknown:10.130.1.2,unknown:unknown:10.130.1.3"
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


@pytest.mark.parametrize("state", ["ACTIVE", "PROVISIONING", "SUSPENDING"])
def test_delete_without_force_of_a_resource_with_nodes_is_refused(state):
    with TpuEmulator() as emu:
        client = make_tpu_client(emu.url)
        _create(client, "qr")
        emu.set_state("qr", "ACTIVE")  # its nodes exist
        emu.set_state("qr", state)
        with pytest.raises(exceptions.BadRequest, match="force"):
            client.delete_queued_resource(name=f"{PARENT}/queuedResources/qr")


@pytest.mark.parametrize("state", ["ACCEPTED", "FAILED", "SUSPENDED", "WAITING_FOR_RESOURCES"])
def test_delete_without_force_is_accepted_where_the_proto_allows_it(state):
    # The proto: without force, only when the nodes are gone or the state is ACCEPTED, FAILED or
    # SUSPENDED (waiting for resources, no nodes exist yet).
    with TpuEmulator() as emu:
        client = make_tpu_client(emu.url)
        _create(client, "qr")
        emu.set_state("qr", state)
        client.delete_queued_resource(name=f"{PARENT}/queuedResources/qr").result(timeout=5)


def test_a_create_starts_in_creating_then_follows_its_script():
    with TpuEmulator() as emu:
        emu.script("qr", [("ACCEPTED", 1), ("ACTIVE", None)])
        client = make_tpu_client(emu.url)
        _create(client, "qr")
        assert [_state(client, "qr") for _ in range(3)] == ["CREATING", "ACCEPTED", "ACTIVE"]


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
        assert [_state(client, "qr") for _ in range(2)] == ["CREATING", "WAITING_FOR_RESOURCES"]
        listed = list(client.list_queued_resources(parent=PARENT))
        assert [q.state.state.name for q in listed] == ["WAITING_FOR_RESOURCES"]


def test_runs_standalone_as_a_module(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "scripts.emulators.tpu_emulator", "--port", "0"],
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


def _start_cli(tmp_path, *args):
    """`python -m scripts.emulators.tpu_emulator --port 0 ...`: (process, url) once it listens."""
    import re

    proc = subprocess.Popen([sys.executable, "-m", "scripts.emulators.tpu_emulator", "--port", "0",
                             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        found = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
        if found:
            return proc, found.group(1), lines
    proc.wait(timeout=10)
    raise AssertionError(f"emulator did not start: {lines} {proc.stderr.read()}")


def test_a_seeded_emulator_rehearses_status_babysit_and_reset_from_the_command_line(tmp_path):
    import json
    import urllib.request
    from pathlib import Path

    stack = Path(__file__).resolve().parents[2] / "stacks" / "Pulumi.seed-v5e.yaml"
    seed = tmp_path / "seed.json"
    seed.write_text(json.dumps({"queued_resources": [
        {"stack_config": str(stack), "state": "SUSPENDED"},
        {"parent": PARENT, "id": "other", "script": [["WAITING_FOR_RESOURCES", None]],
         "body": {"tpu": {"nodeSpec": [{"parent": PARENT, "nodeId": "other",
                                        "node": {"acceleratorType": "v4-8",
                                                 "runtimeVersion": "rt"}}]}}},
    ]}))
    proc, url, lines = _start_cli(tmp_path, "--seed", str(seed))
    try:
        assert "seeded queued resource ms-seed-v5e-qr: SUSPENDED\n" in lines
        assert "seeded queued resource other: WAITING_FOR_RESOURCES\n" in lines
        env = {"MULTISLICE_TPU_API_ENDPOINT": url, "PATH": "/usr/bin:/bin"}

        def cli(*argv, timeout=120):
            return subprocess.run([sys.executable, "-m", "scripts.cli", *argv,
                                   "--stack-config", str(stack)], capture_output=True, text=True,
                                  env={**env, "HOME": str(tmp_path)}, cwd=tmp_path,
                                  timeout=timeout)

        done = cli("babysit", "--interval", "0.2", "--backoff", "0.1", "--until-active",
                   "--timeout", "60", "--log", str(tmp_path / "babysit.jsonl"))
        assert done.returncode == 0, done.stdout + done.stderr
        actions = [json.loads(row)["action"]
                   for row in (tmp_path / "babysit.jsonl").read_text().splitlines()]
        assert "delete" in actions and "create" in actions, actions
        assert cli("reset").returncode == 0

        # Preempt it again through the control path, as a person rehearsing would with curl.
        request = urllib.request.Request(
            f"{url}/emulator/queuedResources/ms-seed-v5e-qr:setState", method="POST",
            data=json.dumps({"state": "SUSPENDED"}).encode())
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert json.loads(answer.read()) == {"id": "ms-seed-v5e-qr", "state": "SUSPENDED"}
        status = cli("status", "--json")
        assert status.returncode == 0, status.stderr
        assert '"SUSPENDED"' in status.stdout
        refused = cli("reset")
        assert refused.returncode != 0 and "SUSPENDED" in refused.stdout + refused.stderr
        bad = urllib.request.Request(f"{url}/emulator/queuedResources/ms-seed-v5e-qr:setState",
                                     method="POST", data=b'{"state": "ASLEEP"}')
        with pytest.raises(urllib.error.HTTPError) as refused_state:
            urllib.request.urlopen(bad, timeout=10)
        assert refused_state.value.code == 400
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.parametrize("seed,message", [
    ('{"queued_resources": [{"id": "x"}]}', "needs stack_config, or parent, id and body"),
    ('{"queued_resources": [{"parent": "projects/p/locations/z", "id": "x", "body": {}}]}',
     "the API refuses to create 'x': tpu.nodeSpec is required"),
    ('{"queued_resources": [{"stack_config": "nope.yaml"}]}', "stack_config"),
    ('{"queued_resources": [{"parent": "p", "id": "x", "body": {}, "state": "ASLEEP"}]}',
     "is not a [STATE, polls] step"),
    ('[1]', 'expected {"queued_resources": [...]}'),
    ('{not json', "Expecting property name"),
    ('{"queued_resources": [{"stack_config": 5}]}', "stack_config = 5: expected a path"),
    ('{"queued_resources": [{"parent": "p", "id": "x", "body": [1]}]}',
     "body = [1]: expected an object"),
    ('{"queued_resources": [{"parent": "p", "id": "x", "body": {}, "script": 5}]}',
     "script = 5: expected a list"),
    ('{"queued_resources": [{"parent": "p", "id": "x", "body": {}, "script": [5]}]}',
     "each step is a [STATE, polls] list"),
    ('{"queued_resources": [{"parent": "p", "id": "x", "body": {}, "state": ["ACTIVE"]}]}',
     'state = ["ACTIVE"]: expected a state name'),
], ids=["no body", "refused create", "missing stack", "bad state", "not an object", "not json",
        "stack not a path", "body not an object", "script not a list", "step not a list",
        "state not a name"])
def test_a_bad_seed_is_one_usage_line_naming_the_entry(tmp_path, seed, message):
    path = tmp_path / "seed.json"
    path.write_text(seed)
    done = subprocess.run([sys.executable, "-m", "scripts.emulators.tpu_emulator", "--port", "0",
                           "--seed", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"python -m scripts.emulators.tpu_emulator: error: --seed {path}: ")
    assert message in last, last
