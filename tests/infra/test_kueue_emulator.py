"""The Kueue stand-in's admission rules (scripts/emulators/kueue_emulator.py) on the objects a
capacity stack applies, with JobSets that only record being started."""

from __future__ import annotations

from types import SimpleNamespace

from infra.gke.capacity import capacity_objects
from infra.stack_config.schema import parse_stack
from scripts.emulators.kueue_emulator import EmulatedKueue


def capacity(**gke):
    return parse_stack({
        "project": "platform-proj", "region": "us-central1", "zone": "us-central1-a",
        "accelerator_type": "v5litepod-16", "slices": 2, "orchestration": "gke",
        "gke": {"kind": "capacity", "create_cluster": True,
                "team_namespaces": ["team-a", "team-b"],
                "priority_classes": {"high": 1000, "low": 10}, **gke}}, "pool")


def jobset(name: str, namespace: str, slices: int = 1, queue: str = "tpu",
           priority: str | None = None) -> SimpleNamespace:
    labels = {"kueue.x-k8s.io/queue-name": queue,
              **({"kueue.x-k8s.io/priority-class": priority} if priority else {})}
    js = SimpleNamespace(
        name=name, namespace=namespace, slices=slices, nodes=4, state="Pending", pods=[],
        jobset={"metadata": {"name": name, "namespace": namespace, "labels": labels}},
        pod_spec={"containers": [{"resources": {"requests": {"google.com/tpu": 4}}}],
                  "nodeSelector": {"cloud.google.com/gke-tpu-topology": "4x4"}})
    js.start = lambda: setattr(js, "state", "Running")
    return js


def test_the_quota_is_the_pools_and_a_later_job_waits_for_it():
    kueue = EmulatedKueue.from_objects(capacity_objects(capacity()))
    a, b, c = jobset("a", "team-a", slices=2), jobset("b", "team-b"), jobset("c", "team-a")
    for js in (a, b, c):
        kueue.submit(js)
    kueue.reconcile()
    assert (a.state, b.state, c.state) == ("Running", "Suspended", "Suspended")
    assert a.pod_spec["nodeSelector"]["multislice-stack"] == "pool"  # the flavor's labels
    a.state = "Completed"
    kueue.reconcile()
    assert (b.state, c.state) == ("Running", "Running")  # 16 + 16 chips of 32


def test_a_higher_priority_is_admitted_first_and_other_namespaces_never():
    kueue = EmulatedKueue.from_objects(capacity_objects(capacity()))
    low, high = jobset("low", "team-a", slices=2, priority="low"), \
        jobset("high", "team-b", slices=2, priority="high")
    stranger, lost = jobset("x", "team-c"), jobset("y", "team-a", queue="nope")
    for js in (low, high, stranger, lost):
        kueue.submit(js)
    kueue.reconcile()
    assert (high.state, low.state) == ("Running", "Suspended")
    assert (stranger.state, lost.state) == ("Suspended", "Suspended")
    assert any("its LocalQueue does not exist" in line for line in kueue.history)


# ---- the queue enforced: only what Kueue admitted tolerates the capacity's tainted pools ----


def _workload_jobset(team: str, queue: str | None = "tpu", slices: int = 1,
                     accelerator_type: str = "v5litepod-16", name: str = "",
                     priority: str | None = None) -> SimpleNamespace:
    """A team's workload stack's JobSet as infra/gke renders it, recording its start."""
    import copy

    from infra.gke.manifest import jobset as render_jobset

    gke = {"kind": "workload", "namespace": team, "local_queue": queue or "tpu",
           "cluster": "projects/platform-proj/locations/us-central1/clusters/c",
           **({"priority_class": priority} if priority else {})}
    cfg = parse_stack({
        "project": f"{team}-proj", "region": "us-central1", "zone": "us-central1-a",
        "accelerator_type": accelerator_type, "slices": slices, "orchestration": "gke",
        "experiment_dir": "experiments/x", "gke": gke,
        "trainer": {"config": "tiny", "steps": 3, "mesh": {"ici_fsdp": 16}}},
        name or f"w{team[-1]}")
    obj = render_jobset(cfg, "0" * 64)
    if queue is None:  # what a team member might apply by hand: no queue label
        del obj["metadata"]["labels"]["kueue.x-k8s.io/queue-name"]
    rjob = obj["spec"]["replicatedJobs"][0]
    js = SimpleNamespace(
        name=obj["metadata"]["name"], namespace=team, slices=rjob["replicas"],
        nodes=rjob["template"]["spec"]["parallelism"], state="Pending", pods=[], jobset=obj,
        pod_spec=copy.deepcopy(rjob["template"]["spec"]["template"]["spec"]))
    js.start = lambda: setattr(js, "state", "Running")
    return js


