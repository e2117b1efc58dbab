"""The failure handling of the JobSet this toolkit renders, as the Job and JobSet controllers
decide it (scripts/emulators/jobset_policy.py), without pods: which failures restart the job for
free, which use up trainer.max_restarts, which end it."""

from __future__ import annotations

import pytest

from scripts.emulators import crd_admission
from scripts.emulators.jobset_policy import (
    JobSetStatus,
    PodFailure,
    apply_action,
    job_failure,
    jobset_action,
)
from tests.infra.test_gke_admission import rendered

DISRUPTED = ("DisruptionTarget",)


@pytest.fixture(scope="module")
def policies() -> tuple[dict, dict, int]:
    _, js = rendered()
    stored, problems = crd_admission.admit(js)  # as the API server keeps it
    assert problems == []
    job = stored["spec"]["replicatedJobs"][0]["template"]["spec"]
    policy = stored["spec"]["failurePolicy"]
    return job["podFailurePolicy"], policy, policy["maxRestarts"]


def run(policies, failures: list[PodFailure]) -> JobSetStatus:
    pod_policy, policy, max_restarts = policies
    status = JobSetStatus()
    for pod in failures:
        assert not status.failed, "a failure after the JobSet ended"
        status = apply_action(status, jobset_action(policy, job_failure(pod_policy, pod)),
                              max_restarts)
    return status


def pod(exit_code: int | None, conditions: tuple[str, ...] = ()) -> PodFailure:
    return PodFailure("ms", "ms-exp-slice-1-0-abcde", "trainer", exit_code, conditions)


def test_twenty_five_disruptions_in_a_row_never_fail_the_jobset(policies):
    # spot preemptions and node failures (no exit code), maintenance evictions (SIGTERM, 143)
    status = run(policies, [pod(None, DISRUPTED), pod(143, DISRUPTED), pod(42, DISRUPTED)] * 8
                 + [pod(None, DISRUPTED)])
    assert (status.failed, status.restarts, status.restarts_count_towards_max) == (False, 25, 0)


def test_crashes_use_up_max_restarts_and_then_fail_the_jobset(policies):
    _, _, max_restarts = policies
    assert max_restarts == 7
    status = run(policies, [pod(1), pod(137), pod(134)] * 2 + [pod(42)])
    assert (status.failed, status.restarts_count_towards_max) == (False, 7)
    status = run(policies, [pod(1)] * 8)
    assert status.failed_reason == "ReachedMaxRestarts" and status.restarts == 7
    # disruptions in between do not change the count
    status = run(policies, [pod(1), pod(None, DISRUPTED)] * 7 + [pod(1)])
    assert status.failed_reason == "ReachedMaxRestarts" and status.restarts == 14


@pytest.mark.parametrize("code", [2, 3])
def test_exit_2_or_3_fails_the_jobset_at_once_even_after_disruptions(policies, code):
    status = run(policies, [pod(None, DISRUPTED), pod(code)])
    assert (status.failed_reason, status.restarts) == ("FailJobSetFailurePolicyAction", 1)


def test_the_job_failure_messages_are_the_job_controllers_own(policies):
    pod_policy, _, _ = policies
    assert job_failure(pod_policy, pod(2)).message == (
        "Container trainer for pod ms/ms-exp-slice-1-0-abcde failed with exit code 2 matching "
        "FailJob rule at index 1")
    assert job_failure(pod_policy, pod(None, DISRUPTED)).message == (
        "Pod ms/ms-exp-slice-1-0-abcde has condition DisruptionTarget matching FailJob rule at "
        "index 0")
    crash = job_failure(pod_policy, pod(1))
    assert (crash.reason, crash.message) == ("BackoffLimitExceeded",
                                             "Job has reached the specified backoff limit")


def test_exit_code_rules_follow_the_job_api():
    rules = {"rules": [{"action": "FailJob", "onExitCodes": {
        "containerName": "trainer", "operator": "NotIn", "values": [42]}}]}
    assert job_failure(rules, pod(1)).reason == "PodFailurePolicy"
    assert job_failure(rules, pod(42)).reason == "BackoffLimitExceeded"
    assert job_failure(rules, pod(0)).reason == "BackoffLimitExceeded"  # 0 never matches
    other = PodFailure("ms", "p", "sidecar", 1)
    assert job_failure(rules, other).reason == "BackoffLimitExceeded"
    with pytest.raises(ValueError, match="RestartJob"):
        apply_action(JobSetStatus(), "RestartJob", 3)
