"""An existing cluster, checked before the stack creates anything in or for it.

A GKE stack on a cluster it did not create relies on what the cluster's admin set up: a Standard
cluster (Autopilot has no node pools to add), Workload Identity on (the pods reach the bucket only
through it), a GKE version that runs multislice and the capacity asked for, and the cluster-wide
controllers the stack does not install (their CRDs, with the fields this toolkit's JobSet uses:
an older JobSet prunes them silently), the admin's namespace (and a Pod Security level that
admits the pods), their queue and priority class, the deployer's right to create what the stack
creates there (SelfSubjectAccessReview), and for a workload stack the TPU node pools of its
slices' shape. Any of these missing would surface an hour later as node pools that never
schedule a pod, a JobSet the API server refuses or prunes, or pods that are never created.

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
from infra.gke.manifest import POD_SECURITY_ENFORCE, POD_SECURITY_LEVELS
from infra.gke.topology import GKE_FAMILIES
from infra.preview.check_only import CheckOnlyProvider
from infra.stack_config.schema import PROJECT_LABEL, STACK_LABEL

# GKE's multislice page: Standard clusters run multislice from 1.27.4-gke.900. GKE's flex-start
# page: TPUs with flex-start need 1.33.0-gke.1712000.
MULTISLICE_MIN_VERSION = "1.27.4-gke.900"
# GKE's TPU manifests: privileged mode is "Required for GKE versions earlier than 1.28 to access
# TPUs"; the pods run unprivileged, with no added capability (infra/gke/manifest.py).
UNPRIVILEGED_TPU_MIN_VERSION = "1.28.0"
CAPACITY_MIN_VERSION = {"flex-start": "1.33.0-gke.1712000"}
# the GKE versions from which a family runs (infra/gke/topology.py, with their sources)
FAMILY_MIN_VERSION = {name: family.min_gke_version for name, family in GKE_FAMILIES.items()
                      if family.min_gke_version}
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


# Kubernetes 1.30: ValidatingAdmissionPolicy GA (a capacity stack's toleration guard).
ADMISSION_POLICY_MIN_VERSION = "1.30.0"


def min_version(capacity: str, family: str, admission_policy: bool = False) -> str:
    """The oldest GKE version that runs this stack's slices (and its admission policy)."""
    wanted = [MULTISLICE_MIN_VERSION, UNPRIVILEGED_TPU_MIN_VERSION,
              ADMISSION_POLICY_MIN_VERSION if admission_policy else "",
              CAPACITY_MIN_VERSION.get(capacity, ""),
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
    if (pool_problem := tpu_pool_problem(props)) is not None:
        problems.append(pool_problem)
    if props.get("needs_network_policy") and not props.get("network_policy_enforced"):
        problems.append(("network_policy", f"{name} does not enforce NetworkPolicy (neither "
                         "GKE Dataplane V2 nor network policy enforcement is on), so the team "
                         "namespaces' isolation would be advice: `gcloud container clusters "
                         f"update {name.rsplit('/', 1)[-1]} --enable-network-policy` (or "
                         "create it with --enable-dataplane-v2)"))
    have, need = gke_version(props.get("master_version", "")), gke_version(props["min_version"])
    if have is None or (need is not None and have < need):
        problems.append(("master_version", f"{name} runs GKE {props.get('master_version')!r}; "
                         f"this stack ({props['why_version']}) needs {props['min_version']} or "
                         "later: upgrade the control plane"))
    return problems


def _request(url: str, token: str | None, ca_pem: str | None, timeout_s: float,
             body: dict[str, Any] | None = None) -> tuple[int, Any]:
    """(HTTP status, the JSON answer or None) of a GET, or a POST of `body`."""
    request = urllib.request.Request(
        url, headers={"Accept": "application/json"},
        data=json.dumps(body).encode() if body is not None else None,
        method="POST" if body is not None else "GET")
    if body is not None:
        request.add_header("Content-Type", "application/json")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    context = ssl.create_default_context(cadata=ca_pem) if ca_pem else None
    try:
        with urllib.request.urlopen(request, timeout=timeout_s, context=context) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as exc:
        return exc.code, None


class ApiServer:
    """The cluster's API server as the deployer reaches it: with their own token, or
    `MULTISLICE_KUBERNETES_API` when set (a `kubectl proxy`, an emulator)."""

    def __init__(self, props: dict[str, Any], timeout_s: float = 30.0) -> None:
        self.base = os.environ.get(KUBERNETES_API_ENV, "").strip().rstrip("/")
        self.token: str | None = None
        self.ca: str | None = None
        self.timeout_s = timeout_s
        if not self.base:
            from infra.cloud.credentials import CredentialsError, deployer_credentials

            try:  # the identity pulumi-gcp and the Kubernetes provider use (gke-token)
                credentials = deployer_credentials()
            except CredentialsError as exc:
                raise RuntimeError(f"cannot ask the cluster's API server: {exc}") from None
            self.base, self.token = f"https://{props['endpoint']}", credentials.token
            self.ca = base64.b64decode(props["ca_certificate"]).decode()

    def ask(self, name: str, path: str, body: dict[str, Any] | None = None,
            forbidden_is_none: bool = False) -> Any:
        """The JSON answer, or None for a 404 (and a 403 with `forbidden_is_none`: what the
        deployer may not read is nothing to refuse); raises RuntimeError (one line) otherwise."""
        try:
            status, answer = _request(f"{self.base}{path}", self.token, self.ca,
                                      self.timeout_s, body)
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"cannot ask {self.base} for {name}: {type(exc).__name__}: "
                               f"{(str(exc).splitlines() or [''])[0][:200]}") from None
        if status == 404 or (status == 403 and forbidden_is_none):
            return None
        if status not in (200, 201) or not isinstance(answer, dict):
            raise RuntimeError(
                f"{self.base} answered HTTP {status} for {name}; the deployer needs to read it: "
                "Kubernetes RBAC that lets them get it (README: who needs which roles; a "
                "workload stack's deployer: the ms-workload Role and ms-workload-preview "
                "ClusterRole)")
        return answer


