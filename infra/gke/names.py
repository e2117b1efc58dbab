"""The names the JobSet controller generates from a stack's, and the webhook's rule on them.

The JobSet webhook refuses a JobSet whose generated Job names (JOBSET-RJOB-J) or pod names
(JOBSET-RJOB-J-P plus the 5 random characters Kubernetes appends) are not DNS-1035 labels of at
most 63 characters (kubernetes-sigs/jobset, pkg/webhooks/jobset_webhook.go). The schema checks it
at preview, before any cluster exists.
"""

from __future__ import annotations

from infra.gke.k8s_names import DNS1035_LABEL

REPLICATED_JOB = "slice"  # one replicated job; its replicas are the slices
POD_NAME_SUFFIX = "-abcde"  # the 5 random characters Kubernetes appends to a Job's pod names


def longest_names(jobset: str, slices: int, nodes_per_slice: int) -> dict[str, str]:
    """The longest Job and pod names the JobSet controller will generate (its webhook's rule)."""
    job = f"{jobset}-{REPLICATED_JOB}-{slices - 1}"
    return {"job": job, "pod": f"{job}-{nodes_per_slice - 1}{POD_NAME_SUFFIX}"}


def name_problems(stack: str, jobset: str, slices: int, nodes_per_slice: int) -> list[str]:
    problems = []
    for what, name in longest_names(jobset, slices, nodes_per_slice).items():
        if len(name) > 63 or not DNS1035_LABEL.match(name):
            problems.append(
                f"stack: {stack!r} makes JobSet {what} names such as {name!r} "
                f"({len(name)} characters); the JobSet webhook allows DNS-1035 labels of at most "
                "63 characters: use a shorter stack name")
    return problems
