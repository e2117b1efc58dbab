"""An existing cluster, checked before the stack creates anything in or for it.

A GKE stack on a cluster it did not create relies on what the cluster's admin set up: a Standard
cluster (Autopilot has no node pools to add), Workload Identity on (the pods reach the bucket only
through it), a GKE version that runs multislice and the capacity asked for, and the cluster-wide
controllers the stack does not install (their CRDs). Any of these missing would surface an hour
later as node pools that never schedule a pod, or a JobSet the API server refuses.

`ClusterCheck` is a dynamic resource whose provider's `check` runs on every `pulumi preview` and
`up`, in the provider process, before the engine steps any later resource: the stack registers it
first, and the node pools wait for it. Its inputs are what the GKE API says of the cluster (the
program reads them with the getCluster data source); the CRDs are asked of the cluster's API
server with the deployer's own token, or of `MULTISLICE_KUBERNETES_API` when set (a `kubectl
proxy`, an emulator), as `multislice status` does. A problem is one line naming the cluster, what
it has and what the stack needs.
"""

from __future__ import annotations

import base64
import json
import os
import re
import ssl
import urllib.error
import urllib.request
from typing import Any

import pulumi
import pulumi.dynamic
from pulumi.dynamic import CheckFailure, CheckResult

from infra.gke.k8s_names import KUBERNETES_API_ENV
from infra.preview_check import CheckOnlyProvider

SCOPES = ("https://www.googleapis.com/auth/cloud-platform",)
# GKE's multislice page: Standard clusters run multislice from 1.27.4-gke.900. GKE's flex-start
# page: TPUs with flex-start need 1.33.0-gke.1712000. GKE's TPU planning page: v6e from
# 1.31.2-gke.1115000.
MULTISLICE_MIN_VERSION = "1.27.4-gke.900"
CAPACITY_MIN_VERSION = {"flex-start": "1.33.0-gke.1712000"}
FAMILY_MIN_VERSION = {"v6e": "1.31.2-gke.1115000"}
JOBSET_CRDS = ("jobsets.jobset.x-k8s.io",)
KUEUE_CRDS = ("resourceflavors.kueue.x-k8s.io", "clusterqueues.kueue.x-k8s.io",
              "localqueues.kueue.x-k8s.io", "workloads.kueue.x-k8s.io")
_VERSION_RE = re.compile(r"^(\d+)\.(\d+)\.(\d+)(?:-gke\.(\d+))?")


def gke_version(text: str) -> tuple[int, int, int, int] | None:
    """1.33.5-gke.1162000 -> (1, 33, 5, 1162000); None for what is not a GKE version."""
    match = _VERSION_RE.match(text or "")
    if match is None:
        return None
    return (int(match[1]), int(match[2]), int(match[3]), int(match[4] or 0))


def min_version(capacity: str, family: str) -> str:
    """The oldest GKE version that runs this stack's slices."""
    wanted = [MULTISLICE_MIN_VERSION, CAPACITY_MIN_VERSION.get(capacity, ""),
              FAMILY_MIN_VERSION.get(family, "")]
    return max((v for v in wanted if v), key=lambda v: gke_version(v) or (0, 0, 0, 0))


def description_problems(props: dict[str, Any]) -> list[tuple[str, str]]:
    """What the GKE API's description of the cluster lacks for this stack."""
    name, problems = props["cluster"], []
    if props.get("autopilot"):
        problems.append(("autopilot", f"{name} is an Autopilot cluster; a stack adds TPU node "
                         "pools, which needs a Standard cluster: use another cluster or "
                         "create_cluster: true"))
    pool = f"{props['project']}.svc.id.goog"
    if props.get("workload_pool") != pool:
        problems.append(("workload_pool", f"{name} has Workload Identity "
                         f"{'pool ' + repr(props['workload_pool']) if props.get('workload_pool') else 'off'}; "
                         f"the pods reach the bucket only through {pool}: `gcloud container "
                         f"clusters update {name.rsplit('/', 1)[-1]} --workload-pool={pool}`"))
    have, need = gke_version(props.get("master_version", "")), gke_version(props["min_version"])
    if have is None or (need is not None and have < need):
        problems.append(("master_version", f"{name} runs GKE {props.get('master_version')!r}; "
                         f"this stack ({props['why_version']}) needs {props['min_version']} or "
                         "later: upgrade the control plane"))
    return problems


def _get(url: str, token: str | None, ca_pem: str | None, timeout_s: float) -> int:
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    context = ssl.create_default_context(cadata=ca_pem) if ca_pem else None
    try:
        with urllib.request.urlopen(request, timeout=timeout_s, context=context) as answer:
            json.load(answer)
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code


