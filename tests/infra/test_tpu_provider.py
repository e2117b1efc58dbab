"""The dynamic provider, through the real google-cloud-tpu REST client, against the emulator."""

import json

import pytest

from infra.tpu_vm.api import ENDPOINT_ENV
from infra.tpu_vm.provider import QueuedResourceError, QueuedResourceProvider
from scripts.emulators.tpu_emulator import TpuEmulator

QR = "ms-exp-qr"
NAME = f"projects/proj/locations/us-central2-b/queuedResources/{QR}"


def spec(**overrides):
    base = {
        "project": "proj",
        "zone": "us-central2-b",
        "queued_resource_id": QR,
        "accelerator_type": "v4-16",
        "runtime_version": "tpu-ubuntu2204-base",
        "slices": 2,
        "node_prefix": "ms-exp",
        "network": "projects/proj/global/networks/ms-exp-net",
        "subnetwork": "projects/proj/regions/us-central2/subnetworks/ms-exp-subnet",
        "enable_external_ips": False,
        "tags": ["ms-exp-slice"],
        "labels": {"multislice-stack": "exp"},
        "service_account_email": "ms-exp-tpu@proj.iam.gserviceaccount.com",
        "metadata": {"startup-script": "#!/bin/bash\necho hi\n",
                     "launch-spec-uri": "gs://proj-ms-exp/launch/exp.json"},
        "capacity": "spot",
        "wait_for_active_s": 5,
        "poll_interval_s": 0.01,
        "delete_timeout_s": 10,
    }
    base.update(overrides)
    return base


@pytest.fixture
def emu(monkeypatch):
    with TpuEmulator(delete_polls=0) as emulator:
        monkeypatch.setenv(ENDPOINT_ENV, emulator.url)
        yield emulator


@pytest.fixture
def provider():
    return QueuedResourceProvider(retry_deadline_s=10, retry_initial_s=0.01)


def test_create_waits_through_states_until_active_and_reports_nodes(emu, provider):
    emu.script(
        QR, [("ACCEPTED", 2), ("WAITING_FOR_RESOURCES", 3), ("PROVISIONING", 1), ("ACTIVE", None)]
    )
    result = provider.create(spec())
    assert result.id == NAME
    assert result.outs["state"] == "ACTIVE"
    assert result.outs["node_ids"] == ["ms-exp-0", "ms-exp-1"]
    assert emu.node_ids() == ["ms-exp-0", "ms-exp-1"]
    assert emu.count_requests("GET", QR) >= 7  # it really polled through every state


def test_create_sends_multislice_spot_metadata_and_tags_over_rest(emu, provider):
    provider.create(spec())
    method, path, query, body = emu.requests[0]
    assert (method, query["queuedResourceId"]) == ("POST", QR)
    assert "enum-encoding=int" in query["$alt"]
    node_spec = body["tpu"]["nodeSpec"][0]
    assert node_spec["multisliceParams"] == {"nodeCount": 2, "nodeIdPrefix": "ms-exp"}
    assert node_spec["node"]["tags"] == ["ms-exp-slice"]
    assert node_spec["node"]["metadata"]["startup-script"].startswith("#!/bin/bash")
    assert "enableExternalIps" not in node_spec["node"]["networkConfig"]  # proto3 default: off
    assert body["spot"] == {}


def test_the_slices_boot_with_secure_boot_unless_the_stack_turns_it_off(emu, provider):
    provider.create(spec(secure_boot=True))
    node = emu.requests[0][3]["tpu"]["nodeSpec"][0]["node"]
    assert node["shieldedInstanceConfig"] == {"enableSecureBoot": True}
    provider.delete(NAME, spec(secure_boot=True))
    provider.create(spec(secure_boot=False))
    posts = [r for r in emu.requests if r[0] == "POST"]
    assert "shieldedInstanceConfig" not in posts[-1][3]["tpu"]["nodeSpec"][0]["node"]


def test_secure_boot_turned_on_by_an_upgrade_never_re_queues_a_running_stack(provider):
    # A queued resource an older toolkit made records no secure_boot: the new default is taken
    # at its next creation, not by giving up the slices it holds.
    made_before = {k: v for k, v in spec().items() if k != "secure_boot"}
    assert provider.diff(NAME, made_before, spec(secure_boot=True)).changes is False
    # One this toolkit made: the stack's own change of it replaces, as any node setting does.
    result = provider.diff(NAME, spec(secure_boot=False), spec(secure_boot=True))
    assert result.changes and result.replaces == ["secure_boot"]


def test_single_slice_uses_node_id_not_multislice_params(emu, provider):
    provider.create(spec(slices=1, accelerator_type="v4-8"))
    node_spec = emu.requests[0][3]["tpu"]["nodeSpec"][0]
    assert node_spec["nodeId"] == "ms-exp" and "multisliceParams" not in node_spec
    assert emu.node_ids() == ["ms-exp"]


