"""A JobSet's pods on the emulated TPU image, with what GKE and the JobSet controller do around them.

Test support, never production: this plays the parts of a GKE cluster that have no stand-in on
this machine, following their documented behaviour, and runs the toolkit's own objects unchanged:
the JobSet object infra/gke/manifest.py renders (its replicas, parallelism, container command,
environment, boot ConfigMap mount, failure policy and grace period are read from it) and the boot
files of the ConfigMap.

- Each pod is an emulated host of scripts/emulators/boot_harness.py (the image's Python and users,
  its own disks and /dev with the TPU device nodes), in the job's network namespace. Its hostname
  is the pod's (JOBSET-RJOB-J-P), and /etc/hosts resolves every pod's DNS name in the JobSet's
  headless service (JOBSET-RJOB-J-P.JOBSET) to the namespace's loopback, as cluster DNS would.
- The environment GKE's TPU webhook gives a pod of an Indexed Job that requests google.com/tpu
  (GKE's TPU docs): TPU_WORKER_ID (the completion index) and TPU_WORKER_HOSTNAMES (the slice's
  pods, in index order); nothing else. The pod spec's own `env` is resolved as the kubelet does,
  `valueFrom.fieldRef` of metadata.labels and metadata.annotations included, against the labels
  the JobSet controller puts on every pod (jobset.sigs.k8s.io/jobset-name, jobset-uid, replicatedjob-name,
  replicatedjob-replicas, job-index, restart-attempt, and the Job's completion index).
- GKE's metadata server under Workload Identity: an access token, and no instance attributes.
- Nodes that outlive their pods: pod P of Job J runs on node J-P in every attempt (the slice's
  node pool is exactly its size), whose directories back the pod spec's hostPath volumes, while
  each pod's own filesystem is new (a recreated pod is a new container).
- The Job and JobSet controllers' failure handling (scripts/emulators/jobset_policy.py, with
  its sources): a Job fails when a pod fails (backoffLimit 0), with the reason and message its
  podFailurePolicy gives; the JobSet's failurePolicy rules choose FailJobSet, RestartJobSet
  (counted against maxRestarts) or RestartJobSetAndIgnoreMaxRestarts. A restart deletes every
  pod (SIGTERM to the container's first process, SIGKILL after terminationGracePeriodSeconds)
  and creates them again. A pod whose node dies (kill_pod) gets the DisruptionTarget condition,
  as the taint manager or PodGC gives it; a container killed on a live node does not.
- Success as JobSet's default successPolicy has it (operator All over every replicated job): an
  Indexed Job completes when every index's pod succeeded, and the JobSet once every Job has; its
  pods are gone then. A new JobSet of the same name (`pulumi up` replacing it) is a new object on
  the same nodes: for_stack again.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.parse
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from scripts.emulators.boot_harness import Host, Stack, log_tail
from scripts.emulators.crd_admission import admit
from scripts.emulators.jobset_policy import (
    DISRUPTION_TARGET,
    JobSetStatus,
    PodFailure,
    apply_action,
    job_failure,
    jobset_action,
)
from scripts.emulators.metadata_server import FakeMetadataServer
from scripts.emulators.tpu_image import (
    EMULATED_HEARTBEAT_TIMEOUT_S,
    HOST_DISK_DIRS,
    Image,
    emulated_xla_flags,
    image_env,
)

# After the image's host setup, as root in the pod's namespaces: the ConfigMap's files mounted
# read-only where the pod spec mounts them, cluster DNS for the JobSet's pods, then the command.
POD_SETUP = r"""
set -euo pipefail
files="$1" mount_path="$2" hosts="$3" bounding="$4" no_new_privs="$5"
shift 5
mkdir -p "$mount_path"
mount --bind "$files" "$mount_path"
mount -o remount,bind,ro "$mount_path"
for name in $hosts; do printf '127.0.0.1 %s\n' "$name" >>/etc/hosts; done
# The container's securityContext as the runtime applies it: the capabilities it keeps (the
# bounding set: root gets no others at exec) and no privilege escalation (no_new_privs).
args=(--inh-caps=-all --bounding-set "$bounding")
[[ "$no_new_privs" != 1 ]] || args+=(--no-new-privs)
exec setpriv "${args[@]}" -- "$@"
"""


def bounding_set(security_context: dict[str, Any]) -> tuple[str, str]:
    """setpriv's --bounding-set for a container's securityContext.capabilities (drop ALL, then
    what it adds; without a drop, the runtime's default set, here every capability), and
    whether no_new_privs is set (allowPrivilegeEscalation: false)."""
    caps = security_context.get("capabilities") or {}
    added = ",".join(f"+{c.lower()}" for c in caps.get("add", []))
    dropped_all = "ALL" in caps.get("drop", [])
    bounding = ("-all" + (f",{added}" if added else "")) if dropped_all else "+all"
    return bounding, "1" if security_context.get("allowPrivilegeEscalation") is False else "0"


def resolve_env(item: dict[str, Any], labels: dict[str, str]) -> str:
    """One `env` entry's value as the kubelet resolves it: `value`, or a downward-API fieldRef of
    the pod's labels or annotations (JobSet writes its keys as both)."""
    if "value" in item:
        return item["value"]
    path = item["valueFrom"]["fieldRef"]["fieldPath"]
    match = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if match is None or match[2] not in labels:
        raise ValueError(f"env {item['name']}: fieldRef {path!r} names nothing this pod has")
    return labels[match[2]]


class Pod(Host):
    """One pod of the JobSet: completion index `index` of the Job of slice `slice_index`."""

    disrupted = False  # the pod has condition DisruptionTarget (EmulatedJobSet.kill_pod)
    labels: dict[str, str] = {}  # what the JobSet and Job controllers put on the pod
    init: Pod | None = None  # the init container running now (a Pod of its own filesystem)
    init_next = 0  # the index of the next init container to run
    init_logs: list[Path]  # each finished init container's log directory, in order

    @property
    def active_console(self) -> Path:
        """The console of what runs now: an init container, or the pod's container."""
        return self.init.console if self.init is not None else self.console

    def start_pod(self, stack: Stack, container: dict[str, Any], env: dict[str, str],
                  boot_files: dict[str, str], mount_path: str, dns_names: list[str],
                  devices: int, host_paths: Sequence[tuple[Path, str]] = ()) -> None:
        """`host_paths`: (the node's directory, the mount path) of each hostPath volume."""
        self.metadata = FakeMetadataServer({}).__enter__()  # a token, no instance attributes
        network = stack.network()
        for url in (*stack.gcs.env.values(), f"http://{self.metadata.host}"):
            network.forward(urllib.parse.urlsplit(url).port)
        pod_env = {item["name"]: resolve_env(item, self.labels)
                   for item in container.get("env", [])}
        full_env = image_env({
            **stack.gcs.env,
            "GCE_METADATA_HOST": self.metadata.host,
            "GCE_METADATA_IP": self.metadata.host,
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": emulated_xla_flags(devices),
            "MULTISLICE_HEARTBEAT_TIMEOUT_S": str(EMULATED_HEARTBEAT_TIMEOUT_S),
            **env,
            **pod_env,
        })
        files = self.fs / "tmp" / "configmap"  # the pod's own /tmp/configmap once it runs
        files.mkdir(parents=True, exist_ok=True)
        for name, text in boot_files.items():
            (files / name).write_text(text)
        bounding, no_new_privs = bounding_set(container.get("securityContext") or {})
        self.launch(network, full_env, stack.cfg.accelerator_type,
                    ["bash", "-c", POD_SETUP, "pod-setup", "/tmp/configmap", mount_path,
                     " ".join(dns_names), bounding, no_new_privs, *container["command"]],
                    binds=host_paths, own_pids=True)

    def last_words(self, code: int) -> str:
        """Why the pod ended with `code`, for the controller's history (a failing test's first
        line of report): the signal that killed it, else the trainer's last line that gives a
        reason (a fatal log line, an error, an exception)."""
        if code < 0:  # killed: whatever the trainer logged last is not why
            return f" ({signal.Signals(-code).name})"
        lines = log_tail(self.train_log(), 20000).splitlines()[-40:]  # not a recovered error
        # absl's LOG(FATAL): JAX's coordination client ends a process with its status, and the
        # line after it names the tasks
        fatal = [" ".join(lines[i:i + 2]).split("absl::Status: ")[-1]
                 for i, line in enumerate(lines) if re.match(r"F\d{4} ", line)]
        errors = [line for line in lines if line.startswith("error") or "Error:" in line]
        reason = (fatal or errors or [""])[-1]
        return f" ({reason[:300]})" if reason else ""

    def send_term(self) -> None:
        """What the kubelet does first when the pod is deleted: SIGTERM to the container's
        first process, PID 1 of the pod's PID namespace."""
        pid = self.init_pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    def terminate(self, grace_s: float) -> str:
        """The rest of a pod deletion once its SIGTERM is sent (EmulatedJobSet.delete_pods): the
        grace period for the container's first process to exit, then SIGKILL to everything.
        Returns how it ended."""
        if self.init is not None:  # deleted while an init container ran: that is what ends
            ended = self.init.terminate(grace_s)
            self.init_logs.append(self.init.logs)
            self.init = None
            self.stop()
            return f"{ended} (init container)"
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace_s)
        ended = "gone" if self.proc is None else (
            f"exit {self.proc.returncode}" if self.proc.poll() is not None
            else "killed after the grace period")
        self.stop()
        # A deleted pod's container filesystem goes with it (its logs stay, for the test's
        # report): the pods that replace it start from an empty one.
        for own in HOST_DISK_DIRS:
            if own != "var/log/multislice":
                shutil.rmtree(self.fs / own, ignore_errors=True)
        return ended