def missing(props: dict[str, Any], paths: dict[str, str], timeout_s: float = 30.0) -> list[str]:
    """The names (keys of `paths`, name -> API path) the cluster's API server answers 404 for;
    raises RuntimeError (one line) when it cannot be asked."""
    server = ApiServer(props, timeout_s)
    return [name for name, path in paths.items() if server.ask(name, path) is None]


JOBSET_CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/jobsets.jobset.x-k8s.io"
# The JobSet field the failure policy relies on (infra/gke/manifest.py), new in JobSet v0.10:
# an older controller's CRD prunes it silently, so the disruption rule matches every failure,
# and a bad config (exit 2) restarts forever without counting.
JOBSET_NEEDED_FIELD = "onJobFailureMessagePatterns"


def jobset_crd_problem(crd: dict[str, Any], cluster: str) -> str | None:
    """Why the cluster's JobSet CRD cannot hold this toolkit's JobSet, or None."""
    for version in crd.get("spec", {}).get("versions", []):
        if version.get("name") != "v1alpha2" or not version.get("served"):
            continue
        spec = version.get("schema", {}).get("openAPIV3Schema", {}).get(
            "properties", {}).get("spec", {}).get("properties", {})
        rule = spec.get("failurePolicy", {}).get("properties", {}).get("rules", {}).get(
            "items", {}).get("properties", {})
        if JOBSET_NEEDED_FIELD in rule:
            return None
        return (f"{cluster} runs a JobSet controller older than v0.10: its CRD has no "
                f"failurePolicy.rules[].{JOBSET_NEEDED_FIELD}, which the API server would prune "
                "from this stack's JobSet, so a bad config (exit 2) would restart forever; ask "
                "the cluster's admin to upgrade JobSet to v0.10 or later (this toolkit pins "
                "v0.12.0)")
    return (f"{cluster}'s JobSet CRD serves no jobset.x-k8s.io/v1alpha2; ask the cluster's "
            "admin to install JobSet v0.10 or later (this toolkit pins v0.12.0)")


