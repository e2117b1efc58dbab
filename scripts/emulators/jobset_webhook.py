"""The JobSet controller's admission webhook on create, as JobSet v0.12.0 defines it.

Test support, never production: the defaults and the create-time rules of kubernetes-sigs/jobset
v0.12.0, pkg/webhooks/jobset_webhook.go (Default, ValidateCreate, validateFailurePolicy,
validateCoordinator), in the order the webhook applies them, with feature gates at their
defaults (InPlaceRestart and RestartJob off). scripts/emulators/crd_admission.py calls it between
the schema's defaulting and its validation, as the API server calls the webhook.
"""

from __future__ import annotations

import re
from typing import Any

from infra.gke.k8s_names import DNS1035_LABEL, DNS1123_SUBDOMAIN, LABEL_NAME

_RULE_NAME = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
_JOB_FAILURE_REASONS = ("BackoffLimitExceeded", "DeadlineExceeded", "FailedIndexes",
                        "MaxFailedIndexesExceeded", "PodFailurePolicy")
_MAX_INT32 = 2**31 - 1
_POD_NAME_SUFFIX = "-abcde"  # the 5 random characters a Job's pod names end with
_TOO_LONG = "JobSet name is too long, {} names generated for this JobSet will exceed 63 characters"


def default(js: dict[str, Any]) -> None:
    """The webhook's Default, in place."""
    spec = js.setdefault("spec", {})
    spec.setdefault("successPolicy", {"operator": "All"})
    spec.setdefault("startupPolicy", {"startupPolicyOrder": "AnyOrder"})
    for rjob in spec.get("replicatedJobs", []):
        job = rjob.setdefault("template", {}).setdefault("spec", {})
        job.setdefault("completionMode", "Indexed")
        pod = job.setdefault("template", {}).setdefault("spec", {})
        if not pod.get("restartPolicy"):
            pod["restartPolicy"] = "OnFailure"
    network = spec.setdefault("network", {})
    network.setdefault("enableDNSHostnames", True)
    network.setdefault("publishNotReadyAddresses", True)
    for i, rule in enumerate((spec.get("failurePolicy") or {}).get("rules", [])):
        if not rule.get("name"):
            rule["name"] = f"failurePolicyRule{i}"
    for policy in spec.get("volumeClaimPolicies", []):
        policy.setdefault("retentionPolicy", {"whenDeleted": "Delete"})


def _dns1035_problems(value: str, what: str,
                      too_long: str = "must be no more than 63 characters") -> list[str]:
    if len(value) > 63:
        return [f"{what}: {value!r} {too_long}"]
    if not DNS1035_LABEL.match(value):
        return [f"{what}: {value!r} is not a DNS-1035 label"]
    return []


def validate_create(js: dict[str, Any]) -> list[str]:
    """The webhook's ValidateCreate: every reason it refuses the (defaulted) JobSet."""
    spec = js["spec"]
    name = js["metadata"]["name"]
    problems = []
    policy = spec.get("failurePolicy") or {}
    if policy.get("restartStrategy") == "InPlaceRestart":
        problems.append("InPlaceRestart restart strategy cannot be set when InPlaceRestart "
                        "feature gate is disabled")
    rjobs = spec.get("replicatedJobs", [])
    if rjobs and rjobs[0].get("dependsOn") is not None:
        problems.append("DependsOn can't be set for the first ReplicatedJob")
    subdomain = (spec.get("network") or {}).get("subdomain", "")
    if subdomain:
        if not DNS1123_SUBDOMAIN.match(subdomain):
            problems.append(f"spec.network.subdomain: {subdomain!r} is not a DNS-1123 subdomain")
        problems += _dns1035_problems(subdomain, "spec.network.subdomain")
    names: set[str] = set()
    for i, rjob in enumerate(rjobs):
        where = f"spec.replicatedJobs[{i}]"
        job = rjob["template"]["spec"]
        if job.get("parallelism", 1) * rjob.get("replicas", 1) > _MAX_INT32:
            problems.append(f"{where}: the product of replicas and parallelism must not exceed "
                            f"{_MAX_INT32}")
        problems += _dns1035_problems(rjob.get("groupName", ""), f"{where}.groupName")
        longest_job = f"{name}-{rjob['name']}-{rjob.get('replicas', 1) - 1}"
        problems += _dns1035_problems(longest_job, f"{where}.name", _TOO_LONG.format("job"))
        if job.get("completionMode") == "Indexed" and "completions" in job:
            longest_pod = f"{longest_job}-{job['completions'] - 1}{_POD_NAME_SUFFIX}"
            problems += _dns1035_problems(longest_pod, f"{where}.name", _TOO_LONG.format("pod"))
        for dependency in rjob.get("dependsOn") or []:
            if dependency["name"] not in names:
                problems.append(f"replicatedJob: {rjob['name']} cannot depend on replicatedJob: "
                                f"{dependency['name']}")
        names.add(rjob["name"])
    for target in (spec.get("successPolicy") or {}).get("targetReplicatedJobs", []):
        if target not in names:
            problems.append(f"invalid replicatedJob name {target!r} does not appear in "
                            ".spec.ReplicatedJobs")
    problems += _failure_policy_problems(policy, names)
    problems += _coordinator_problems(js, rjobs)
    if spec.get("volumeClaimPolicies"):
        problems.append("spec.volumeClaimPolicies: not modelled by this stand-in of the webhook")
    return problems


