"""`multislice status | watch` of a GKE stack: the official Kubernetes client against kmock's
in-memory Kubernetes API server (the real REST protocol over loopback), and the GCS emulator for
the pods' spec reports."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from scripts.cli import main as cli
from scripts.emulators import kube_api as emulated_api
from scripts.emulators.gcs_emulator import GcsEmulator

JOBSETS, PODS = emulated_api.JOBSETS, emulated_api.PODS
NS, NAME = "ms-gk", "ms-gk"
BUCKET = "my-proj-ms-gk"


class KubeApi(emulated_api.KubeApi):
    """The emulator with this module's namespace as the default."""

    def put(self, resource: Any, name: str, body: dict[str, Any],
            namespace: str | None = NS) -> None:
        super().put(resource, name, body, namespace)

    def remove(self, resource: Any, name: str, namespace: str | None = NS) -> None:
        super().remove(resource, name, namespace)


def jobset(restarts: int = 0, conditions: list[dict[str, Any]] | None = None,
           towards_max: int | None = None) -> dict[str, Any]:
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": {"name": NAME, "namespace": NS},
            "spec": {"failurePolicy": {"maxRestarts": 3},
                     "replicatedJobs": [{"name": "slice", "replicas": 2, "template": {
                         "spec": {"parallelism": 2, "completions": 2}}}]},
            "status": {"restarts": restarts, "conditions": conditions or [],
                       "restartsCountTowardsMax": restarts if towards_max is None
                       else towards_max}}


def pod(slice_index: int, index: int, phase: str = "Running", ready: bool = True,
        jobset_name: str = NAME, exit_code: int | None = None) -> dict[str, Any]:
    name = f"{jobset_name}-slice-{slice_index}-{index}-x7k2q"
    state = {} if exit_code is None else {"state": {"terminated": {"exitCode": exit_code}}}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": {
                "jobset.sigs.k8s.io/jobset-name": jobset_name,
                "jobset.sigs.k8s.io/job-index": str(slice_index),
                "batch.kubernetes.io/job-completion-index": str(index)}},
            "spec": {"nodeName": f"gke-tpu-{slice_index}{index}", "containers": [
                {"name": "trainer", "image": "i"}]},
            "status": {"phase": phase, "containerStatuses": [
                {"name": "trainer", "ready": ready, "restartCount": 0, "image": "i",
                 "imageID": "", "started": True, **state}]}}


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[KubeApi, GcsEmulator]]:
    with KubeApi() as api, GcsEmulator() as gcs, pytest.MonkeyPatch.context() as patch:
        patch.delenv("COLUMNS", raising=False)  # into a pipe: every row on one line
        patch.setenv("MULTISLICE_KUBERNETES_API", api.url)
        patch.setenv("STORAGE_EMULATOR_HOST", gcs.url)
        gcs.create_bucket(BUCKET)
        # A real API server lists no pods as an empty list; kmock answers 404 for a resource and
        # namespace it has never held. One pod put and taken out makes it answer as the real one.
        api.put(PODS, "placeholder", pod(9, 9, jobset_name="placeholder"))
        api.remove(PODS, "placeholder")
        yield api, gcs


@pytest.fixture
def stack(tmp_path: Path) -> Path:
    path = tmp_path / "Pulumi.gk.yaml"
    path.write_text(
        "config:\n  multislice:project: my-proj\n  multislice:region: us-central1\n"
        "  multislice:zone: us-central1-a\n  multislice:accelerator_type: v5litepod-8\n"
        "  multislice:slices: 2\n  multislice:experiment_dir: experiments/missing\n"
        "  multislice:orchestration: gke\n  multislice:gke:\n"
        "    cluster: projects/my-proj/locations/us-central1/clusters/c\n"
        f"    image: r/i@sha256:{'a' * 64}\n")
    return path