def ownership_problem(found: dict[str, Any], obj: dict[str, Any], cluster: str) -> str | None:
    """An object a stack would create (its namespace, its cluster-scoped Kueue objects) that
    exists and is not that stack's: another stack's label, or the same stack name of another
    project (another team on a shared cluster). An object without the project label is an
    older toolkit's: its stack label decides."""
    labels = (found.get("metadata") or {}).get("labels") or {}
    want = obj["owned_by"]
    stack, project = want[STACK_LABEL], want.get(PROJECT_LABEL)
    theirs = labels.get(PROJECT_LABEL)
    if labels.get(STACK_LABEL) == stack and (theirs is None or theirs == project):
        return None
    owner = (f"stack {labels.get(STACK_LABEL)!r} of project {theirs!r}" if theirs
             else f"its {STACK_LABEL} label is {labels.get(STACK_LABEL)!r}")
    fix = ("run in it with gke.kind: workload (the stack then declares no namespace), or name "
           "another" if obj.get("namespace") else
           "another team's stack has this stack's name on this cluster: choose another stack "
           "name (every name the stack makes here derives from it)")
    return (f"{cluster}: {obj['what']} exists and is not this stack's ({owner}; this is stack "
            f"{stack!r} of project {project!r}), so creating it would fail AlreadyExists or "
            f"take it over: {fix}")


def namespace_problem(namespace: dict[str, Any], cluster: str, needs: str) -> str | None:
    """A namespace whose Pod Security admission would refuse this toolkit's pods, which need
    `needs` (infra/gke/manifest.py pod_security_level): a stricter enforced level refuses them."""
    labels = (namespace.get("metadata") or {}).get("labels") or {}
    level = labels.get(POD_SECURITY_ENFORCE, "privileged")
    if level in POD_SECURITY_LEVELS and \
            POD_SECURITY_LEVELS.index(level) < POD_SECURITY_LEVELS.index(needs):
        name = namespace["metadata"]["name"]
        why = ("the node cache's hostPath volume, on the stack's own pools" if needs ==
               "privileged" else "the start-up script runs as root")
        return (f"{cluster}: namespace {name} enforces Pod Security {level!r}, which refuses "
                f"this stack's pods ({why}: they need {needs!r}): no pod would ever be "
                f"created; ask the admin to label it {POD_SECURITY_ENFORCE}={needs}, or use "
                "another")
    return None


def team_namespace_problem(namespace: dict[str, Any], cluster: str) -> str | None:
    """A team namespace of shared capacity must enforce Pod Security "baseline": stricter
    refuses the pods, laxer lets anyone who may create pods there run a privileged one beside
    other teams' trainers on the shared TPU nodes."""
    labels = (namespace.get("metadata") or {}).get("labels") or {}
    level = labels.get(POD_SECURITY_ENFORCE)
    if level == "baseline":
        return None
    name = namespace["metadata"]["name"]
    why = ("which refuses the workloads' pods (their start-up script runs as root)"
           if level == "restricted" else
           "so anyone who may create pods there could run a privileged, host-namespace or "
           "hostPath pod on the shared TPU nodes")
    have = f"enforces Pod Security {level!r}" if level else "enforces no Pod Security level"
    return (f"{cluster}: team namespace {name} {have}, {why}: `kubectl label --overwrite "
            f"namespace {name} {POD_SECURITY_ENFORCE}=baseline`")


def team_namespace_objects(teams: list[str]) -> list[dict[str, Any]]:
    """A capacity stack's team namespaces on an existing cluster: the platform's, never created
    or deleted by a stack; each must exist and enforce baseline."""
    return [{"path": f"/api/v1/namespaces/{team}", "what": f"namespace {team}", "team": True,
             "fix": f"a capacity stack creates no namespace on a cluster it did not create: "
                    f"`kubectl create namespace {team} && kubectl label namespace {team} "
                    f"{POD_SECURITY_ENFORCE}=baseline`"} for team in teams]