def _failure_policy_problems(policy: dict[str, Any], names: set[str]) -> list[str]:
    problems = []
    rules = policy.get("rules", [])
    if any(rule.get("action") in ("RestartJob", "RestartJobAndIgnoreMaxRestarts")
           for rule in rules):
        return ["RestartJob and RestartJobAndIgnoreMaxRestarts failure policy actions are not "
                "allowed when RestartJob feature gate is disabled"]
    seen: dict[str, list[int]] = {}
    for i, rule in enumerate(rules):
        rule_name = rule.get("name", "")
        if not 1 <= len(rule_name) <= 128:
            problems.append(f"invalid failure policy rule name of length {len(rule_name)}, the "
                            "rule name must be at least 1 characters long and at most 128")
        if not _RULE_NAME.match(rule_name):
            problems.append(f"invalid failure policy rule name {rule_name!r}, a failure policy "
                            "rule name must start with an alphabetic character, optionally "
                            "followed by a string of alphanumeric characters or '_,:', and must "
                            "end with an alphanumeric character or '_'")
        seen.setdefault(rule_name, []).append(i)
        for target in rule.get("targetReplicatedJobs", []):
            if target not in names:
                problems.append(f"invalid replicatedJob name {target!r} in failure policy does "
                                "not appear in .spec.ReplicatedJobs")
        for reason in rule.get("onJobFailureReasons", []):
            if reason not in _JOB_FAILURE_REASONS:
                problems.append(f"invalid job failure reason {reason!r} in failure policy is not "
                                "a recognized job failure reason")
    problems += [f"rule names are not unique, rules with indices {indices} all have the same "
                 f"name {rule_name!r}" for rule_name, indices in seen.items() if len(indices) > 1]
    return problems


def _coordinator_problems(js: dict[str, Any], rjobs: list[dict[str, Any]]) -> list[str]:
    coordinator = js["spec"].get("coordinator")
    if coordinator is None:
        return []
    by_name = {rjob["name"]: rjob for rjob in rjobs}
    rjob, job_index, pod_index = (by_name.get(coordinator.get("replicatedJob")),
                                  coordinator.get("jobIndex", 0), coordinator.get("podIndex", 0))
    if rjob is None:
        return [f"coordinator replicatedJob {coordinator.get('replicatedJob')} does not exist"]
    job = rjob["template"]["spec"]
    if not 0 <= job_index < rjob.get("replicas", 1):
        return [f"coordinator job index {job_index} is invalid for replicatedJob {rjob['name']}"]
    if job.get("completionMode") != "Indexed" or "completions" not in job:
        return ["job for coordinator pod must be indexed completion mode, and completions number "
                "must be set"]
    if not 0 <= pod_index < job["completions"]:
        return [f"coordinator pod index {pod_index} is invalid for replicatedJob {rjob['name']} "
                f"job index {job_index}"]
    subdomain = js["spec"].get("network", {}).get("subdomain") or js["metadata"]["name"]
    endpoint = f"{js['metadata']['name']}-{rjob['name']}-{job_index}-{pod_index}.{subdomain}"
    if len(endpoint) > 63 or not LABEL_NAME.match(endpoint):
        return [f"spec will lead to invalid label value {endpoint!r} for the coordinator label"]
    return []
