"""Which launch spec the JobSet's run started with, read from the cluster at every `pulumi up`.

A JobSet's pods watch the launch spec object as TPU VMs do (infra/boot/startup.sh, step 6): a new
generation stops each trainer at a step boundary (it saves first) and starts it again on the new
code or settings in the same pod. The JobSet stays, and so does its Kueue Workload's admission:
a day-two change keeps its place on shared capacity. So while the JobSet runs, its pod template
must not change, and keeps the digest of the spec its run started with
(manifest.LAUNCH_SPEC_ANNOTATION). A run that has ended (the JobSet Completed or Failed, or gone:
its TTL deleted it) watches nothing: a new spec then takes its digest into the template, and
`pulumi up` replaces the JobSet: a new run, which resumes from the last checkpoint.

Nothing but the cluster knows which of the two holds, so the program asks it, with the deployer's
own credentials (or MULTISLICE_KUBERNETES_API), as preview's cluster check does. The offline
render and the mock-runtime tests set `reader` instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from infra.gke.manifest import JOBSET_API_VERSION, LAUNCH_SPEC_ANNOTATION

# What the offline render shows in place of a digest only the cluster can choose.
OFFLINE_RUN = ("<the digest of the launch spec the running JobSet started with; this spec's when "
               "there is none or its run has ended>")
FINISHED_CONDITIONS = ("Completed", "Failed")


class Offline:
    """A reader's answer when no cluster can be asked (the offline render)."""


# (endpoint, base64 CA certificate, namespace, name) -> the live JobSet, None when there is none,
# or Offline(). None here: ask the cluster's API server.
reader: Callable[[str, str, str, str], dict[str, Any] | None | Offline] | None = None


def jobset_path(namespace: str, name: str) -> str:
    return f"/apis/{JOBSET_API_VERSION}/namespaces/{namespace}/jobsets/{name}"


def started_with(live: dict[str, Any] | None) -> str | None:
    """The digest a JobSet that still runs (or waits in its queue, or is suspended) started
    with; None for none, one being deleted, or one whose run has ended."""
    if not live or live.get("metadata", {}).get("deletionTimestamp"):
        return None
    conditions = (live.get("status") or {}).get("conditions") or []
    if any(c.get("type") in FINISHED_CONDITIONS and c.get("status") == "True"
           for c in conditions):
        return None
    for rjob in (live.get("spec") or {}).get("replicatedJobs") or []:
        annotations = (rjob.get("template", {}).get("spec", {}).get("template", {})
                       .get("metadata", {}).get("annotations") or {})
        if annotations.get(LAUNCH_SPEC_ANNOTATION):
            return str(annotations[LAUNCH_SPEC_ANNOTATION])
    return None


def _ask_cluster(endpoint: str, ca_certificate: str, namespace: str,
                 name: str) -> dict[str, Any] | None:
    from infra.gke.cluster_check import ApiServer

    return ApiServer({"endpoint": endpoint, "ca_certificate": ca_certificate}).ask(
        f"JobSet {namespace}/{name}", jobset_path(namespace, name))


def run_spec_sha256(endpoint: str, ca_certificate: str, namespace: str, name: str,
                    spec_sha256: str) -> str:
    """The digest the JobSet's pod template carries: the running JobSet's own, or the new
    spec's when there is no running one. A cluster that cannot be asked leaves the new spec's
    (the JobSet is replaced, as preview shows) with a warning naming why."""
    import pulumi

    read = reader or _ask_cluster
    try:
        live = read(endpoint, ca_certificate, namespace, name)
    except RuntimeError as exc:
        pulumi.log.warn(f"cannot tell whether JobSet {namespace}/{name} still runs ({exc}); "
                        "a new launch spec replaces it (a new run that resumes from the last "
                        "checkpoint) instead of reaching its pods in place")
        return spec_sha256
    if isinstance(live, Offline):
        return OFFLINE_RUN
    return started_with(live) or spec_sha256