def test_status_shows_the_jobset_its_restarts_and_each_pod_with_its_spec(cluster, stack, capsys):
    api, gcs = cluster
    api.put(JOBSETS, NAME, jobset(restarts=1))
    for s in range(2):
        for p in range(2):
            ready = (s, p) != (1, 1)
            api.put(PODS, f"{NAME}-slice-{s}-{p}", pod(s, p, "Running" if ready else "Pending",
                                                      ready))
    api.put(PODS, "other", pod(0, 0, jobset_name="another-job"))  # not this JobSet's
    gcs.put(BUCKET, "launch/gk.json", json.dumps({"archive_sha256": "c" * 64}).encode())
    generation = gcs.metadata(BUCKET, "launch/gk.json")["generation"]
    gcs.put(BUCKET, f"runs/gk/logs/{NAME}-slice-0-0.spec", json.dumps(
        {"host": f"{NAME}-slice-0-0", "generation": generation, "archive_sha256": "c" * 64,
         "state": "running", "time": "2026-12-04T00:00:00Z"}).encode())

    assert cli(["status", "--stack-config", str(stack)]) == 0
    out = capsys.readouterr().out
    summary = [" ".join(line.split()) for line in out.splitlines()[:4]]
    assert summary == [f"JobSet {NS}/{NAME}", "state Running",
                       "restarts 1 (JobSet recreated every pod this often); 1 of max_restarts 3 "
                       "used (disruptions do not count)",
                       "pods 3 of 2 x 2 running and ready"], out
    assert "another-job" not in out
    assert f"{NAME}-slice-1-1-x7k2q" in out and "Pending" in out
    assert f"launch spec gs://{BUCKET}/launch/gk.json: generation {generation}" in out

    assert cli(["status", "--stack-config", str(stack), "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert (payload["state"], payload["restarts"], payload["slices"],
            payload["pods_per_slice"]) == ("Running", 1, 2, 2)
    rows = [(p["slice"], p["index"], p["phase"], p["ready"], p["spec_state"])
            for p in payload["pods"]]
    assert rows == [(0, 0, "Running", True, "running"), (0, 1, "Running", True, ""),
                    (1, 0, "Running", True, ""), (1, 1, "Pending", False, "")]


def test_watch_follows_the_jobset_until_every_pod_is_ready(cluster, stack, capsys):
    api, _ = cluster
    api.put(JOBSETS, NAME, jobset(restarts=2))
    for s in range(2):
        for p in range(2):
            api.put(PODS, f"{NAME}-slice-{s}-{p}", pod(s, p, "Pending", False))

    served = len(api.emulator)  # requests kmock answered so far

    def become_ready() -> None:
        deadline = time.monotonic() + 30
        while len(api.emulator) < served + 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # until watch's first poll (the JobSet, then its pods) is answered
        for s in range(2):
            for p in range(2):
                api.put(PODS, f"{NAME}-slice-{s}-{p}", pod(s, p))

    helper = threading.Thread(target=become_ready)
    helper.start()
    code = cli(["watch", "--stack-config", str(stack), "--interval", "0.1", "--timeout", "30"])
    helper.join()
    out = capsys.readouterr().out
    assert code == 0, out
    lines = [line.split(": ", 1)[1] for line in out.splitlines()]
    assert lines[0] == "Pending, 0 of 4 pods ready, restarts 2"
    assert lines[-1] == "Running, 4 of 4 pods ready, restarts 2"


def test_watch_of_a_failed_jobset_exits_3_with_its_reason(cluster, stack, capsys):
    api, _ = cluster
    api.put(JOBSETS, NAME, jobset(restarts=0, conditions=[
        {"type": "Failed", "status": "True", "reason": "FailedJobs",
         "message": "jobset failed due to PodFailurePolicy"}]))
    assert cli(["watch", "--stack-config", str(stack), "--interval", "0.1"]) == 3
    assert "Failed (FailedJobs)" in capsys.readouterr().out


def test_status_of_a_missing_jobset_exits_1_and_says_where_it_looked(cluster, stack, capsys):
    api, _ = cluster
    api.put(JOBSETS, NAME, jobset())
    api.remove(JOBSETS, NAME)
    assert cli(["status", "--stack-config", str(stack)]) == 1
    assert f"JobSet {NS}/{NAME}: NOT_FOUND" in capsys.readouterr().out


def test_reset_of_a_gke_stack_is_refused_in_one_line(stack, capsys):
    assert cli(["reset", "--stack-config", str(stack)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "runs on GKE" in err[0] and "multislice babysit" in err[0], err


def _failed_jobset() -> dict[str, Any]:
    failed = jobset(restarts=3, conditions=[{
        "type": "Failed", "status": "True", "reason": "ReachedMaxRestarts",
        "message": "jobset failed due to reaching max number of restarts"}])
    failed["metadata"].update({"uid": "u-1", "resourceVersion": "77", "labels": {"a": "b"},
                               "annotations": {"multislice.dev/launch-spec-sha256": "c" * 64},
                               "managedFields": [{"manager": "pulumi-kubernetes"}]})
    return failed


def test_babysit_recreates_a_failed_jobset_as_applied_and_logs_each_action(
        cluster, stack, tmp_path, capsys):
    api, _ = cluster
    api.put(JOBSETS, NAME, _failed_jobset())
    log = tmp_path / "babysit.jsonl"
    assert cli(["babysit", "--stack-config", str(stack), "--backoff", "0", "--interval", "0.1",
                "--timeout", "1", "--max-retries", "2", "--log", str(log)]) == 0
    out = capsys.readouterr().out
    actions = [json.loads(line) for line in log.read_text().splitlines()]
    assert [a["action"] for a in actions][:5] == ["start", "observe", "backoff", "delete",
                                                  "create"], out
    assert actions[1]["reason"] == "JobSet Failed (ReachedMaxRestarts), restarts 3"
    assert all(a["jobset"] == f"{NS}/{NAME}" for a in actions)
    created = [a for a in actions if a["action"] == "create"]
    assert len(created) == 1 and created[0]["seconds"] < 30
    # timestamped lines on the console, one per action
    assert sum(" create " in line for line in out.splitlines()) == 1
    # the same object, without what the server added; the spec file says the create went through
    recreated = api.get(JOBSETS, NAME, NS)
    assert recreated["metadata"]["annotations"] == {
        "multislice.dev/launch-spec-sha256": "c" * 64}
    assert recreated["metadata"]["labels"] == {"a": "b"} and "status" not in recreated
    assert recreated["spec"] == jobset()["spec"]
    assert "uid" not in recreated["metadata"] or recreated["metadata"]["uid"] != "u-1"
    doc = json.loads((tmp_path / "babysit.jsonl.spec.json").read_text())
    assert doc["pending_create"] is False and doc["jobset"] == f"{NS}/{NAME}"


def test_babysit_gives_up_after_max_retries_and_leaves_a_finished_run_alone(
        cluster, stack, capsys):
    api, _ = cluster
    api.put(JOBSETS, NAME, _failed_jobset())
    assert cli(["babysit", "--stack-config", str(stack), "--max-retries", "0"]) == 3
    assert "give_up" in capsys.readouterr().out
    api.put(JOBSETS, NAME, jobset(conditions=[{"type": "Completed", "status": "True",
                                               "reason": "AllJobsCompleted"}]))
    assert cli(["babysit", "--stack-config", str(stack)]) == 0
    assert "the run finished (JobSet Completed)" in capsys.readouterr().out


def test_babysit_finishes_a_recreation_a_previous_run_left_between_delete_and_create(
        cluster, stack, tmp_path, capsys):
    from scripts.gke.babysit import _save, recreate_body

    api, _ = cluster
    api.put(JOBSETS, NAME, jobset())
    api.remove(JOBSETS, NAME)
    spec_file = tmp_path / "spec.json"
    _save(spec_file, recreate_body(_failed_jobset()), pending=True)
    assert cli(["babysit", "--stack-config", str(stack), "--spec-file", str(spec_file),
                "--timeout", "0.5", "--interval", "0.1"]) == 0
    assert "a previous run deleted it and did not finish the create" in capsys.readouterr().out
    assert json.loads(spec_file.read_text())["pending_create"] is False
    recreated = api.get(JOBSETS, NAME, NS)
    assert recreated["metadata"]["labels"] == {"a": "b"}


@pytest.mark.parametrize("edit", [
    lambda body: body["metadata"].update(name="another-teams-run"),
    lambda body: body.update(kind="Deployment", apiVersion="apps/v1"),
    lambda body: body["metadata"].update(namespace="kube-system"),
    lambda body: body.pop("spec"),
], ids=["other name", "other kind", "other namespace", "no spec"])
def test_babysit_creates_only_the_stacks_jobset_from_a_spec_file(cluster, stack, tmp_path,
                                                                  capsys, edit):
    from scripts.gke.babysit import _save, recreate_body

    api, _ = cluster
    api.put(JOBSETS, NAME, jobset())
    api.remove(JOBSETS, NAME)
    spec_file = tmp_path / "spec.json"
    body = recreate_body(_failed_jobset())
    _save(spec_file, body, pending=True)
    doc = json.loads(spec_file.read_text())
    edit(doc["object"])  # the file says it is this JobSet's; its object is something else
    spec_file.write_text(json.dumps(doc))
    assert cli(["babysit", "--stack-config", str(stack), "--spec-file", str(spec_file),
                "--timeout", "0.5", "--interval", "0.1"]) == 2
    out = capsys.readouterr().out
    assert f"not the JobSet {NS}/{NAME}" in out and "it creates nothing else" in out
    assert api.get(JOBSETS, NAME, NS) is None


@pytest.mark.parametrize("url", ["127.0.0.1:1", "http://", "http://127.0.0.1:port",
                                 "ftp://127.0.0.1:1", "http://127.0.0.1:1 x",
                                 "http://" + "h" * 8_000_000],
                         ids=lambda url: url if len(url) < 40 else f"{len(url)} characters")
def test_a_malformed_kubernetes_api_setting_is_a_usage_error_of_one_bounded_line(
        stack, capsys, monkeypatch, url):
    monkeypatch.setenv("MULTISLICE_KUBERNETES_API", url)
    assert cli(["status", "--stack-config", str(stack)]) == 2  # docs/CONTRACTS.md: bad setting
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "MULTISLICE_KUBERNETES_API=" in err[0], err
    assert "http://HOST:PORT" in err[0] and len(err[0]) < 400, err[0][:400]


def test_a_jobset_of_another_shape_under_the_stacks_name_is_named_not_blamed_on_the_api(
        cluster, stack, capsys):
    api, _ = cluster
    other = jobset()
    other["spec"]["replicatedJobs"].append({"name": "driver", "replicas": 1, "template": {
        "spec": {"parallelism": 1, "completions": 1}}})
    api.put(JOBSETS, NAME, other)
    try:
        assert cli(["status", "--stack-config", str(stack)]) == 1
    finally:
        api.remove(JOBSETS, NAME)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"JobSet {NS}/{NAME} has 2 replicated jobs ['slice', 'driver']" in err[0], err
    assert "another tool's JobSet" in err[0] and "unpack" not in err[0], err


def test_an_unreachable_kubernetes_api_is_one_line(stack, capsys, monkeypatch):
    monkeypatch.setenv("MULTISLICE_KUBERNETES_API", "http://127.0.0.1:1")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:1")
    assert cli(["status", "--stack-config", str(stack), "--request-timeout", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the Kubernetes API failed for JobSet ms-gk" in err[0], err


def test_a_gke_stack_without_google_credentials_is_one_line_naming_the_fix(
        stack, capsys, monkeypatch, tmp_path):
    for key in [k for k in os.environ if k.startswith(("GOOGLE_", "CLOUDSDK_"))]:
        monkeypatch.delenv(key)
    monkeypatch.delenv("MULTISLICE_KUBERNETES_API", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no gcloud credentials file
    monkeypatch.setenv("GCE_METADATA_HOST", "127.0.0.1:9")  # and no metadata server
    monkeypatch.setenv("GCE_METADATA_IP", "127.0.0.1:9")
    for command in ("status", "babysit"):
        assert cli([command, "--stack-config", str(stack), "--timeout", "1"]
                   if command == "babysit" else [command, "--stack-config", str(stack)]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "no Google credentials on this machine" in err[0], err
        assert "gcloud auth application-default login" in err[0]


def _failed_by_exit_2(api: KubeApi, gcs: GcsEmulator) -> None:
    """A JobSet its deterministic-exit rule failed: pod 0-1's trainer exited 2, and its log in
    the bucket ends with the trainer's error line."""
    failed = jobset(restarts=1, towards_max=0, conditions=[{
        "type": "Failed", "status": "True", "reason": "FailJobSetFailurePolicyAction",
        "message": "failed by rule deterministic_exit"}])
    failed["metadata"]["uid"] = "u-exit-2"
    api.put(JOBSETS, NAME, failed)
    for s in range(2):
        for p in range(2):
            api.put(PODS, f"{NAME}-slice-{s}-{p}", pod(
                s, p, "Failed" if (s, p) == (0, 1) else "Running",
                exit_code=2 if (s, p) == (0, 1) else None))
    gcs.put(BUCKET, f"runs/gk/logs/{NAME}-slice-0-1.log",
            b"step 1 loss 2.3\n" * 5000 + b"Traceback (most recent call last):\n  x\n"
            b"error: mesh: ici_fsdp 16 x dcn_data 2 is 32 devices, the job has 16\n")


def test_status_of_a_failed_jobset_names_the_pod_its_exit_code_error_line_and_log(
        cluster, stack, capsys):
    api, gcs = cluster
    _failed_by_exit_2(api, gcs)
    assert cli(["status", "--stack-config", str(stack)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "0 of max_restarts 3 used" in out
    assert (f"pod {NAME}-slice-0-1-x7k2q (exit 2): error: mesh: ici_fsdp 16 x dcn_data 2 is 32 "
            f"devices, the job has 16; log: gs://{BUCKET}/runs/gk/logs/{NAME}-slice-0-1.log"
            ) in out, out
    assert cli(["watch", "--stack-config", str(stack), "--interval", "0.1"]) == 3
    assert "(exit 2): error: mesh" in capsys.readouterr().out


def test_babysit_stops_on_a_jobset_failed_by_exit_2_instead_of_recreating_it(
        cluster, stack, tmp_path, capsys):
    api, gcs = cluster
    _failed_by_exit_2(api, gcs)
    log = tmp_path / "babysit.jsonl"
    assert cli(["babysit", "--stack-config", str(stack), "--backoff", "0", "--interval", "0.1",
                "--timeout", "1", "--max-retries", "5", "--log", str(log)]) == 3
    actions = [json.loads(line) for line in log.read_text().splitlines()]
    assert [a["action"] for a in actions] == ["start", "observe", "give_up"]
    assert "(exit 2): error: mesh" in actions[-1]["reason"]
    assert api.get(JOBSETS, NAME, NS)["metadata"]["uid"] == "u-exit-2"  # nothing deleted


def test_babysit_never_deletes_a_jobset_someone_else_recreated(cluster, stack, tmp_path):
    # Between babysit's read of the Failed JobSet and its delete, another babysitter (or
    # `pulumi up`) deletes it and creates it again: the delete's UID precondition spares theirs.
    from kubernetes import client

    from scripts.gke.babysit import babysit_jobset
    from scripts.tpu.babysit import ActionLog, BabysitPolicy

    api, _ = cluster
    api.put(JOBSETS, NAME, _failed_jobset())
    theirs: dict[str, Any] = {}
    custom = client.CustomObjectsApi(client.ApiClient(client.Configuration(host=api.url)))

    def someone_else_recreates(_seconds: float) -> None:
        if api.get(JOBSETS, NAME, NS)["metadata"].get("uid") == "u-1":
            custom.delete_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", NS,
                                                   "jobsets", NAME)
            custom.create_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", NS,
                                                   "jobsets", jobset())
            theirs.update(api.get(JOBSETS, NAME, NS))

    conf = client.Configuration(host=api.url)
    policy = BabysitPolicy(interval_s=0.1, max_retries=2, backoff_s=0, backoff_max_s=0,
                           timeout_s=0.5, spec_file=tmp_path / "spec.json")
    log = tmp_path / "log.jsonl"
    code = babysit_jobset(client.ApiClient(conf), NS, NAME, policy,
                          ActionLog(_Quiet(), log, subject="jobset"),
                          sleep=someone_else_recreates)
    assert code == 0
    reasons = [json.loads(line)["reason"] for line in log.read_text().splitlines()]
    assert any("no longer the Failed one" in r for r in reasons), reasons
    kept = api.get(JOBSETS, NAME, NS)
    assert kept["metadata"]["uid"] == theirs["metadata"]["uid"] not in ("u-1", None)
    assert not any(json.loads(line)["action"] == "create"
                   for line in log.read_text().splitlines())


def test_babysit_takes_already_exists_for_someone_elses_recreation(cluster):
    from kubernetes import client

    from scripts.gke.babysit import _create

    api, _ = cluster
    api.put(JOBSETS, NAME, jobset())
    custom = client.CustomObjectsApi(client.ApiClient(client.Configuration(host=api.url)))
    body = jobset()
    body.pop("status")
    assert _create(custom, NS, body) is False


def test_watch_of_a_completed_jobset_exits_0(cluster, stack, capsys):
    api, _ = cluster
    api.put(JOBSETS, NAME, jobset(conditions=[{"type": "Completed", "status": "True",
                                               "reason": "AllJobsCompleted"}]))
    assert cli(["watch", "--stack-config", str(stack), "--interval", "0.1",
                "--timeout", "5"]) == 0
    assert "Completed (AllJobsCompleted)" in capsys.readouterr().out


class _Quiet:
    def print(self, *args: Any, **kwargs: Any) -> None:
        pass


# ---- Kueue's word: admitted, pending (why, where in the queue), evicted (by what) ----


def workload(name: str, jobset_name: str, namespace: str, queue: str, priority: int,
             created: str, conditions: list[dict[str, Any]],
             admission: dict[str, Any] | None = None) -> dict[str, Any]:
    """A Kueue Workload as Kueue v0.19 writes one for a JobSet (kueue.x-k8s.io/v1beta1)."""
    return {"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "Workload",
            "metadata": {"name": name, "namespace": namespace, "creationTimestamp": created,
                         "ownerReferences": [{"apiVersion": "jobset.x-k8s.io/v1alpha2",
                                              "kind": "JobSet", "name": jobset_name,
                                              "uid": f"uid-{jobset_name}"}]},
            "spec": {"queueName": queue, "priority": priority,
                     **({"priorityClassName": "high"} if priority >= 1000 else {}),
                     "podSets": [{"name": "slice", "count": 8, "template": {"spec": {
                         "nodeSelector": {"cloud.google.com/gke-tpu-accelerator":
                                          "tpu-v5-lite-podslice",
                                          "cloud.google.com/gke-tpu-topology": "4x4"},
                         "containers": [{"name": "trainer", "resources": {
                             "requests": {"google.com/tpu": 4}}}]}}}]},
            "status": {"conditions": conditions, **({"admission": admission} if admission
                                                     else {})}}


PENDING = [{"type": "QuotaReserved", "status": "False", "reason": "Pending",
            "message": "couldn't assign flavors to pod set slice: insufficient unused quota "
                       "for google.com/tpu in flavor ms-plat-v5e16, 16 more needed"}]


def test_status_and_queue_say_what_kueue_says_of_each_workload(cluster, tmp_path, capsys):
    from scripts.emulators.kube_api import LOCAL_QUEUES, WORKLOADS

    api, _ = cluster
    stack = tmp_path / "Pulumi.gk.yaml"
    stack.write_text(
        "config:\n  multislice:project: my-proj\n  multislice:region: us-central1\n"
        "  multislice:zone: us-central1-a\n  multislice:accelerator_type: v5litepod-16\n"
        "  multislice:slices: 2\n  multislice:orchestration: gke\n"
        "  multislice:experiment_dir: experiments/missing\n  multislice:gke:\n"
        "    kind: workload\n    namespace: ms-gk\n    local_queue: v5e16\n"
        "    cluster: projects/plat/locations/us-central1/clusters/c\n")
    for ns in ("ms-gk", "team-b"):
        api.put(LOCAL_QUEUES, "v5e16", {"apiVersion": "kueue.x-k8s.io/v1beta1",
                                        "kind": "LocalQueue", "metadata": {"name": "v5e16"},
                                        "spec": {"clusterQueue": f"ms-plat-{ns}-v5e16"
                                                 if ns == "team-b" else "ms-plat-shared"}},
                ns)
    api.put(LOCAL_QUEUES, "v5e16", {"apiVersion": "kueue.x-k8s.io/v1beta1",
                                    "kind": "LocalQueue", "metadata": {"name": "v5e16"},
                                    "spec": {"clusterQueue": "ms-plat-shared"}}, "team-b")
    api.put(JOBSETS, NAME, jobset(conditions=[{"type": "Suspended", "status": "True",
                                               "reason": "SuspendedByKueue"}]))
    older = workload("jobset-ms-older-1", "ms-older", "team-b", "v5e16", 1000,
                     "2026-12-07T07:00:00Z", PENDING)
    mine = workload("jobset-ms-gk-2", NAME, NS, "v5e16", 0, "2026-12-07T07:30:00Z", PENDING)
    api.put(WORKLOADS, "jobset-ms-older-1", older, "team-b")
    api.put(WORKLOADS, "jobset-ms-gk-2", mine)
    try:
        assert cli(["status", "--stack-config", str(stack), "--json"]) == 0
        line = json.loads(capsys.readouterr().out)["queue"]
        assert line == ("pending in LocalQueue ms-gk/v5e16, 1 in LocalQueue, 2 in ClusterQueue: "
                        "couldn't assign flavors to pod set slice: insufficient unused quota "
                        "for google.com/tpu in flavor ms-plat-v5e16, 16 more needed")
        # evicted by a higher priority: Kueue's Evicted and Preempted conditions
        evicted = workload("jobset-ms-gk-2", NAME, NS, "v5e16", 0, "2026-12-07T07:30:00Z", [
            {"type": "Evicted", "status": "True", "reason": "Preempted",
             "message": "Preempted to accommodate a workload (UID: u1) due to prioritization "
                        "in the ClusterQueue"},
            {"type": "Preempted", "status": "True", "reason": "InClusterQueue", "message": ""},
            *PENDING])
        api.put(WORKLOADS, "jobset-ms-gk-2", evicted)
        assert cli(["status", "--stack-config", str(stack)]) == 0
        out = capsys.readouterr().out
        assert "evicted in LocalQueue ms-gk/v5e16" in out and \
            "preempted by a higher priority in its ClusterQueue" in out, out
        admitted = workload("jobset-ms-gk-2", NAME, NS, "v5e16", 0, "2026-12-07T07:30:00Z", [
            {"type": "QuotaReserved", "status": "True"}, {"type": "Admitted", "status": "True"}],
            {"clusterQueue": "ms-plat-shared", "podSetAssignments": [
                {"name": "slice", "flavors": {"google.com/tpu": "ms-plat-v5e16"}, "count": 8}]})
        api.put(WORKLOADS, "jobset-ms-gk-2", admitted)
        assert cli(["queue", "--stack-config", str(stack), "--json"]) == 0
        [row] = json.loads(capsys.readouterr().out)
        assert (row["jobset"], row["state"], row["cluster_queue"], row["flavor"], row["chips"],
                row["shape"]) == (NAME, "admitted", "ms-plat-shared", "ms-plat-v5e16", 32,
                                  "tpu-v5-lite-podslice 4x4")
    finally:
        api.remove(WORKLOADS, "jobset-ms-gk-2")
        api.remove(WORKLOADS, "jobset-ms-older-1", "team-b")
        api.remove(JOBSETS, NAME)
