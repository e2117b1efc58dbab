"""`multislice status | watch | babysit | reset` against the TPU API emulator over loopback."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from scripts.cli import main as cli
from scripts.emulators.tpu_emulator import TpuEmulator

PROJECT, ZONE = "my-proj", "us-central2-b"
WHERE = ["--project", PROJECT, "--zone", ZONE]
FAST = ["--interval", "0.02"]
QUIET_BACKOFF = ["--backoff", "0.01", "--backoff-max", "0.04"]


@pytest.fixture(scope="module")
def emu():
    """One emulator for the module (stopping one takes 0.5 s); each test uses its own ids."""
    with TpuEmulator(port=0) as emulator, pytest.MonkeyPatch.context() as patch:
        patch.setenv("MULTISLICE_TPU_API_ENDPOINT", emulator.url)
        yield emulator


_IDS = itertools.count(1)


@pytest.fixture
def qr() -> str:
    """A queued resource id unique to the test."""
    return f"qr{next(_IDS)}"


def create(qr_id: str, slices: int = 2, capacity: str = "spot") -> dict[str, Any]:
    """Create a queued resource the way the Pulumi dynamic provider does; returns the request."""
    from google.cloud import tpu_v2

    from infra.tpu_vm.api import make_tpu_client
    from infra.tpu_vm.request import build_queued_resource_request

    request = build_queued_resource_request({
        "project": PROJECT, "zone": ZONE, "queued_resource_id": qr_id,
        "accelerator_type": "v4-16", "runtime_version": "tpu-ubuntu2204-base",
        "slices": slices, "node_prefix": f"{qr_id}-n", "network": "net", "subnetwork": "sub",
        "service_account_email": "trainer@my-proj.iam.gserviceaccount.com",
        "labels": {"multislice-stack": "dev"}, "tags": ["ms-dev-slice"],
        "metadata": {"startup-script": "#!/bin/bash\necho hi\n", "launch-spec": "{}"},
        "capacity": capacity,
    })
    make_tpu_client().create_queued_resource(
        tpu_v2.CreateQueuedResourceRequest(request)).result()
    return request


def create_bodies(emu: TpuEmulator, qr_id: str) -> list[Any]:
    return [body for method, path, query, body in emu.requests
            if method == "POST" and path.endswith("/queuedResources")
            and query.get("queuedResourceId") == qr_id]


def read_log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---- status ------------------------------------------------------------------------------------

def test_status_shows_the_queued_resource_and_every_node(emu, qr, capsys):
    create(qr, slices=3)
    emu.set_state(qr, "ACTIVE")
    assert cli(["status", qr, *WHERE]) == 0
    out = capsys.readouterr().out
    assert "ACTIVE" in out and "3 x v4-16" in out and "spot" in out
    for i in range(3):
        assert f"{qr}-n-{i}" in out
    assert out.count("READY") == 3 and out.count("HEALTHY") == 3


def test_status_into_a_pipe_keeps_every_id_and_row_on_one_line(emu, capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    long_id = "a-queued-resource-name-that-is-long-enough-to-fold" + "x" * 12
    create(long_id, slices=2)
    emu.set_state(long_id, "ACTIVE")
    assert cli(["status", long_id, *WHERE]) == 0  # capsys: stdout is not a terminal
    lines = capsys.readouterr().out.splitlines()
    for i in range(2):
        row = [line for line in lines if f"{long_id}-n-{i}" in line]
        assert len(row) == 1 and "READY" in row[0] and "HEALTHY" in row[0], lines


def test_status_json_reports_preempted_nodes_and_the_failure_message(emu, qr, capsys):
    create(qr)
    emu.set_state(qr, "ACTIVE")
    emu.set_state(qr, "SUSPENDING")
    assert cli(["status", qr, *WHERE, "--json"]) == 0
    snap = json.loads(capsys.readouterr().out)
    assert [n["state"] for n in snap["nodes"]] == ["PREEMPTED", "PREEMPTED"]
    emu.set_state(qr, "SUSPENDED")  # the API has deleted the nodes; the request holds quota
    assert cli(["status", qr, *WHERE, "--json"]) == 0
    snap = json.loads(capsys.readouterr().out)
    assert snap["state"] == "SUSPENDED" and snap["slices"] == 2
    assert [n["state"] for n in snap["nodes"]] == ["NOT_CREATED", "NOT_CREATED"]

    create(qr + "-b", slices=1, capacity="on-demand")
    emu.set_state(qr + "-b", "FAILED", error="no v4 capacity in us-central2-b " + "x" * 120)
    assert cli(["status", qr + "-b", *WHERE, "--json"]) == 0
    snap = json.loads(capsys.readouterr().out)
    assert snap["state"] == "FAILED" and "no v4 capacity in us-central2-b" in snap["detail"]
    assert snap["capacity"] == "on-demand"
    assert [(n["node_id"], n["state"]) for n in snap["nodes"]] == [(f"{qr}-b-n", "NOT_CREATED")]


def test_status_survives_transient_api_errors(emu, qr, capsys):
    create(qr)
    emu.inject(status=503, count=2, method="GET", path_contains=f"queuedResources/{qr}")
    assert cli(["status", qr, *WHERE]) == 0
    assert f"{qr}-n-0" in capsys.readouterr().out


def test_status_of_a_missing_resource_exits_1(emu, capsys):
    assert cli(["status", "nope", *WHERE]) == 1
    assert "NOT_FOUND" in capsys.readouterr().out


def test_stack_config_names_the_queued_resource(emu, qr, tmp_path, capsys):
    stack = tmp_path / "Pulumi.dev.yaml"
    stack.write_text(
        "config:\n"
        f"  multislice:project: {PROJECT}\n  multislice:region: us-central2\n"
        f"  multislice:zone: {ZONE}\n  multislice:accelerator_type: v4-16\n"
        "  multislice:slices: 2\n  multislice:experiment_dir: experiments/missing\n"
    )
    create("ms-dev-qr")
    assert cli(["status", "--stack-config", str(stack)]) == 0
    assert "ms-dev-qr-n-1" in capsys.readouterr().out


def test_invalid_stack_config_or_missing_arguments_exit_2(emu, tmp_path, capsys):
    assert cli(["status", "--project", PROJECT]) == 2
    err = capsys.readouterr().err
    assert "--zone" in err and "QUEUED_RESOURCE_ID" in err and "--stack-config" in err
    bad = tmp_path / "Pulumi.dev.yaml"
    bad.write_text(f"config:\n  multislice:project: {PROJECT}\n  multislice:slices: 300\n")
    assert cli(["status", "--stack-config", str(bad)]) == 2
    assert "zone" in capsys.readouterr().err


# ---- watch -------------------------------------------------------------------------------------

def test_watch_follows_every_state_until_active(emu, qr, capsys):
    emu.script(qr, [("ACCEPTED", 2), ("WAITING_FOR_RESOURCES", 2), ("PROVISIONING", 1),
                       ("ACTIVE", None)])
    create(qr)
    assert cli(["watch", qr, *WHERE, *FAST, "--timeout", "20"]) == 0
    lines = [line.split()[-1] for line in capsys.readouterr().out.splitlines()]
    assert lines == ["CREATING", "ACCEPTED", "WAITING_FOR_RESOURCES", "PROVISIONING", "ACTIVE"]


def test_watch_stops_on_failed_with_the_api_message(emu, qr, capsys):
    emu.script(qr, [("ACCEPTED", 1), ("FAILED", None)], error="stockout")
    create(qr)
    assert cli(["watch", qr, *WHERE, *FAST, "--timeout", "20"]) == 3
    assert "FAILED (stockout" in capsys.readouterr().out


def test_watch_gives_up_after_the_timeout(emu, qr, capsys):
    emu.script(qr, [("WAITING_FOR_RESOURCES", None)])
    create(qr)
    assert cli(["watch", qr, *WHERE, "--interval", "0.05", "--timeout", "0.3"]) == 4
    out = capsys.readouterr().out
    assert "still WAITING_FOR_RESOURCES" in out and "--timeout 0.3" in out


# ---- babysit -----------------------------------------------------------------------------------

@pytest.mark.parametrize("bad_state", ["FAILED", "SUSPENDED"])
def test_babysit_recreates_a_broken_resource_with_the_same_spec(emu, qr, tmp_path, bad_state):
    create(qr)
    emu.set_state(qr, "ACTIVE")
    emu.set_state(qr, bad_state, error="maintenance event")
    log = tmp_path / "actions.jsonl"
    code = cli(["babysit", qr, *WHERE, *FAST, *QUIET_BACKOFF, "--until-active",
                "--timeout", "30", "--log", str(log)])
    assert code == 0
    first, second = create_bodies(emu, qr)
    assert second == first  # the very same request, including metadata, labels and capacity
    assert emu.state_of(qr) == "ACTIVE"
    entries = read_log(log)
    actions = [e["action"] for e in entries]
    assert actions[:5] == ["start", "observe", "delete", "backoff", "create"]
    assert actions[-1] == "done"
    delete = entries[actions.index("delete")]
    assert delete["state"] == bad_state and "holds quota" in delete["reason"]
    assert all(e["reason"] and e["queued_resource"].endswith(f"/{qr}") for e in entries)
    assert emu.count_requests("DELETE", f"queuedResources/{qr}") == 1


def test_babysit_gives_up_after_max_retries_with_exponential_backoff(emu, qr, tmp_path, capsys):
    emu.script(qr, [("ACCEPTED", 1), ("FAILED", None)], error="stockout")
    create(qr)
    log = tmp_path / "actions.jsonl"
    code = cli(["babysit", qr, *WHERE, *FAST, "--max-retries", "3", "--backoff", "0.01",
                "--backoff-max", "0.03", "--timeout", "60", "--log", str(log)])
    assert code == 3
    assert len(create_bodies(emu, qr)) == 1 + 3
    entries = read_log(log)
    assert [e["seconds"] for e in entries if e["action"] == "backoff"] == [0.01, 0.02, 0.03]
    assert entries[-1]["action"] == "give_up" and "--max-retries 3" in entries[-1]["reason"]
    assert "give_up" in capsys.readouterr().out  # timestamped lines on the console too


def test_babysit_cancels_a_request_waiting_past_its_deadline(emu, qr, tmp_path):
    emu.create_polls = 0  # the 1 s deadline counts from create_time: no slow create before it
    emu.script(qr, [("WAITING_FOR_RESOURCES", None)])  # after CREATING, the first GET
    create(qr)
    log = tmp_path / "actions.jsonl"
    code = cli(["babysit", qr, *WHERE, "--interval", "0.1", "--max-wait", "1",
                "--timeout", "30", "--log", str(log)])
    assert code == 4
    assert emu.state_of(qr) is None  # deleted, so it stops queueing for capacity
    cancel = read_log(log)[-1]
    assert cancel["action"] == "cancel" and cancel["state"] == "WAITING_FOR_RESOURCES"
    assert cancel["waited_s"] >= 1 and "--max-wait 1s" in cancel["reason"]


def test_babysit_leaves_a_healthy_resource_alone(emu, qr, tmp_path):
    create(qr)
    emu.set_state(qr, "ACTIVE")
    log = tmp_path / "actions.jsonl"
    assert cli(["babysit", qr, *WHERE, *FAST, "--timeout", "0.3", "--log", str(log)]) == 0
    assert [e["action"] for e in read_log(log)] == ["start", "observe", "stop"]
    assert emu.count_requests("DELETE", f"/{qr}") == 0 and len(create_bodies(emu, qr)) == 1


def test_babysit_without_a_resource_or_spec_exits_1(emu, capsys):
    assert cli(["babysit", "nope", *WHERE, *FAST, "--timeout", "5"]) == 1
    assert "pulumi up" in capsys.readouterr().out
    assert cli(["babysit", "nope", *WHERE, *FAST, "--timeout", "5", "--recreate-missing"]) == 1
    assert "--stack-config" in capsys.readouterr().out
    assert create_bodies(emu, "nope") == []


def test_babysit_never_undoes_a_deletion_made_outside_it(emu, qr, tmp_path):
    """`pulumi destroy` while babysit runs: the resource must stay gone."""
    import threading

    create(qr)
    emu.script(qr, [("ACTIVE", 3), ("DELETING", None)])

    def destroy_soon() -> None:
        from infra.tpu_vm.api import make_tpu_client

        while emu.state_of(qr) != "DELETING":
            threading.Event().wait(0.01)
        make_tpu_client().delete_queued_resource(
            request={"name": f"projects/{PROJECT}/locations/{ZONE}/queuedResources/{qr}",
                     "force": True}).result()

    destroyer = threading.Thread(target=destroy_soon)
    destroyer.start()
    log = tmp_path / "actions.jsonl"
    code = cli(["babysit", qr, *WHERE, *FAST, "--timeout", "30", "--log", str(log)])
    destroyer.join()
    assert code == 1
    assert emu.state_of(qr) is None and len(create_bodies(emu, qr)) == 1
    assert "deleted outside babysit" in read_log(log)[-1]["reason"]


# ---- reset -------------------------------------------------------------------------------------

def test_reset_restarts_every_vm_of_an_active_resource(emu, qr, tmp_path):
    create(qr)
    emu.set_state(qr, "ACTIVE")
    log = tmp_path / "actions.jsonl"
    assert cli(["reset", qr, *WHERE, "--log", str(log)]) == 0
    assert emu.count_requests("POST", f"queuedResources/{qr}:reset") == 1
    assert emu.resets[qr] == 1
    assert emu.state_of(qr) == "ACTIVE"  # the request stays; its VMs were restarted
    entries = read_log(log)
    assert [e["action"] for e in entries] == ["reset", "reset_done"]
    assert "startup script runs again" in entries[1]["reason"]


@pytest.mark.parametrize("state", ["SUSPENDED", "FAILED", "WAITING_FOR_RESOURCES"])
def test_reset_of_a_resource_that_is_not_active_is_refused_before_calling_the_api(
        emu, qr, capsys, state):
    create(qr)
    emu.set_state(qr, state)
    assert cli(["reset", qr, *WHERE]) == 1
    out = capsys.readouterr().out
    assert emu.count_requests("POST", f"queuedResources/{qr}:reset") == 0
    assert "reset_failed" in out and f"state is {state}" in out and "ACTIVE" in out
    if state in ("SUSPENDED", "FAILED"):
        assert "multislice babysit" in out


def test_babysit_rebuilds_a_missing_resource_from_the_stack_config(emu, tmp_path):
    from infra.packaging.archive import build_archive

    (tmp_path / "Pulumi.yaml").write_text("name: multislice\n")
    experiment = tmp_path / "experiments" / "demo"
    (experiment / "configs").mkdir(parents=True)
    (experiment / "trainer").mkdir()
    (experiment / "pyproject.toml").write_text('[project]\nname = "demo"\n')
    (experiment / "trainer" / "main.py").write_text("print('train')\n")
    stacks = tmp_path / "stacks"
    stacks.mkdir()
    stack = stacks / "Pulumi.rebuilt.yaml"
    stack.write_text(
        "config:\n"
        f"  multislice:project: {PROJECT}\n  multislice:region: us-central2\n"
        f"  multislice:zone: {ZONE}\n  multislice:accelerator_type: v4-16\n"
        "  multislice:slices: 3\n  multislice:capacity: spot\n"
        "  multislice:experiment_dir: experiments/demo\n"
    )
    log = tmp_path / "actions.jsonl"
    code = cli(["babysit", "--stack-config", str(stack), *FAST, *QUIET_BACKOFF,
                "--until-active", "--recreate-missing", "--timeout", "30", "--log", str(log)])
    assert code == 0
    (body,) = create_bodies(emu, "ms-rebuilt-qr")
    node_spec = body["tpu"]["nodeSpec"][0]
    assert node_spec["multisliceParams"] == {"nodeCount": 3, "nodeIdPrefix": "ms-rebuilt"}
    assert "spot" in body
    # The VMs read the launch spec that `pulumi up` wrote; the request names where it is.
    assert node_spec["node"]["metadata"]["launch-spec-uri"] == \
        f"gs://{PROJECT}-ms-rebuilt/launch/rebuilt.json"
    [spec_line] = [e for e in read_log(log) if e["action"] == "spec"]
    assert build_archive(experiment).sha256[:12] in spec_line["reason"]
    actions = [e["action"] for e in read_log(log)]
    assert actions[:4] == ["start", "spec", "observe", "backoff"] and "create" in actions


def test_status_shows_which_spec_each_host_runs_from_their_reports(emu, tmp_path, capsys,
                                                                   monkeypatch):
    from scripts.emulators.gcs_emulator import GcsEmulator

    stack = tmp_path / "Pulumi.upd.yaml"
    stack.write_text(
        "config:\n"
        f"  multislice:project: {PROJECT}\n  multislice:region: us-central2\n"
        f"  multislice:zone: {ZONE}\n  multislice:accelerator_type: v4-16\n"
        "  multislice:slices: 2\n  multislice:experiment_dir: experiments/missing\n"
    )
    create("ms-upd-qr")
    bucket, new_sha, old_sha = f"{PROJECT}-ms-upd", "b" * 64, "a" * 64
    with GcsEmulator() as gcs:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.url)
        gcs.create_bucket(bucket)
        gcs.put(bucket, "launch/upd.json", json.dumps({"archive_sha256": old_sha}).encode())
        old_gen = gcs.metadata(bucket, "launch/upd.json")["generation"]
        gcs.put(bucket, "launch/upd.json", json.dumps({"archive_sha256": new_sha}).encode())
        new_gen = gcs.metadata(bucket, "launch/upd.json")["generation"]
        for host, gen, sha, state in (("ms-upd-0-w-0", new_gen, new_sha, "running"),
                                      ("ms-upd-1-w-0", old_gen, old_sha, "running"),
                                      ("ms-upd-1-w-1", new_gen, new_sha, "failed")):
            gcs.put(bucket, f"runs/upd/logs/{host}.spec", json.dumps(
                {"host": host, "generation": gen, "archive_sha256": sha, "state": state,
                 "time": "2026-12-02T00:00:00Z"}).encode())
        gcs.put(bucket, "runs/upd/logs/ms-upd-0-w-0.log", b"not a report")
        # a failed host's reason is the last ERROR line of its start-up log (its tail only)
        gcs.put(bucket, "runs/upd/logs/ms-upd-1-w-1.startup.log", b"x" * 100_000 + (
            b"\n2026-12-02T00:00:00Z multislice-startup: ERROR: step 3 (environment): the "
            b"index answered HTTP 403 [for the hosts' account]\n"
            b"2026-12-02T00:00:01Z multislice-startup: waiting for a new launch spec\n"))
        assert cli(["status", "--stack-config", str(stack)]) == 0
        out = capsys.readouterr().out
        assert f"launch spec gs://{bucket}/launch/upd.json: generation {new_gen}, code " \
            f"{new_sha[:12]}; on 2 of 3 reporting hosts" in out, out
        assert f"{old_gen} (old)" in out and "ms-upd-1-w-0" in out
        assert cli(["status", "--stack-config", str(stack), "--json"]) == 0
        report = json.loads(capsys.readouterr().out)["launch_spec"]
        assert [(h["host"], h["current"]) for h in report["hosts"]] == [
            ("ms-upd-0-w-0", True), ("ms-upd-1-w-0", False), ("ms-upd-1-w-1", True)]
        assert [h["error"] for h in report["hosts"]] == [
            "", "", "ERROR: step 3 (environment): the index answered HTTP 403 [for the hosts' "
                    "account]"]
    # Without a reachable bucket the queued resource is still shown, with the reason.
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")
    assert cli(["status", "--stack-config", str(stack)]) == 0
    assert "cannot read the bucket" in capsys.readouterr().out