def _capacity_nodes(cfg):
    from infra.gke.capacity import capacity_shapes, node_pool
    from infra.gke.topology import gke_slice
    from scripts.emulators.scheduler import nodes_of_pool

    return [node for name, shaped in capacity_shapes(cfg) for i in range(shaped.slices)
            for node in nodes_of_pool(node_pool(shaped, i, name),
                                      gke_slice(shaped.topology).accelerator)]


def test_a_jobset_that_skips_the_queue_gets_no_tpu_node_and_an_admitted_one_does():
    from scripts.emulators.scheduler import schedule

    cfg = capacity()
    nodes = _capacity_nodes(cfg)
    assert len(nodes) == 8 and all(
        {"key": "multislice.dev/stack", "value": "ms-pool", "effect": "NoSchedule"} in n.taints
        for n in nodes)
    kueue = EmulatedKueue.from_objects(capacity_objects(cfg))
    admitted, sneaky = _workload_jobset("team-a"), _workload_jobset("team-b", queue=None)
    kueue.submit(admitted)
    kueue.reconcile()
    assert admitted.state == "Running"
    # the unqueued JobSet is not Kueue's (no queue name): nothing suspends it, and nothing lets
    # its pods onto the pools
    placed = [schedule(f"{sneaky.name}-{i}", sneaky.pod_spec, nodes) for i in range(4)]
    assert all(node is None for node, _ in placed)
    assert placed[0][1] == "0/8 nodes are available: 8 node(s) had untolerated taint " \
        "{multislice.dev/stack: ms-pool}"
    for i in range(admitted.nodes):
        node, event = schedule(f"{admitted.name}-{i}", admitted.pod_spec, nodes)
        assert node is not None, event
    assert admitted.pod_spec["tolerations"][-1] == {
        "key": "multislice.dev/stack", "operator": "Equal", "value": "ms-pool",
        "effect": "NoSchedule"}


def test_a_flavor_whose_taints_nothing_tolerates_admits_nothing():
    objects = capacity_objects(capacity())
    for obj in objects:
        if obj["kind"] == "ResourceFlavor":
            del obj["spec"]["tolerations"]
    kueue = EmulatedKueue.from_objects(objects)
    js = _workload_jobset("team-a")
    kueue.submit(js)
    kueue.reconcile()
    assert js.state == "Suspended"
    assert any("untolerated taint multislice.dev/stack" in line for line in kueue.history)



# ---- two teams, two shapes, one capacity: quotas in a cohort (issue: sharing safely) ----


def two_team_capacity():
    return parse_stack({
        "project": "platform-proj", "region": "us-central1", "zone": "us-central1-a",
        "orchestration": "gke",
        "gke": {"kind": "capacity", "create_cluster": True,
                "shapes": {"v5e": {"accelerator_type": "v5litepod-16", "slices": 2,
                                   "capacity": "spot"},
                           "v6e": {"accelerator_type": "v6e-16", "slices": 1}},
                "teams": {"team-a": {"quota": {"v5e": 16, "v6e": 8}},
                          "team-b": {"quota": {"v5e": 16, "v6e": 8},
                                     "lending_limit": {"v6e": 0}}},
                "priority_classes": {"high": 1000, "low": 10}}}, "plat")


def _place(js, nodes) -> list[str]:
    from scripts.emulators.scheduler import schedule

    placed = [schedule(f"{js.name}-{i}", js.pod_spec, nodes) for i in range(js.slices * js.nodes)]
    assert all(node is not None for node, _ in placed), [event for _, event in placed]
    return [node.name for node, _ in placed]