def test_failed_queued_resource_surfaces_api_message_and_is_deleted(emu, provider):
    emu.script(QR, [("ACCEPTED", 1), ("FAILED", None)], error="Insufficient quota for v4 in zone")
    with pytest.raises(QueuedResourceError, match="FAILED.*Insufficient quota for v4 in zone"):
        provider.create(spec())
    assert emu.state_of(QR) is None  # cleaned up: it would otherwise keep holding quota


def test_waiting_for_resources_past_the_wait_times_out_and_deletes(emu, provider):
    emu.script(QR, [("ACCEPTED", 1), ("WAITING_FOR_RESOURCES", None)])
    with pytest.raises(QueuedResourceError, match=r"timed out after 0s .*WAITING_FOR_RESOURCES"):
        provider.create(spec(wait_for_active_s=0.2))
    assert emu.state_of(QR) is None
    assert emu.count_requests("DELETE", QR) == 1


def test_transient_429_and_503_are_retried(emu, provider):
    emu.inject(status=429, count=2, method="POST")
    emu.inject(status=503, count=3, method="GET", path_contains="queuedResources")
    result = provider.create(spec())
    assert result.outs["state"] == "ACTIVE"
    assert emu.count_requests("POST", "queuedResources") == 3


def test_slow_answers_are_retried_as_timeouts(emu):
    provider = QueuedResourceProvider(
        retry_deadline_s=10, retry_initial_s=0.01, request_timeout_s=0.3
    )
    emu.inject(delay_s=1.0, count=1, method="GET", path_contains="queuedResources")
    assert provider.create(spec()).outs["state"] == "ACTIVE"
    assert emu.count_requests("GET", QR) >= 2


def test_an_orphan_left_by_an_interrupted_create_is_adopted_on_retry(emu, provider):
    """The create reached the API but Pulumi never recorded it; `pulumi up` again adopts it."""
    from infra.tpu_vm.api import make_tpu_client
    from infra.tpu_vm.provider import _to_request

    make_tpu_client().create_queued_resource(request=_to_request(spec())).result(timeout=10)
    result = provider.create(spec())
    assert result.id == NAME and result.outs["state"] == "ACTIVE"
    assert emu.count_requests("POST", "queuedResources") == 2  # the orphan's, then our 409


def test_a_queued_resource_with_another_spec_is_refused_naming_the_delete_command(emu, provider):
    provider.create(spec(runtime_version="v2-alpha-tpuv4"))
    with pytest.raises(QueuedResourceError) as err:
        provider.create(spec())
    message = str(err.value)
    assert "already exists and is not this stack's request" in message
    assert "runtime_version is 'v2-alpha-tpuv4'" in message
    assert ("gcloud compute tpus queued-resources delete ms-exp-qr --project proj "
            "--zone us-central2-b --force") in message


def test_reserved_capacity_is_sent_as_a_reservation_name_like_gcloud_reserved(emu, provider):
    from infra.tpu_vm.request import build_queued_resource_request

    any_reservation = build_queued_resource_request(spec(capacity="reserved"))
    queued = any_reservation["queued_resource"]
    assert queued["reservation_name"] == "projects/proj/locations/us-central2-b/reservations/-"
    assert "scheduling_config" not in queued["tpu"]["node_spec"][0]["node"]
    named = build_queued_resource_request(spec(capacity="reserved", reservation_name="r1"))
    assert named["queued_resource"]["reservation_name"] == (
        "projects/proj/locations/us-central2-b/reservations/r1")
    assert provider.create(spec(capacity="reserved")).outs["state"] == "ACTIVE"


def _post(emu, qr_id: str, body: dict) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    url = (f"{emu.url}/v2/projects/proj/locations/us-central2-b/queuedResources"
           f"?queuedResourceId={qr_id}")
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _node_spec(**node_spec):
    return {"parent": "projects/proj/locations/us-central2-b",
            "node": {"acceleratorType": "v4-16", "runtimeVersion": "tpu-ubuntu2204-base"},
            **node_spec}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"tpu": {"nodeSpec": [_node_spec(multisliceParams={"nodeCount": 1})]}},
         "nodeCount is 1; it needs to be > 1"),
        ({"tpu": {"nodeSpec": [_node_spec(multisliceParams={"nodeCount": 2}),
                               _node_spec(nodeId="b")]}},
         "exactly one nodeSpec"),
        ({"tpu": {"nodeSpec": [_node_spec(nodeId="a")]}, "reservationName": "r1"},
         "reservationName 'r1' must be projects/"),
        ({"tpu": {"nodeSpec": [_node_spec(nodeId="a")]}, "reserved": True},
         "Unknown name 'reserved'"),
        ({"tpu": {"nodeSpec": [{"parent": "projects/proj/locations/us-central2-b",
                                "nodeId": "a", "node": {"acceleratorType": "v4-8"}}]}},
         "runtimeVersion is required"),
        ({"tpu": {"nodeSpec": [_node_spec()]}}, "nodeId or multisliceParams is required"),
        ({"tpu": {"nodeSpec": [_node_spec(nodeId="a")]}, "spot": {}, "guaranteed": {}},
         "set at most one"),
    ],
    ids=["one-node-multislice", "two-specs", "short-reservation", "unknown-field",
         "no-runtime", "no-node-id", "spot-and-guaranteed"],
)
def test_emulator_refuses_what_the_api_refuses(emu, body, message):
    status, text = _post(emu, "bad", body)
    assert status == 400 and message in text, text
    assert emu.state_of("bad") is None


