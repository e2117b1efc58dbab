"""A day-two change keeps a running JobSet (and its place in the queue); a run that has ended is
replaced by a new JobSet (infra/gke/live_run.py)."""

from __future__ import annotations

import pytest

from infra.gke import live_run
from infra.gke.manifest import LAUNCH_SPEC_ANNOTATION
from tests.infra.pulumi_mocks import run_program
from tests.infra.test_gke_kinds import workload_config

JOBSET = "kubernetes:jobset.x-k8s.io/v1alpha2:JobSet"
STARTED_WITH = "a" * 64


def live_jobset(*conditions: tuple[str, str], deleting: bool = False) -> dict:
    return {
        "metadata": {"name": "ms-exp", "namespace": "team-a",
                     **({"deletionTimestamp": "2026-12-07T10:00:00Z"} if deleting else {})},
        "spec": {"replicatedJobs": [{"template": {"spec": {"template": {"metadata": {
            "annotations": {LAUNCH_SPEC_ANNOTATION: STARTED_WITH}}}}}}]},
        "status": {"conditions": [{"type": t, "status": s} for t, s in conditions]},
    }


def run_digest(mocks) -> str:
    (rjob,) = mocks.one(JOBSET).inputs["spec"]["replicatedJobs"]
    return rjob["template"]["spec"]["template"]["metadata"]["annotations"][
        LAUNCH_SPEC_ANNOTATION]


@pytest.mark.parametrize("conditions", [(), (("Suspended", "True"),), (("Completed", "False"),)])
def test_a_running_waiting_or_suspended_jobset_keeps_the_spec_its_run_started_with(conditions):
    assert live_run.started_with(live_jobset(*conditions)) == STARTED_WITH


@pytest.mark.parametrize("live", [
    None, live_jobset(("Completed", "True")), live_jobset(("Failed", "True")),
    live_jobset(deleting=True)], ids=["none", "completed", "failed", "being-deleted"])
def test_no_jobset_or_one_whose_run_has_ended_takes_the_new_spec(live):
    assert live_run.started_with(live) is None


def test_pulumi_up_of_a_new_spec_keeps_a_running_jobset_and_replaces_a_finished_one(
        project_root):
    key = ("team-a", "ms-exp")
    fresh, _ = run_program(workload_config(), project_root)
    new_spec = run_digest(fresh)
    assert new_spec != STARTED_WITH and len(new_spec) == 64
    running, _ = run_program(workload_config(), project_root,
                             live_jobsets={key: live_jobset()})
    # the pod template is what the live JobSet's is: no replacement, the pods follow the spec
    assert run_digest(running) == STARTED_WITH
    finished, _ = run_program(workload_config(), project_root,
                              live_jobsets={key: live_jobset(("Completed", "True"))})
    assert run_digest(finished) == new_spec


def test_a_cluster_that_cannot_be_asked_replaces_the_jobset_with_a_warning(monkeypatch):
    warned: list[str] = []
    monkeypatch.setattr("pulumi.log.warn", warned.append)

    def refuse(*_: str) -> dict:
        raise RuntimeError("cannot ask https://1.2.3.4 for JobSet team-a/ms-exp: timed out")

    monkeypatch.setattr(live_run, "reader", refuse)
    assert live_run.run_spec_sha256("1.2.3.4", "", "team-a", "ms-exp", "b" * 64) == "b" * 64
    (line,) = warned
    assert "cannot tell whether JobSet team-a/ms-exp still runs (cannot ask" in line
    assert "replaces it" in line