def access_problems(server: ApiServer, access: list[dict[str, str]], cluster: str) -> list[str]:
    """What the deployer may not do that the stack does (SelfSubjectAccessReview)."""
    denied = []
    for attributes in access:
        review = server.ask(
            f"SelfSubjectAccessReview of {attributes['verb']} {attributes['resource']}",
            "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
            {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
             "spec": {"resourceAttributes": attributes}})
        if not ((review or {}).get("status") or {}).get("allowed"):
            group = attributes.get("group")
            denied.append(f"{attributes['verb']} {attributes['resource']}"
                          f"{'.' + group if group else ''}")
    if not denied:
        return []
    namespace = access[0]["namespace"]
    return [f"{cluster}: the deployer may not {', '.join(denied)} in namespace {namespace} "
            "(SelfSubjectAccessReview); ask the cluster's admin for the namespace role README "
            "lists for a workload deployer"]


def workload_access(namespace: str, queued_by_stack: bool) -> list[dict[str, str]]:
    """Each create a stack makes in its namespace (its queue objects: only its own queue)."""
    made = [("jobset.x-k8s.io", "jobsets"), ("", "configmaps"), ("", "serviceaccounts")]
    if queued_by_stack:
        made.append(("kueue.x-k8s.io", "localqueues"))
    return [{"verb": "create", "group": group, "resource": resource, "namespace": namespace}
            for group, resource in made]


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


CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/"
KUEUE_CONFIG_PATH = "/api/v1/namespaces/kueue-system/configmaps/kueue-manager-config"
KUEUE_JOBSET_FRAMEWORK = "jobset.x-k8s.io/jobset"
# Server-side apply's field manager of pulumi-kubernetes (v4): "pulumi-kubernetes-<suffix>".
PULUMI_FIELD_MANAGER = "pulumi-kubernetes"


def foreign_managers(obj: dict[str, Any]) -> list[str]:
    """Who else wrote an object's fields (server-side apply's managedFields): not this toolkit's
    pulumi-kubernetes, not the API server's own status updates."""
    return sorted({m.get("manager", "") for m in (obj.get("metadata") or {}).get(
        "managedFields") or [] if m.get("subresource") != "status"
        and m.get("manager") != "kube-apiserver"
        and not m.get("manager", "").startswith(PULUMI_FIELD_MANAGER)})


def install_problems(server: ApiServer, installs: dict[str, list[str]],
                     cluster: str) -> list[str]:
    """An install the stack was told to make (gke.install_jobset / install_kueue) over a
    controller someone else runs: applying the kept manifest would conflict with their field
    manager part way through `pulumi up`, or, forced, overwrite their configuration."""
    problems = []
    for controller, crds in installs.items():
        for crd in crds:
            found = server.ask(f"the CRD {crd}", CRD_PATH + crd)
            others = foreign_managers(found) if found else []
            if others:
                problems.append(
                    f"{cluster} runs {controller} installed by someone else ({crd} is managed by "
                    f"{', '.join(others)}): gke.install_{controller.lower()}: true would apply "
                    "this toolkit's manifest over theirs; remove it, and the stack uses the "
                    "cluster's (checked at preview)")
                break
    return problems


def kueue_problems(server: ApiServer, cluster: str, creates_queue_objects: bool) -> list[str]:
    """The cluster's own Kueue as this stack needs it: managing JobSets (its configuration's
    integrations), and, when the stack creates queue objects, serving their API version."""
    from infra.gke.manifest import KUEUE_API_VERSION

    problems = []
    config = server.ask("Kueue's configuration", KUEUE_CONFIG_PATH, forbidden_is_none=True)
    if config is not None:
        import yaml

        try:
            parsed = yaml.safe_load((config.get("data") or {}).get(
                "controller_manager_config.yaml", "")) or {}
            frameworks = ((parsed.get("integrations") or {}).get("frameworks") or [])
        except (yaml.YAMLError, AttributeError):
            frameworks = None
        if frameworks is not None and KUEUE_JOBSET_FRAMEWORK not in frameworks:
            problems.append(
                f"{cluster} runs Kueue without its JobSet integration (integrations.frameworks "
                f"is {frameworks}): it would never admit or suspend a JobSet, and the queue would "
                f"be advice; ask the admin to add {KUEUE_JOBSET_FRAMEWORK} to kueue-system's "
                "kueue-manager-config")
    if creates_queue_objects:
        crd = server.ask("the CRD clusterqueues.kueue.x-k8s.io",
                         CRD_PATH + "clusterqueues.kueue.x-k8s.io") or {}
        served = [v.get("name") for v in (crd.get("spec") or {}).get("versions", [])
                  if v.get("served")]
        version = KUEUE_API_VERSION.split("/")[1]
        if crd and version not in served:
            problems.append(
                f"{cluster} runs a Kueue whose CRDs serve {served}, not {version}, the version "
                "of this stack's queue objects; ask the admin to upgrade Kueue (this toolkit "
                "pins v0.19.2)")
    return problems


