"""`multislice rehearse` of a GKE stack: its JobSet itself, on emulated pods.

The JobSet infra/gke/manifest.py renders for the stack (scaled to at most 2 slices of 2 pods of
4 chips: GKE runs multislice on multi-host pools only) runs on scripts/emulators/jobset_emulator.py:
the pods boot the ConfigMap's startup script with what GKE and JobSet give them, and JobSet's
failure policy restarts or fails them. `--disrupt-at-step N` kills a pod's node (DisruptionTarget:
a restart that does not count), `--crash-at-step N` its container (exit 137: one that counts
against max_restarts), and an edit of the code or the stack file is applied as `pulumi up` applies
it on GKE: a new launch spec, which a running JobSet's pods take in place (a JobSet whose run has
ended, or whose pod template changed, is replaced on the same nodes).

The JobSet and its pods are mirrored into a Kubernetes API server on loopback (kmock, the real REST
protocol) after every change, so `multislice status`, `watch` and `babysit` of the stack work
against the rehearsal exactly as against a cluster, with the two variables printed at the start;
a babysit that deletes a Failed JobSet and creates it again is acted on: the rehearsal starts the
recreated object's pods. On every change of the JobSet's state or restarts the rehearsal prints
what `multislice status` prints.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import os
import time
from pathlib import Path
from typing import Any

from scripts.argtypes import UsageError
from scripts.rehearse.stack import (
    LOG_PREFIX,
    CodeSteps,
    Source,
    Tail,
    apply_edit,
    echoed,
    report_events,
)

JOBSET_NODE = "gke-rehearse-node-{}-{}"  # the mirrored pods' nodeName


class ClusterMirror:
    """The emulated JobSet and its pods as Kubernetes objects in a KubeApi."""

    def __init__(self, api: Any) -> None:
        self.api = api

    def write(self, jobset: Any) -> None:
        from scripts.emulators.kube_api import JOBSETS, PODS

        conditions = []
        if jobset.state == "Failed":
            conditions.append({"type": "Failed", "status": "True", "reason": jobset.reason,
                               "message": f"jobset failed: {jobset.reason}"})
        elif jobset.state == "Completed":
            conditions.append({"type": "Completed", "status": "True",
                               "reason": "AllJobsCompleted", "message": "jobset completed"})
        body = {**jobset.jobset, "status": {"restarts": jobset.restarts,
                                            "restartsCountTowardsMax":
                                                jobset.status.restarts_count_towards_max,
                                            "conditions": conditions}}
        self.api.put(JOBSETS, jobset.name, body, jobset.namespace)
        for index, pod in enumerate(jobset.pods):
            alive = pod.proc is not None and pod.proc.poll() is None
            code = None if alive or pod.proc is None else pod.proc.returncode
            phase = "Running" if alive else ("Succeeded" if code == 0 else
                                             "Pending" if pod.proc is None else "Failed")
            self.api.put(PODS, pod.name, {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": pod.name, "namespace": jobset.namespace,
                             "labels": dict(pod.labels)},
                "spec": {"nodeName": JOBSET_NODE.format(*divmod(index, jobset.nodes)),
                         "containers": [{"name": jobset.container["name"],
                                         "image": jobset.container["image"]}]},
                "status": {"phase": phase, "containerStatuses": [{
                    "name": jobset.container["name"], "ready": alive, "restartCount": 0,
                    "image": jobset.container["image"], "imageID": "", "started": alive,
                    **({"state": {"terminated": {"exitCode": code if code >= 0 else 128 - code}}}
                       if code is not None else {})}]},
            }, jobset.namespace)

    def remove_pods(self, jobset: Any) -> None:
        from scripts.emulators.kube_api import PODS

        for pod in jobset.pods:
            with contextlib.suppress(Exception):
                self.api.remove(PODS, pod.name, jobset.namespace)

    def remove(self, jobset: Any) -> None:
        from scripts.emulators.kube_api import JOBSETS

        self.api.remove(JOBSETS, jobset.name, jobset.namespace)

    def read(self, jobset: Any) -> dict[str, Any] | None:
        from scripts.emulators.kube_api import JOBSETS

        return self.api.get(JOBSETS, jobset.name, jobset.namespace)


@contextlib.contextmanager
def _storage_at(url: str) -> Any:
    """The Google storage client's own override, for this process's reads of the bucket."""
    before = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = url
    try:
        yield
    finally:
        if before is None:
            del os.environ["STORAGE_EMULATOR_HOST"]
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = before


def _status_text(api_url: str, storage_url: str, cfg: Any) -> str:
    """What `multislice status` prints for the stack against the mirror and the bucket."""
    from kubernetes import client
    from rich.console import Console

    from scripts.gke.status import run_status

    conf = client.Configuration()
    conf.host = api_url
    out = io.StringIO()
    console = Console(file=out, width=120, color_system=None, soft_wrap=True)
    with client.ApiClient(conf) as api, _storage_at(storage_url):
        run_status(api, cfg, console)
    return out.getvalue().rstrip()


def status_update(shown: str, text: str) -> str:
    """What `multislice status` prints now: whole the first time, then only its changed lines
    (a table of every pod on every change buries what changed)."""
    if not shown:
        return f"{LOG_PREFIX} multislice status:\n{text}"
    changed = [line[2:] for line in difflib.ndiff(shown.splitlines(), text.splitlines())
               if line.startswith("+ ")]
    return f"{LOG_PREFIX} multislice status, what changed:\n" + "\n".join(changed)


def rehearse_jobset(source: Source, raw: dict[str, Any], workdir: Path,
                    args: argparse.Namespace) -> int:
    import shutil

    from scripts.emulators.boot_harness import Stack
    from scripts.emulators.gcs_emulator import GcsEmulator
    from scripts.emulators.jobset_emulator import EmulatedJobSet
    from scripts.emulators.kube_api import KubeApi
    from scripts.emulators.tpu_image import (
        ImageUnavailable,
        build_container_image,
        build_image,
    )

    images = workdir / "image"
    if images.exists():
        shutil.rmtree(images)
    (images / "vm").mkdir(parents=True)
    (images / "pod").mkdir()
    try:
        pod_image = build_container_image(images / "pod", build_image(images / "vm"))
    except ImageUnavailable as exc:
        raise UsageError(f"cannot build the emulated pod image: {exc}") from None
    (workdir / "bucket").mkdir(exist_ok=True)
    cluster = workdir / "cluster"
    with GcsEmulator(root=workdir / "bucket") as gcs, KubeApi() as api:
        stack = Stack(gcs, workdir / "experiment", source.cfg.stack, raw=raw)
        mirror = ClusterMirror(api)
        print(f"{LOG_PREFIX} the JobSet's API, for `multislice status | watch | babysit`: "
              f"MULTISLICE_KUBERNETES_API={api.url} STORAGE_EMULATOR_HOST={gcs.url} "
              f".venv/bin/multislice status --stack-config {source.stack_file}", flush=True)
        running: list[Any] = []  # every JobSet started, the current one last
        try:
            _start(EmulatedJobSet.for_stack(stack, pod_image, cluster), mirror, stack, running)
            return _watch(source, stack, running, mirror, (api.url, gcs.url), pod_image,
                          cluster, workdir, args)
        finally:
            from scripts.emulators.boot_harness import Host

            if running:
                running[-1].stop()
            Host.stop_all()  # and the job's network namespace
            _keep_logs(running, workdir / "logs")


def _keep_logs(running: list[Any], kept: Path) -> None:
    """Each pod's logs: the newest attempt's in logs/POD/, every attempt's in
    logs/POD/attempt-N/ (N counts the pod's attempts over every JobSet run)."""
    import shutil

    counts: dict[str, int] = {}
    for pod in (p for js in running for attempt in js.attempts for p in attempt):
        counts[pod.name] = counts.get(pod.name, 0) + 1
        for dest in (kept / pod.name / f"attempt-{counts[pod.name]}", kept / pod.name):
            dest.mkdir(parents=True, exist_ok=True)
            for path in (pod.console, pod.logs / "startup.log", pod.logs / "train.log"):
                if path.exists():
                    shutil.copy2(path, dest / path.name)
    print(f"{LOG_PREFIX} the pods' logs are in {kept}; the bucket stays in "
          f"{kept.parent / 'bucket'} for the next rehearsal", flush=True)


def _start(jobset: Any, mirror: ClusterMirror, stack: Any, running: list[Any]) -> Any:
    print(f"{LOG_PREFIX} JobSet {jobset.namespace}/{jobset.name}: {jobset.slices} slice(s) of "
          f"{jobset.nodes} pods, launch spec generation {stack.generation()} (code "
          f"{stack.sha[:12]})", flush=True)
    jobset.start()
    mirror.write(jobset)
    running.append(jobset)
    return jobset


def _watch(source: Source, stack: Any, running: list[Any], mirror: ClusterMirror,
           urls: tuple[str, str], pod_image: Any, cluster: Path, workdir: Path,
           args: argparse.Namespace) -> int:
    from scripts.emulators.jobset_emulator import EmulatedJobSet

    jobset = running[-1]
    tails: dict[str, Tail] = {}
    seen_events, next_check = 0, time.monotonic() + args.poll_s
    codes = CodeSteps(stack.generation(), stack.sha)
    injections = {k: v for k, v in (("disrupt", args.disrupt_at_step),
                                     ("crash", args.crash_at_step)) if v}
    shown, gone = "", False
    told = 0  # the current JobSet's controller history lines printed
    step, fired_at = 0, 0.0  # the highest step written since the last drill fired
    while True:
        for pod in jobset.pods:
            for name, path in ((f"{pod.name} console", pod.console),
                               (f"{pod.name} train", pod.logs / "train.log")):
                tail = tails.setdefault(f"{pod.priv}:{name}", Tail(path))
                for line in tail.lines():
                    if echoed(line):
                        print(f"[{pod.name}] {line}", flush=True)
        events, seen_events = report_events(stack, codes, seen_events)
        # One drill at a time: the next waits for a step its restarted pods wrote, so a crash
        # at a later step than a disruption hits the pods the disruption's restart made.
        step = max([step, *(int(e["step"]) for e in events
                            if e["event"] == "step" and float(e["time"]) > fired_at)])
        for kind, at in sorted(injections.items(), key=lambda item: item[1])[:1]:
            if step >= at and jobset.state == "Running" and jobset.running_pods():
                target = jobset.running_pods()[-1]
                pod = jobset.kill_pod(target.slice_index, target.worker,
                                      node_died=kind == "disrupt")
                print(f"{LOG_PREFIX} step {step}: " + (
                    f"the node of pod {pod.name} died (DisruptionTarget)" if kind == "disrupt"
                    else f"the container of pod {pod.name} was killed (exit 137)"), flush=True)
                del injections[kind]
                step, fired_at = 0, time.time()
        # A babysit (or kubectl) deleted the JobSet: its pods go, and it is no longer mirrored
        # (a write would bring it back) until the API creates it again: then it runs.
        stored = mirror.read(jobset)
        if stored is None and not gone:
            print(f"{LOG_PREFIX} JobSet {jobset.namespace}/{jobset.name} deleted through the "
                  "API: deleting its pods", flush=True)
            jobset.delete_pods()
            mirror.remove_pods(jobset)
            gone = True
        elif stored is not None and "status" not in stored:
            body = {k: stored[k] for k in ("apiVersion", "kind", "metadata", "spec")}
            try:
                created = EmulatedJobSet(body, jobset.boot_files, stack, pod_image, cluster,
                                         jobset.devices_per_pod)
            except (ValueError, KeyError) as exc:  # what the API server would have refused
                print(f"{LOG_PREFIX} JobSet {jobset.namespace}/{jobset.name} created through "
                      f"the API cannot run here: {exc}", flush=True)
                mirror.remove(jobset)
            else:
                print(f"{LOG_PREFIX} JobSet {jobset.namespace}/{jobset.name} created through "
                      "the API: starting its pods", flush=True)
                jobset = _start(created, mirror, stack, running)
                gone, shown, told = False, "", 0
        if not gone:
            before = (jobset.state, jobset.restarts)
            jobset.reconcile()
            mirror.write(jobset)
            for line in jobset.history[told:]:
                print(f"{LOG_PREFIX} JobSet controller: {line}", flush=True)
            told = len(jobset.history)
            if (jobset.state, jobset.restarts) != before or not shown:
                text = _status_text(*urls, stack.cfg)
                if text != shown:
                    print(status_update(shown, text), flush=True)
                    shown = text
        if args.exit_when_done and not gone and jobset.state in ("Completed", "Failed"):
            print(f"{LOG_PREFIX} JobSet {jobset.state}"
                  + (f" ({jobset.reason})" if jobset.reason else ""), flush=True)
            return 0 if jobset.state == "Completed" else 1
        if time.monotonic() >= next_check:
            next_check = time.monotonic() + args.poll_s
            change = apply_edit(source, stack, workdir, args)
            if change is not None:
                codes.published(stack.generation(), stack.sha)
            # A running JobSet's pods follow the new spec in place (infra/gke/live_run.py);
            # one whose run has ended, or a new pod template, is replaced on the same nodes.
            ended = gone or jobset.state in ("Completed", "Failed")
            if change == "keeps" and not ended:
                print(f"{LOG_PREFIX} JobSet {jobset.namespace}/{jobset.name} runs: kept; its "
                      "pods restart their trainers on the new launch spec in place",
                      flush=True)
            elif change is not None:
                print(f"{LOG_PREFIX} " + ("its run has ended: " if change == "keeps" else
                                          "a new pod template: ")
                      + f"replacing {jobset.namespace}/{jobset.name} on the same nodes",
                      flush=True)
                jobset.delete_pods()
                mirror.remove_pods(jobset)
                jobset = _start(EmulatedJobSet.for_stack(stack, pod_image, cluster), mirror,
                                stack, running)
                gone, shown, told = False, "", 0
        time.sleep(0.5)