def missing(props: dict[str, Any], paths: dict[str, str], timeout_s: float = 30.0) -> list[str]:
    """The names (keys of `paths`, name -> API path) the cluster's API server answers 404 for;
    raises RuntimeError (one line) when it cannot be asked."""
    base, token, ca = os.environ.get(KUBERNETES_API_ENV, "").strip().rstrip("/"), None, None
    if not base:
        import google.auth
        import google.auth.transport.requests

        credentials, _ = google.auth.default(scopes=SCOPES)
        credentials.refresh(google.auth.transport.requests.Request())
        base, token = f"https://{props['endpoint']}", credentials.token
        ca = base64.b64decode(props["ca_certificate"]).decode()
    absent = []
    for name, path in paths.items():
        try:
            status = _get(f"{base}{path}", token, ca, timeout_s)
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"cannot ask {base} for {name}: {type(exc).__name__}: "
                               f"{(str(exc).splitlines() or [''])[0][:200]}") from None
        if status == 404:
            absent.append(name)
        elif status != 200:
            raise RuntimeError(f"{base} answered HTTP {status} for {name}; the deployer needs "
                               "to read it (roles/container.clusterViewer or container.admin)")
    return absent


def missing_crds(props: dict[str, Any], timeout_s: float = 30.0) -> list[str]:
    """The CRDs in props['crds'] that the cluster's API server does not serve."""
    return missing(props, {crd: f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd}"
                           for crd in props["crds"]}, timeout_s)


def crd_problem(props: dict[str, Any], missing: list[str]) -> tuple[str, str]:
    controllers = sorted({"JobSet" if c.endswith("jobset.x-k8s.io") else "Kueue"
                          for c in missing})
    keys = " / ".join(f"gke.install_{c.lower()}: true" for c in controllers)
    return ("crds", f"{props['cluster']} does not serve {', '.join(missing)}: its "
            f"{' and '.join(controllers)} controller is not installed; ask the cluster's admin "
            f"to install it, or set {keys} to install it with this stack (cluster-wide, "
            "retained on destroy)")


class ClusterCheckProvider(CheckOnlyProvider):
    """Refuses, at check, a cluster that cannot run the stack. Holds nothing of its own."""

    def check(self, _olds: dict[str, Any], news: dict[str, Any]) -> CheckResult:
        problems = description_problems(news)
        objects, stage = news.get("objects") or [], "crds"
        try:
            if not problems and news["crds"]:
                absent = missing_crds(news)
                problems = [crd_problem(news, absent)] if absent else []
            stage = "objects"
            if not problems and objects:
                absent = missing(news, {o["what"]: o["path"] for o in objects})
                problems = [("objects", f"{news['cluster']} has no {o['what']}: {o['fix']}")
                            for o in objects if o["what"] in absent]
        except RuntimeError as exc:
            problems = [(stage, str(exc))]
        return CheckResult(news, [CheckFailure(prop, reason) for prop, reason in problems])

    def resource_id(self, props: dict[str, Any]) -> str:
        return props["cluster"]


class ClusterCheck(pulumi.dynamic.Resource):
    """The existing cluster as the stack needs it; see the module docstring."""

    def __init__(self, name: str, props: dict[str, Any],
                 opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__(ClusterCheckProvider(), name, props, opts)


KUEUE_CHECK_VERSION = "v1beta1"  # served by every Kueue an admin may run, v0.19 included


def admin_objects(namespace: str, local_queue: str | None,
                  priority_class: str | None) -> list[dict[str, str]]:
    """The objects of the cluster's admin the stack names: their API paths and what to say when
    one is missing."""
    kueue = f"/apis/kueue.x-k8s.io/{KUEUE_CHECK_VERSION}"
    objects = []
    if local_queue is not None:  # a LocalQueue exists only in a namespace that does
        objects.append(
            {"path": f"{kueue}/namespaces/{namespace}/localqueues/{local_queue}",
             "what": f"LocalQueue {namespace}/{local_queue}",
             "fix": "check gke.local_queue and gke.namespace with `kubectl get localqueues -A`"})
    if priority_class is not None:
        objects.append({"path": f"{kueue}/workloadpriorityclasses/{priority_class}",
                        "what": f"WorkloadPriorityClass {priority_class}",
                        "fix": "check gke.priority_class with `kubectl get "
                               "workloadpriorityclasses`"})
    return objects


def check_inputs(cluster: Any, *, cluster_path: str, project: str, capacity: str, family: str,
                 crds: list[str], objects: list[dict[str, str]] | None = None
                 ) -> dict[str, Any]:
    """ClusterCheck's inputs from the getCluster data source's result."""
    pools = list(getattr(cluster, "workload_identity_configs", None) or [])
    auths = list(getattr(cluster, "master_auths", None) or [])
    why = f"multislice, {family}" + (f", {capacity}" if capacity in CAPACITY_MIN_VERSION else "")
    return {
        "cluster": cluster_path,
        "project": project,
        "autopilot": bool(getattr(cluster, "enable_autopilot", False)),
        "workload_pool": (pools[0].workload_pool if pools else "") or "",
        "master_version": getattr(cluster, "master_version", "") or "",
        "min_version": min_version(capacity, family),
        "why_version": why,
        "endpoint": getattr(cluster, "endpoint", "") or "",
        "ca_certificate": auths[0].cluster_ca_certificate if auths else "",
        "crds": list(crds),
        "objects": list(objects or []),
    }
