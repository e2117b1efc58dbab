"""The Kueue stand-in's admission rules (scripts/emulators/kueue_emulator.py) on the objects a
capacity stack applies, with JobSets that only record being started."""

from __future__ import annotations

from types import SimpleNamespace

from infra.gke.manifest import capacity_objects
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