def test_read_refreshes_state_and_reports_gone_resources(emu, provider):
    created = provider.create(spec())
    emu.set_state(QR, "SUSPENDED")
    read = provider.read(created.id, spec())
    assert (read.id, read.outs["state"]) == (NAME, "SUSPENDED")
    provider.delete(created.id, spec())
    assert provider.read(created.id, spec()).id is None


def test_delete_force_deletes_waits_and_treats_404_as_done(emu, provider):
    created = provider.create(spec())
    emu.delete_polls = 2  # the delete operation needs polling before it is done
    provider.delete(created.id, spec())
    _, path, query, _ = next(r for r in emu.requests if r[0] == "DELETE")
    assert query["force"] == "true" and path.endswith(QR)
    assert emu.state_of(QR) is None and emu.node_ids() == []
    provider.delete(created.id, spec())  # already gone: no error


def test_diff_replaces_on_immutable_changes_only(provider):
    old = spec()
    assert provider.diff(NAME, old, spec()).changes is False
    result = provider.diff(NAME, old, spec(slices=4, tags=["x"]))
    assert result.changes and result.replaces == ["slices", "tags"]
    assert result.delete_before_replace is True
    soft = provider.diff(NAME, old, spec(wait_for_active_s=99))
    assert soft.changes and soft.replaces == []


@pytest.mark.parametrize("state", ["SUSPENDED", "FAILED"])
def test_refreshed_suspended_or_failed_resource_is_replaced_on_next_up(provider, state):
    result = provider.diff(NAME, {**spec(), "state": state}, spec())
    assert result.changes and result.replaces == ["state"]
    assert provider.diff(NAME, {**spec(), "state": "ACTIVE"}, spec()).changes is False


def test_check_rejects_bad_specs_naming_the_property(provider):
    result = provider.check({}, spec(slices=0, capacity="cheap"))
    props = {f.property: f.reason for f in result.failures}
    assert "slices: value 0 is out of range" in props["slices"]
    assert "capacity: value 'cheap'" in props["capacity"]
    assert provider.check({}, spec()).failures == []


def test_check_requires_the_launch_spec_uri_and_refuses_an_inline_spec(provider):
    failures = provider.check({}, spec(metadata={"startup-script": "#"})).failures
    assert [f.property for f in failures] == ["metadata"]
    assert "metadata.launch-spec-uri None is not a gs://BUCKET/OBJECT URI" in failures[0].reason
    inline = {"startup-script": "#", "launch-spec-uri": "gs://b/launch/exp.json",
              "launch-spec": "{}"}
    [failure] = provider.check({}, spec(metadata=inline)).failures
    assert "made every change of code or trainer settings replace" in failure.reason


def test_a_replacement_waits_until_the_old_queued_resource_is_gone_before_creating(emu,
                                                                                   provider):
    created = provider.create(spec())
    emu.deleting_polls = 4  # the old request answers DELETING for a while after its operation
    provider.delete(created.id, spec())  # the replace: delete first (same id) ...
    assert emu.state_of(QR) is None  # ... returns only once GET answers 404
    gets_after_delete = [r for r in emu.requests[emu.requests.index(next(
        r for r in emu.requests if r[0] == "DELETE")):] if r[0] == "GET" and r[1].endswith(QR)]
    assert len(gets_after_delete) >= 5, gets_after_delete
    assert provider.create(spec(slices=3)).outs["state"] == "ACTIVE"  # ... then creates


def test_a_delete_that_never_finishes_fails_naming_the_resource_and_the_bound(emu, provider):
    created = provider.create(spec())
    emu.deleting_polls = 10**6
    with pytest.raises(QueuedResourceError, match=r"was still DELETING when delete_timeout_s "
                                                  r"\(1s\) ran out"):
        provider.delete(created.id, spec(delete_timeout_s=1))