def test_two_teams_two_shapes_each_within_its_quota_borrowing_what_the_other_lends():
    from infra.stack_config.validation import stack_problems

    cfg = two_team_capacity()
    assert stack_problems(cfg)[0] == []
    kueue = EmulatedKueue.from_objects(capacity_objects(cfg))
    nodes = _capacity_nodes(cfg)
    assert sorted({n.labels["multislice-shape"] for n in nodes}) == ["v5e", "v6e"]

    # team A runs two slices of v5e: its 16 chips and 16 that team B lends while idle
    a_big = _workload_jobset("team-a", "v5e", slices=2, name="abig")
    kueue.submit(a_big)
    kueue.reconcile()
    assert a_big.state == "Running", kueue.history
    assert "borrowing 16 from cohort ms-plat" in kueue.history[-1]
    assert {n.split("-s")[0] for n in _place(a_big, nodes)} == {"ms-plat-v5e"}

    # team B wants its own 16 back: Kueue reclaims them, A's JobSet is evicted (a disruption)
    b_v5e = _workload_jobset("team-b", "v5e", name="bsmall")
    kueue.submit(b_v5e)
    kueue.reconcile()
    assert (a_big.state, b_v5e.state) == ("Suspended", "Running"), kueue.history
    assert kueue.status(a_big) == "pending: evicted: reclaimed by ClusterQueue "         "ms-plat-team-b-v5e within cohort ms-plat (team-b/ms-bsmall)"
    kueue.reconcile()  # and A's two slices wait: B lends nothing while it runs
    assert "do not fit ClusterQueue ms-plat-team-a-v5e's quota (0 of 16 in use) and what "         "cohort ms-plat lends now (0 chips)" in kueue.status(a_big)

    # v6e: B lends none of its 8 (lending_limit 0), so A's 16-chip slice can never fit
    a_v6e = _workload_jobset("team-a", "v6e", accelerator_type="v6e-16", name="av6e")
    kueue.submit(a_v6e)
    kueue.reconcile()
    assert a_v6e.state == "Suspended" and "lends now (0 chips)" in kueue.status(a_v6e)

    # a queue of one shape never admits another shape's JobSet
    wrong = _workload_jobset("team-a", "v5e", accelerator_type="v6e-16", name="wrong")
    kueue.submit(wrong)
    kueue.reconcile()
    assert kueue.status(wrong) == "pending: no flavor of ClusterQueue ms-plat-team-a-v5e has "         "the pods' node labels (inadmissible)"

    # B finishes; A's two slices come back on the same pools
    b_v5e.state = "Completed"
    kueue.reconcile()
    assert a_big.state == "Running", kueue.history


def test_within_a_teams_queue_a_higher_priority_preempts_a_lower_one():
    cfg = two_team_capacity()
    kueue = EmulatedKueue.from_objects(capacity_objects(cfg))
    # B holds its own 16 v5e chips, so A cannot borrow: A's queue has exactly its 16
    b_hold = _workload_jobset("team-b", "v5e", name="bhold")
    low = _workload_jobset("team-a", "v5e", name="low", priority="low")
    for js in (b_hold, low):
        kueue.submit(js)
    kueue.reconcile()
    high = _workload_jobset("team-a", "v5e", name="high", priority="high")
    kueue.submit(high)
    kueue.reconcile()
    assert (low.state, high.state, b_hold.state) == ("Suspended", "Running", "Running")
    assert "preempted in ClusterQueue ms-plat-team-a-v5e by a higher priority" in \
        kueue.status(low)


# ---- the toleration guard: only Kueue gives a team's workload the capacity's toleration ----


def _guard():
    from infra.gke.capacity import toleration_guard

    policy, binding = toleration_guard(capacity())
    return policy, binding


def _review(obj, *, user="alice@example.com", operation="CREATE", namespace="team-a", old=None,
            group="jobset.x-k8s.io", resource="jobsets"):
    from tests.support.admission_policy import review

    policy, binding = _guard()
    return review(policy, binding, operation=operation, group=group, resource=resource,
                  namespace=namespace, user=user, obj=obj, old=old)


def test_only_kueue_and_template_copying_controllers_may_tolerate_the_capacity_taint():
    import copy

    from infra.gke.manifest import capacity_toleration

    js = _workload_jobset("team-a")
    queued = {**js.jobset, "kind": "JobSet"}
    assert _review(queued) is None  # a queued JobSet as the toolkit renders it
    sneaky = copy.deepcopy(queued)
    template = sneaky["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    template["tolerations"].append(capacity_toleration(capacity()))
    refused = _review(sneaky)
    assert refused and refused.startswith("only workloads that Kueue admitted may tolerate")
    everything = copy.deepcopy(queued)
    everything["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
        "tolerations"].append({"operator": "Exists"})
    assert _review(everything) is not None  # tolerating every taint is tolerating this one
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
           "spec": {"containers": [{"name": "c"}], "tolerations": [
               capacity_toleration(capacity())]}}
    assert _review(pod, group="", resource="pods") is not None
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"},
                  "spec": {"template": {"spec": pod["spec"]}}}
    assert _review(deployment, group="apps", resource="deployments") is not None
    # Kueue injects it at admission; JobSet's and the Job controller copy it into what they make
    from infra.gke.capacity import JOBSET_CONTROLLER, KUEUE_CONTROLLER

    assert _review(sneaky, user=KUEUE_CONTROLLER, operation="UPDATE", old=queued) is None
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j"},
           "spec": {"template": {"spec": pod["spec"]}}}
    assert _review(job, user=JOBSET_CONTROLLER, group="batch", resource="jobs") is None
    assert _review(pod, user="system:serviceaccount:kube-system:job-controller", group="",
                   resource="pods") is None
    # a user's later update may keep what Kueue added, never add one
    assert _review(sneaky, operation="UPDATE", old=sneaky) is None
    assert _review(sneaky, operation="UPDATE", old=queued) is not None
    # outside the team namespaces the guard does not apply
    assert _review(sneaky, namespace="platform-tools") is None
