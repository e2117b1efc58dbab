"""What the Job and JobSet controllers decide when a pod of a JobSet fails: pure functions.

Test support, never production: the decisions scripts/emulators/jobset_emulator.py acts on, kept
apart so that they can be checked without pods. Semantics from the sources:

- The Job controller (Kubernetes batch/v1, "Handling retriable and non-retriable pod failures with
  Pod failure policy"): a failed pod is matched against `podFailurePolicy.rules` in order, first
  match wins. `onExitCodes` looks at the named container's exit code (In / NotIn; exit 0 never
  matches); `onPodConditions` at the pod's conditions (DisruptionTarget: the pod was disrupted by
  a preemption, an eviction, the taint manager or a node shutdown, not by its own code). A
  matching FailJob rule fails the Job with reason `PodFailurePolicy` and the message
  "Container C for pod NS/P failed with exit code N matching FailJob rule at index I" or
  "Pod NS/P has condition DisruptionTarget matching FailJob rule at index I"; no match counts
  against `backoffLimit` (0 here), which fails the Job with reason `BackoffLimitExceeded`.
- The JobSet controller (kubernetes-sigs/jobset v0.12.0, failure_policy.go and the Configurable
  Failure Policy KEP): `failurePolicy.rules` in order, first match wins; a rule applies when the
  Job's failure reason is in `onJobFailureReasons` and one of `onJobFailureMessagePatterns`
  (RE2; Python's `re` agrees on the patterns used here) matches its message, an empty list
  matching anything. No match: RestartJobSet. RestartJobSet fails the JobSet with reason
  `ReachedMaxRestarts` once `restartsCountTowardsMax` reached `maxRestarts`, else counts a
  restart toward it; RestartJobSetAndIgnoreMaxRestarts restarts without counting; FailJobSet
  fails it with reason `FailJobSetFailurePolicyAction`. `restarts` counts every restart.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

DISRUPTION_TARGET = "DisruptionTarget"


@dataclasses.dataclass(frozen=True)
class PodFailure:
    """A failed pod as the Job controller sees it."""

    namespace: str
    name: str
    container: str
    exit_code: int | None  # None: no container status (its node died before reporting one)
    conditions: tuple[str, ...] = ()  # pod condition types with status True


@dataclasses.dataclass(frozen=True)
class JobFailure:
    reason: str
    message: str


@dataclasses.dataclass
class JobSetStatus:
    restarts: int = 0
    restarts_count_towards_max: int = 0
    failed_reason: str | None = None  # None while the JobSet has not failed

    @property
    def failed(self) -> bool:
        return self.failed_reason is not None


def job_failure(pod_failure_policy: dict[str, Any] | None, pod: PodFailure) -> JobFailure:
    """The reason and message a Job with backoffLimit 0 fails with when `pod` failed."""
    for index, rule in enumerate((pod_failure_policy or {}).get("rules", [])):
        matched = _pod_rule_match(rule, pod, index)
        if matched is None:
            continue
        if rule["action"] == "FailJob":
            return JobFailure("PodFailurePolicy", matched)
        break  # Count (and Ignore, which this toolkit never renders) fall to the backoff limit
    return JobFailure("BackoffLimitExceeded", "Job has reached the specified backoff limit")


def _pod_rule_match(rule: dict[str, Any], pod: PodFailure, index: int) -> str | None:
    action = rule["action"]
    codes = rule.get("onExitCodes")
    if codes is not None:
        if codes.get("containerName") not in (None, pod.container) or pod.exit_code in (None, 0):
            return None
        if (pod.exit_code in codes["values"]) != (codes["operator"] == "In"):
            return None
        return (f"Container {pod.container} for pod {pod.namespace}/{pod.name} failed with exit "
                f"code {pod.exit_code} matching {action} rule at index {index}")
    for condition in rule.get("onPodConditions", []):
        if condition["type"] in pod.conditions and condition.get("status", "True") == "True":
            return (f"Pod {pod.namespace}/{pod.name} has condition {condition['type']} matching "
                    f"{action} rule at index {index}")
    return None


def jobset_action(failure_policy: dict[str, Any], failure: JobFailure) -> str:
    """The action the JobSet controller takes for a failed Job."""
    for rule in failure_policy.get("rules", []):
        reasons = rule.get("onJobFailureReasons") or []
        patterns = rule.get("onJobFailureMessagePatterns") or []
        if reasons and failure.reason not in reasons:
            continue
        if patterns and not any(re.search(p, failure.message) for p in patterns):
            continue
        return rule["action"]
    return "RestartJobSet"


def apply_action(status: JobSetStatus, action: str, max_restarts: int) -> JobSetStatus:
    """`status` after `action`: restarted (counted or not) or failed."""
    if action == "FailJobSet":
        return dataclasses.replace(status, failed_reason="FailJobSetFailurePolicyAction")
    if action == "RestartJobSetAndIgnoreMaxRestarts":
        return dataclasses.replace(status, restarts=status.restarts + 1)
    if action == "RestartJobSet":
        if status.restarts_count_towards_max >= max_restarts:
            return dataclasses.replace(status, failed_reason="ReachedMaxRestarts")
        return dataclasses.replace(
            status, restarts=status.restarts + 1,
            restarts_count_towards_max=status.restarts_count_towards_max + 1)
    raise ValueError(f"failure policy action {action!r} is not modelled (RestartJob needs a "
                     "feature gate that is off by default)")