def queue_fit_problem(server: ApiServer, fit: dict[str, Any], cluster: str) -> str | None:
    """Whether the admin's LocalQueue can ever admit this workload: its ClusterQueue has a
    flavor of the stack's slice shape (the flavor's node labels agree with the JobSet's node
    selector), whose nominal quota plus what it may borrow holds the stack's chips. What the
    deployer may not read (cluster-scoped queues, for a namespace's rights) is not refused."""
    kueue = f"/apis/kueue.x-k8s.io/{KUEUE_CHECK_VERSION}"
    where = f"LocalQueue {fit['namespace']}/{fit['queue']}"
    local = server.ask(where, f"{kueue}/namespaces/{fit['namespace']}/localqueues/{fit['queue']}",
                       forbidden_is_none=True)
    name = ((local or {}).get("spec") or {}).get("clusterQueue")
    queue = server.ask(f"ClusterQueue {name}", f"{kueue}/clusterqueues/{name}",
                       forbidden_is_none=True) if name else None
    if queue is None:
        return None
    spec = queue.get("spec") or {}
    suited: list[int | None] = []  # what each suited flavor can ever hold (None: no bound)
    for group in spec.get("resourceGroups") or []:
        for flavor in group.get("flavors") or []:
            found = server.ask(f"ResourceFlavor {flavor['name']}",
                               f"{kueue}/resourceflavors/{flavor['name']}",
                               forbidden_is_none=True)
            labels = ((found or {}).get("spec") or {}).get("nodeLabels") or {}
            if any(k in labels and labels[k] != v for k, v in fit["shape_labels"].items()):
                continue
            for resource in flavor.get("resources") or []:
                if resource.get("name") == "google.com/tpu":
                    borrow = resource.get("borrowingLimit")
                    in_cohort = bool(spec.get("cohortName") or spec.get("cohort"))
                    suited.append(None if borrow is None and in_cohort else
                                  int(resource.get("nominalQuota", 0)) + int(borrow or 0))
    shape = ", ".join(f"{k}={v}" for k, v in fit["shape_labels"].items())
    if not suited:
        return (f"{cluster}: {where} feeds ClusterQueue {name}, which has no flavor of this "
                f"stack's slice shape ({shape}): it would never admit the JobSet; use your "
                "namespace's LocalQueue of that shape (`kubectl get localqueues -n "
                f"{fit['namespace']}`), or change accelerator_type")
    if None in suited:
        return None  # a cohort with no borrowing limit: what others lend is unknown here
    best = max(c for c in suited if c is not None)
    if best < fit["chips"]:
        return (f"{cluster}: {where} can hold at most {best} chips of this stack's shape "
                f"(ClusterQueue {name}'s quota and borrowing limit), and the stack's "
                f"{fit['slices']} slice(s) need {fit['chips']} at once: it would never be "
                "admitted; ask the admin for more quota, or use fewer slices")
    return None