def test_a_create_refused_while_the_deployers_act_as_propagates_is_retried_with_a_line_each(
        emu, provider, monkeypatch):
    lines: list[str] = []
    monkeypatch.setattr("infra.tpu_vm.provider._progress", lines.append)
    emu.inject(status=403, count=2, method="POST", path_contains="queuedResources",
               message="Permission 'iam.serviceAccounts.actAs' denied on service account")
    result = provider.create(spec(permission_retry_s=30))
    assert result.outs["state"] == "ACTIVE"
    retries = [line for line in lines if "HTTP 403" in line]
    assert len(retries) == 2, lines
    assert "retry 1 in" in retries[0] and "retry 2 in" in retries[1]
    assert "roles/iam.serviceAccountUser (actAs) on ms-exp-tpu@proj" in retries[0]


def test_a_tpu_api_enabled_seconds_ago_is_waited_for_and_named(emu, provider, monkeypatch):
    lines: list[str] = []
    monkeypatch.setattr("infra.tpu_vm.provider._progress", lines.append)
    emu.inject(status=403, count=1, method="POST", path_contains="queuedResources",
               message="Cloud TPU API has not been used in project proj before or it is disabled",
               error_info="SERVICE_DISABLED")
    assert provider.create(spec(permission_retry_s=30)).outs["state"] == "ACTIVE"
    assert any("the TPU API is not usable in this project yet" in line for line in lines), lines


def test_a_create_still_refused_after_the_bound_fails_in_one_line_naming_the_fix(emu, provider):
    emu.inject(status=403, count=1000, method="POST", path_contains="queuedResources",
               message="Permission 'iam.serviceAccounts.actAs' denied\nsecond line")
    with pytest.raises(QueuedResourceError) as err:
        provider.create(spec(permission_retry_s=0.2))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"creating queued resource {NAME} was refused with HTTP 403 for 0s")
    assert "roles/iam.serviceAccountUser (actAs) on ms-exp-tpu@proj.iam.gserviceaccount.com" \
        in message and "API said: Permission 'iam.serviceAccounts.actAs' denied" in message
    assert emu.state_of(QR) is None  # nothing was created


def test_400_and_410_like_refusals_are_not_retried_as_permissions(emu, provider):
    emu.inject(status=400, count=1, method="POST", path_contains="queuedResources")
    with pytest.raises(Exception, match="injected fault"):
        provider.create(spec(permission_retry_s=30))
    assert emu.count_requests("POST", "queuedResources") == 1


# QueuedResourceProvider() as Pulumi pickled it into a stack's state before infra/ had packages
# (serialize_provider of infra/tpu_provider.py at commit 60f5df6; infra/state_names.py answers it).
PROVIDER_IN_OLD_STATE = (
    "gASVjQAAAAAAAACMEmluZnJhLnRwdV9wcm92aWRlcpSMFlF1ZXVlZFJlc291cmNlUHJvdmlkZXKUk5QpgZR9lCiMEXJlcX"
    "Vlc3RfdGltZW91dF9zlEdATgAAAAAAAIwQcmV0cnlfZGVhZGxpbmVfc5RHQHLAAAAAAACMD3JldHJ5X2luaXRpYWxfc5RH"
    "P/AAAAAAAAB1Yi4=")


def test_a_provider_pickled_in_a_stack_state_before_the_move_still_loads():
    """`pulumi destroy` and `refresh` unpickle the provider in state: a stack created before the
    modules moved must still be able to delete its queued resource."""
    import base64

    import dill

    provider = dill.loads(base64.b64decode(PROVIDER_IN_OLD_STATE))
    assert type(provider) is QueuedResourceProvider
    assert (provider.retry_deadline_s, provider.request_timeout_s) == (300.0, 60.0)


def test_check_providers_pickled_under_their_names_before_infra_was_split_by_concern_load():
    """The preview's check-only resources moved to infra/preview/; states name the old modules."""
    import pickle

    import dill

    from infra.preview.env_check import EnvCheckProvider
    from infra.preview.network_check import NetworkCheckProvider
    from infra.preview.run_check import RunCheckProvider

    for old, cls in (("infra.preview.run_check", RunCheckProvider), ("infra.preview.env_check", EnvCheckProvider),
                     ("infra.preview.network_check", NetworkCheckProvider)):
        # what dill wrote for an instance of the class while it lived in the old module
        state = (b"\x80\x04\x95" + (0).to_bytes(8, "little") + pickle.SHORT_BINUNICODE
                 + bytes([len(old)]) + old.encode() + b"\x94" + pickle.SHORT_BINUNICODE
                 + bytes([len(cls.__name__)]) + cls.__name__.encode() + b"\x94\x93\x94)\x81\x94.")
        assert type(dill.loads(state)) is cls, old