class EmulatedJobSet:
    """The JobSet object's pods, run and restarted as JobSet's controller would."""

    def __init__(self, jobset: dict[str, Any], boot_files: dict[str, str], stack: Stack,
                 image: Image, root: Path, devices_per_pod: int) -> None:
        # What the API server stores (schema defaults, JobSet's webhook), or its refusal.
        jobset, refused = admit(jobset)
        if refused:
            raise ValueError(f"the API server would refuse this JobSet: {refused}")
        self.jobset = jobset
        self.boot_files = boot_files
        self.stack = stack
        self.image = image
        self.root = root
        self.devices_per_pod = devices_per_pod
        (self.rjob,) = jobset["spec"]["replicatedJobs"]
        job = self.rjob["template"]["spec"]
        assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"]
        self.pod_spec = job["template"]["spec"]
        (self.container,) = self.pod_spec["containers"]
        volumes = {v["name"]: v for v in self.pod_spec["volumes"]}
        (mount,) = [m for m in self.container["volumeMounts"]
                    if "configMap" in volumes[m["name"]]]
        self.mount_path = mount["mountPath"]
        self.init_containers = self.pod_spec.get("initContainers") or []
        for container in (self.container, *self.init_containers):
            # A memory emptyDir at /dev/shm is what the image's host setup gives every host.
            assert all("configMap" in volumes[m["name"]] or "hostPath" in volumes[m["name"]] or (
                m["mountPath"] == "/dev/shm"
                and volumes[m["name"]]["emptyDir"]["medium"] == "Memory")
                for m in container["volumeMounts"])

        def host_paths(container: dict[str, Any]) -> list[tuple[str, str]]:
            # node path -> mount path, ":ro" for a readOnly mount (read-only in the container)
            return [(volumes[m["name"]]["hostPath"]["path"],
                     m["mountPath"] + (":ro" if m.get("readOnly") else ""))
                    for m in container["volumeMounts"] if "hostPath" in volumes[m["name"]]]

        self.host_paths = host_paths(self.container)
        self.init_host_paths = [host_paths(c) for c in self.init_containers]
        self.pod_failure_policy = job.get("podFailurePolicy")
        self.failure_policy = jobset["spec"].get("failurePolicy") or {}
        self.max_restarts = self.failure_policy.get("maxRestarts", 0)
        self.grace_s = float(self.pod_spec["terminationGracePeriodSeconds"])
        self.name = jobset["metadata"]["name"]
        self.namespace = jobset["metadata"].get("namespace", "default")
        self.slices = self.rjob["replicas"]
        self.nodes = job["parallelism"]
        self.status = JobSetStatus()
        # the object's UID, as the API server assigns it: a replaced JobSet's pods are new
        # pods on the same nodes, labelled with the new UID
        self.uid = str(uuid.uuid4())
        self.state = "Pending"  # Running | Failed | Completed
        self.pods: list[Pod] = []  # the current attempt's
        self.attempts: list[list[Pod]] = []
        self.history: list[str] = []  # one line per controller action, for a failing test

    @property
    def restarts(self) -> int:
        return self.status.restarts

    @property
    def reason(self) -> str:
        return self.status.failed_reason or ""

    @classmethod
    def for_stack(cls, stack: Stack, image: Image, root: Path) -> EmulatedJobSet:
        """The JobSet and boot files `pulumi up` applies for this GKE stack, one CPU device per
        TPU chip of a node."""
        from infra.gke import manifest as gke_manifest
        from infra.gke.topology import gke_slice

        spec_sha256 = gke_manifest.launch_spec_sha256(stack.spec_text())
        # a pod's JAX devices: its node's chips, two a chip on TPU7x
        topo = stack.cfg.topology
        return cls(gke_manifest.jobset(stack.cfg, spec_sha256), gke_manifest.boot_files(), stack,
                   image, root, devices_per_pod=topo.devices // gke_slice(topo).nodes)

    def node_dir(self, slice_index: int, index: int) -> Path:
        """Node J-P's own disk (this machine's directory): what outlives the pods on it."""
        return self.root / "nodes" / f"{slice_index}-{index}"

    def pod_name(self, slice_index: int, index: int) -> str:
        return f"{self.name}-{self.rjob['name']}-{slice_index}-{index}"

    def dns_name(self, slice_index: int, index: int) -> str:
        return f"{self.pod_name(slice_index, index)}.{self.name}"  # the headless service's

    def start(self) -> None:
        """Create every pod of every Job (slice)."""
        # every start's pods are new containers (a restart's, or a resumption's after Kueue
        # suspended the JobSet, which counts no restart)
        attempt = self.root / f"{self.name}-{self.uid[:8]}" / f"attempt-{len(self.attempts)}"
        dns = [self.dns_name(j, p) for j in range(self.slices) for p in range(self.nodes)]
        self.pods = []
        self.attempts.append(self.pods)
        created: list[tuple[Pod, dict[str, str]]] = []
        for j in range(self.slices):
            hostnames = ",".join(self.dns_name(j, p) for p in range(self.nodes))
            for p in range(self.nodes):
                pod = Pod(self.image, attempt, self.pod_name(j, p), slice_index=j, worker=p)
                pod.labels = {
                    "jobset.sigs.k8s.io/jobset-name": self.name,
                    "jobset.sigs.k8s.io/jobset-uid": self.uid,
                    "jobset.sigs.k8s.io/replicatedjob-name": self.rjob["name"],
                    "jobset.sigs.k8s.io/replicatedjob-replicas": str(self.slices),
                    "jobset.sigs.k8s.io/job-index": str(j),
                    "jobset.sigs.k8s.io/restart-attempt": str(self.restarts),
                    "batch.kubernetes.io/job-completion-index": str(p),
                }
                created.append((pod, {"TPU_WORKER_ID": str(p), "TPU_WORKER_HOSTNAMES": hostnames}))
        self._dns = dns
        for pod, gke_env in created:
            pod.gke_env, pod.attempt_dir, pod.init_logs = gke_env, attempt, []
            self.pods.append(pod)
            self.advance(pod)
        self.state = "Running"
        self.history.append(f"{time.strftime('%X')} created {len(self.pods)} pods "
                            f"(restarts {self.restarts})")

    def node_binds(self, pod: Pod, paths: list[tuple[str, str]]) -> list[tuple[Path, str]]:
        return [(self.node_dir(pod.slice_index, pod.worker) / node_path.lstrip("/"), mount)
                for node_path, mount in paths]

    def advance(self, pod: Pod) -> None:
        """The kubelet's order for one pod: its init containers one after another, each to its
        end (an init container has a filesystem of its own and shares the pod's volumes), then
        the pod's container; an init container that fails fails the pod (restartPolicy
        Never), with its status."""
        if pod.proc is not None:
            return
        if pod.init is not None:
            assert pod.init.proc is not None
            code = pod.init.proc.poll()
            if code is None:
                return
            pod.init.stop()
            pod.init_logs.append(pod.init.logs)
            if code != 0:
                pod.proc = pod.init.proc
                self.history.append(f"{time.strftime('%X')} init container "
                                    f"{self.init_containers[pod.init_next - 1]['name']} of "
                                    f"{pod.name} failed ({code})")
                return
            pod.init = None
        if pod.init_next < len(self.init_containers):
            index = pod.init_next
            pod.init_next += 1
            init = Pod(self.image, pod.attempt_dir / f"init-{index}", pod.name,
                       slice_index=pod.slice_index, worker=pod.worker)
            init.labels = pod.labels
            init.start_pod(self.stack, self.init_containers[index], pod.gke_env,
                           self.boot_files, self.mount_path, self._dns, self.devices_per_pod,
                           self.node_binds(pod, self.init_host_paths[index]))
            pod.init = init
            return
        pod.start_pod(self.stack, self.container, pod.gke_env, self.boot_files,
                      self.mount_path, self._dns, self.devices_per_pod,
                      self.node_binds(pod, self.host_paths))

    def delete_pods(self) -> None:
        started = time.monotonic()
        # SIGTERM to all first (a real deletion reaches them together): to what runs in each
        # pod, its container or the init container before it
        for pod in self.pods:
            (pod.init or pod).send_term()
        exits = [f"{pod.name} {pod.terminate(self.grace_s)}" for pod in self.pods]
        self.history.append(f"{time.strftime('%X')} deleted {len(self.pods)} pods in "
                            f"{time.monotonic() - started:.0f}s ({', '.join(exits)})")

    def suspend(self) -> None:
        """Kueue evicted the JobSet's Workload and set spec.suspend: JobSet suspends its Jobs,
        whose pods are deleted (SIGTERM, SIGKILL after the grace); no pod failed, so no restart
        is counted and no failure rule applies. Admitted again, `start` creates the pods anew."""
        if self.state != "Running":
            return
        self.delete_pods()
        self.state = "Suspended"
        self.history.append(f"{time.strftime('%X')} suspended by Kueue: every pod deleted, "
                            f"no restart counted (restarts {self.restarts})")

    def reconcile(self) -> None:
        """One pass of the controller: act on the first failed pod, as JobSet does on a failed
        Job (backoffLimit 0: one failed pod fails its Job)."""
        if self.state != "Running":
            return
        for pod in self.pods:
            self.advance(pod)
        failed = [(pod, pod.proc.returncode) for pod in self.pods
                  if pod.proc is not None and pod.proc.poll() is not None
                  and pod.proc.returncode != 0]
        if not failed:
            if all(pod.proc is not None and pod.proc.poll() == 0 for pod in self.pods):
                self.state = "Completed"
                self.history.append(f"{time.strftime('%X')} every pod succeeded: JobSet "
                                    "Completed")
            return
        pod, code = failed[0]
        failure = job_failure(self.pod_failure_policy, PodFailure(
            self.namespace, pod.name, self.container["name"],
            None if pod.disrupted else (128 - code if code < 0 else code),
            (DISRUPTION_TARGET,) if pod.disrupted else ()))
        action = jobset_action(self.failure_policy, failure)
        self.history.append(f"{time.strftime('%X')} pod {pod.name} failed with exit {code}"
                            f"{pod.last_words(code)}: Job {failure.reason} ({failure.message}) "
                            f"-> {action}")
        self.status = apply_action(self.status, action, self.max_restarts)
        self.delete_pods()
        if self.status.failed:
            self.state = "Failed"
            return
        self.start()

    def run_until(self, what: str, predicate: Any, timeout: float) -> None:
        """Reconcile every half second until `predicate()` holds."""
        deadline = time.monotonic() + timeout
        while not predicate():
            self.reconcile()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout}s; JobSet {self.state} "
                                   f"{self.reason}: " + self.report())
            time.sleep(0.5)

    def kill_pod(self, slice_index: int, index: int, *, node_died: bool = True) -> Pod:
        """Every process of the pod is killed at once: its node died or was preempted (the pod
        gets DisruptionTarget and no exit code), or with `node_died=False` the container was
        killed on a live node (the OOM killer: exit 137, no condition)."""
        pod = self.pods[slice_index * self.nodes + index]
        assert pod.proc is not None
        pod.disrupted = node_died
        os.killpg(pod.proc.pid, signal.SIGKILL)
        pod.proc.wait()
        self.history.append(f"{time.strftime('%X')} killed pod {pod.name}"
                            f"{' (node died)' if node_died else ''}")
        return pod

    def running_pods(self) -> list[Pod]:
        return [pod for pod in self.pods if pod.proc is not None and pod.proc.poll() is None]

    def report(self) -> str:
        """For a failing test: the controller's history on one line (the line CI's log tail
        shows), then every attempt's logs."""
        return " | ".join(self.history) + "\n" + self.explain()

    def explain(self) -> str:
        """Every attempt's pods' consoles and train logs (a deleted pod keeps its logs)."""
        return "\n".join(
            f"--- {pod.name} (attempt {attempt}) console ---\n"
            f"{log_tail(pod.console.read_text(), 2000)}\n--- train.log ---\n"
            f"{log_tail(pod.train_log(), 3000)}"
            for attempt, pods in enumerate(self.attempts) for pod in pods)

    def stop(self) -> None:
        for pod in self.pods:
            if pod.init is not None:
                pod.init.stop()
            pod.stop()