class ClusterCheckProvider(CheckOnlyProvider):
    """Refuses, at check, a cluster that cannot run the stack. Holds nothing of its own."""

    def check(self, _olds: dict[str, Any], news: dict[str, Any]) -> CheckResult:
        problems = description_problems(news)
        objects, stage = news.get("objects") or [], "crds"
        cluster = news["cluster"]
        try:
            if not problems and news["crds"]:
                absent = missing_crds(news)
                problems = [crd_problem(news, absent)] if absent else []
            if not problems and set(JOBSET_CRDS) & set(news["crds"]):
                crd = ApiServer(news).ask("the JobSet CRD", JOBSET_CRD_PATH)
                found = jobset_crd_problem(crd or {}, cluster)
                problems = [("crds", found)] if found else []
            if not problems and news.get("installs"):
                problems = [("installs", line) for line in install_problems(
                    ApiServer(news), news["installs"], cluster)]
            if not problems and news.get("uses_kueue") and not news.get("installs", {}).get(
                    "Kueue"):
                problems = [("crds", line) for line in kueue_problems(
                    ApiServer(news), cluster, bool(news.get("creates_queue_objects")))]
            stage = "objects"
            if not problems and objects:
                server = ApiServer(news)
                answers = {o["what"]: server.ask(o["what"], o["path"]) for o in objects}
                problems = [("objects", f"{cluster} has no {o['what']}: {o['fix']}")
                            for o in objects
                            if answers[o["what"]] is None and not o.get("owned_by")]
                problems += [("objects", line) for o in objects if o.get("owned_by")
                             and answers[o["what"]] is not None
                             and (line := ownership_problem(answers[o["what"]], o, cluster))]
                problems += [("objects", line) for o in objects if o.get("namespace")
                             and answers[o["what"]] is not None
                             and (line := namespace_problem(answers[o["what"]], cluster,
                                                            o["namespace"]))]
                problems += [("objects", line) for o in objects if o.get("team")
                             and answers[o["what"]] is not None
                             and (line := team_namespace_problem(answers[o["what"]], cluster))]
            if not problems and news.get("queue_fit"):
                line = queue_fit_problem(ApiServer(news), news["queue_fit"], cluster)
                problems = [("objects", line)] if line else []
            stage = "access"
            if not problems and news.get("access"):
                problems = [("access", line) for line in access_problems(
                    ApiServer(news), news["access"], cluster)]
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


def owned_objects(namespace: str | None, cluster_scoped: list[dict[str, Any]],
                  owner: dict[str, str], pod_security: str = "privileged"
                  ) -> list[dict[str, Any]]:
    """What the stack creates under names it derives (its namespace, when it declares one, and
    its cluster-scoped Kueue objects): each may be absent, but one that exists must carry the
    stack's `owner` labels (stack and project), or the create would fail AlreadyExists."""
    kueue = f"/apis/kueue.x-k8s.io/{KUEUE_CHECK_VERSION}"
    objects: list[dict[str, Any]] = []
    if namespace is not None:
        objects.append({"path": f"/api/v1/namespaces/{namespace}",
                        "what": f"namespace {namespace}", "namespace": pod_security,
                        "owned_by": owner, "fix": ""})
    plurals = {"ClusterQueue": "clusterqueues", "ResourceFlavor": "resourceflavors",
               "WorkloadPriorityClass": "workloadpriorityclasses"}
    for obj in cluster_scoped:
        plural = plurals[obj["kind"]]
        objects.append({"path": f"{kueue}/{plural}/{obj['metadata']['name']}",
                        "what": f"{obj['kind']} {obj['metadata']['name']}",
                        "owned_by": owner, "fix": ""})
    return objects


def admin_objects(namespace: str, local_queue: str | None,
                  priority_class: str | None,
                  named_namespace: bool = False,
                  pod_security: str = "baseline") -> list[dict[str, Any]]:
    """The objects of the cluster's admin the stack names: their API paths and what to say when
    one is missing. `named_namespace`: the stack runs in a namespace it names and does not
    declare, whose Pod Security level must admit `pod_security`."""
    kueue = f"/apis/kueue.x-k8s.io/{KUEUE_CHECK_VERSION}"
    objects: list[dict[str, Any]] = []
    if named_namespace:
        objects.append({"path": f"/api/v1/namespaces/{namespace}",
                        "what": f"namespace {namespace}", "namespace": pod_security,
                        "fix": "a stack creates no namespace it names (gke.namespace): ask the "
                               "cluster's admin for it, or check the name"})
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


def tpu_pool_problem(props: dict[str, Any]) -> tuple[str, str] | None:
    """A workload stack's slices need node pools of their shape, one a slice (JobSet's
    exclusive placement), or node auto-provisioning that creates them."""
    need = props.get("need_pools")
    if not need or props.get("autoprovisioning"):
        return None
    have = sum(1 for pool in props.get("tpu_pools") or []
               if (pool.get("machine_type"), pool.get("topology")) ==
               (need["machine_type"], need["topology"]))
    if have >= need["count"]:
        return None
    return ("tpu_pools", f"{props['cluster']} has {have} node pool(s) of {need['machine_type']} "
            f"with TPU topology {need['topology']} and no node auto-provisioning; this stack's "
            f"{need['count']} slice(s) need {need['count']} (one slice a pool); ask the "
            "cluster's admin (their capacity stack's slices), or change accelerator_type or "
            "slices")


def network_policy_enforced(cluster: Any) -> bool:
    """Whether the cluster enforces NetworkPolicy: GKE Dataplane V2, or network policy
    enforcement (Calico) on."""
    if getattr(cluster, "datapath_provider", "") == "ADVANCED_DATAPATH":
        return True
    policies = list(getattr(cluster, "network_policies", None) or [])
    return bool(policies and getattr(policies[0], "enabled", False))


def check_inputs(cluster: Any, *, cluster_path: str, project: str, capacity: str, family: str,
                 crds: list[str], objects: list[dict[str, Any]] | None = None,
                 access: list[dict[str, str]] | None = None,
                 need_pools: dict[str, Any] | None = None,
                 needs_network_policy: bool = False,
                 installs: dict[str, list[str]] | None = None,
                 uses_kueue: bool = False,
                 creates_queue_objects: bool = False,
                 queue_fit: dict[str, Any] | None = None,
                 admission_policy: bool = False) -> dict[str, Any]:
    """ClusterCheck's inputs from the getCluster data source's result."""
    pools = list(getattr(cluster, "workload_identity_configs", None) or [])
    auths = list(getattr(cluster, "master_auths", None) or [])
    tpu_pools = []
    for pool in getattr(cluster, "node_pools", None) or []:
        configs = list(getattr(pool, "node_configs", None) or [])
        placements = list(getattr(pool, "placement_policies", None) or [])
        tpu_pools.append({
            "machine_type": getattr(configs[0], "machine_type", "") if configs else "",
            "topology": getattr(placements[0], "tpu_topology", "") if placements else ""})
    scaling = list(getattr(cluster, "cluster_autoscalings", None) or [])
    why = f"multislice, {family}" + (f", {capacity}" if capacity in CAPACITY_MIN_VERSION else "") \
        + (", ValidatingAdmissionPolicy" if admission_policy else "")
    return {
        "cluster": cluster_path,
        "project": project,
        "autopilot": bool(getattr(cluster, "enable_autopilot", False)),
        "workload_pool": (pools[0].workload_pool if pools else "") or "",
        "master_version": getattr(cluster, "master_version", "") or "",
        "min_version": min_version(capacity, family, admission_policy),
        "why_version": why,
        "endpoint": getattr(cluster, "endpoint", "") or "",
        "ca_certificate": auths[0].cluster_ca_certificate if auths else "",
        "crds": list(crds),
        "objects": list(objects or []),
        "access": list(access or []),
        "need_pools": need_pools or {},
        "tpu_pools": tpu_pools,
        "autoprovisioning": bool(scaling and getattr(scaling[0], "enabled", False)),
        "needs_network_policy": needs_network_policy,
        "installs": dict(installs or {}),
        "uses_kueue": uses_kueue,
        "creates_queue_objects": creates_queue_objects,
        "queue_fit": dict(queue_fit or {}),
        "network_policy_enforced": network_policy_enforced(cluster),
    }
