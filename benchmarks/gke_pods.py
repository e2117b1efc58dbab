"""Start and recovery of the same job as GKE pods of a JobSet vs as TPU VMs, on the emulated image.

    .venv/bin/python benchmarks/gke_pods.py [--repeats 2] [--steps 6]      (as root: mounts)

Both jobs are 2 slices of 2 hosts with 4 chips each (8 CPU devices a slice, one trainer process
a host), the template's `tiny` config, a checkpoint every 2 steps, on fake-gcs-server, starting
from an environment a first boot published (as every boot after a stack's first does):

- pods: the JobSet infra/gke/manifest.py renders for 2 x v5litepod-8 (GKE: two 4-chip nodes a
  slice), its boot ConfigMap and command, on scripts/emulators/jobset_emulator.py (GKE's pod
  environment, cluster DNS, the Workload Identity metadata server, JobSet's failure policy);
- VMs: 2 x v4-16 (two 4-chip hosts a slice) on scripts/emulators/boot_harness.py hosts with the
  TPU metadata.

Measured per job: from start to the first `step` row in the run's metrics.jsonl, and, once step 3
is written, from a failure to the first step after it. The failure is what each orchestration
recovers from by itself: a pod killed (its node died) makes JobSet delete and recreate every pod
(the pods still running are ended by their start-up script once no step finishes within 4 step
times of the SIGTERM; each new pod's init container finds the environment and the byte-compiled
code it installed on the node and checks the environment's marker; the trainer's container
links the environment read-only, copies the code and checks its digest, beside the compile
cache the node kept); a trainer killed on a VM is restarted by that VM's startup script (5 s backoff) while the
other hosts' trainers fail on the lost peer and restart.
Each attempt's time to its first step is also split into phases (scripts/report/phases.py:
boot, environment, imports, distributed start-up, restore, compile, first step, other) from the
trainer's own rows, for the first attempt and for the one after the failure. Repeats alternate
the two jobs; medians; the ratios are pods over VMs. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.emulators.boot_harness import Host, Stack, boot_experiment  # noqa: E402
from scripts.emulators.gcs_emulator import GcsEmulator  # noqa: E402
from scripts.emulators.jobset_emulator import EmulatedJobSet  # noqa: E402
from scripts.emulators.tpu_image import build_image  # noqa: E402
from scripts.report.goodput import split_attempts  # noqa: E402
from scripts.report.phases import PHASES, startup_phases  # noqa: E402

IMAGE = "us-docker.pkg.dev/p/r/boot:1@sha256:" + "a" * 64


def steps(stack: Stack) -> list[dict]:
    try:
        return [e for e in stack.events() if e["event"] == "step"]
    except Exception:  # no metrics.jsonl yet
        return []


def wait(what: str, predicate, timeout: float, tick=None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if tick is not None:
            tick()
        if time.monotonic() > deadline:
            raise SystemExit(f"{what}: not within {timeout}s")
        time.sleep(0.5)


def first_step_after(stack: Stack, since: float) -> float:
    return next(e["time"] for e in steps(stack) if e["time"] > since) - since


def measured(stack: Stack, started: float, killed: float) -> dict:
    """The two times, and the phases of the first attempt and of the first one after the kill."""
    attempts = split_attempts(stack.events())
    after = [a for a in attempts if a and a[0]["time"] > killed]
    first, restart = startup_phases(attempts[0]), startup_phases(after[0]) if after else None
    return {"start_to_first_step_s": first_step_after(stack, started),
            "failure_to_first_step_s": first_step_after(stack, killed),
            "first_phases": first.seconds if first else {},
            "restart_phases": restart.seconds if restart else {}}


def phase_line(phases: dict[str, float]) -> str:
    return ", ".join(f"{k} {phases.get(k, 0.0):.1f}" for k in PHASES)


def run_pods(gcs: GcsEmulator, experiment: Path, image, root: Path, name: str,
             envs_from: Stack, n_steps: int) -> dict[str, float]:
    raw = {"project": "my-proj", "region": "us-central2", "zone": "us-central2-b",
           "accelerator_type": "v5litepod-8", "slices": 2, "experiment_dir": str(experiment),
           "orchestration": "gke",
           "gke": {"cluster": "projects/my-proj/locations/us-central2/clusters/c",
                   "image": IMAGE},
           "trainer": {"config": "tiny", "steps": n_steps, "seed": 0, "init_timeout_s": 120,
                       "overrides": {"checkpoint.save_interval_steps": 2}}}
    stack = Stack(gcs, experiment, name, raw=raw, envs_from=envs_from)
    jobset = EmulatedJobSet.for_stack(stack, image, root)
    started = time.time()
    jobset.start()
    try:
        jobset.run_until("step 3", lambda: len(steps(stack)) >= 3, 900)
        killed = time.time()
        jobset.kill_pod(1, 1)
        jobset.run_until("a step after the restart",
                         lambda: any(e["time"] > killed for e in steps(stack)), 900)
        row = measured(stack, started, killed)
        row["controller"] = " | ".join(jobset.history)
        return row
    finally:
        jobset.stop()


def run_vms(gcs: GcsEmulator, experiment: Path, image, root: Path, name: str,
            envs_from: Stack, n_steps: int) -> dict[str, float]:
    stack = Stack(gcs, experiment, name, slices=2, accelerator_type="v4-16", steps=n_steps,
                  init_timeout_s=120, overrides={"checkpoint.save_interval_steps": 2},
                  envs_from=envs_from)
    hosts = [Host(image, root, f"{name}-s{s}-w{w}", slice_index=s, worker=w)
             for s in range(2) for w in range(2)]
    started = time.time()
    for host in hosts:
        host.start(stack)
    try:
        wait("step 3", lambda: len(steps(stack)) >= 3, 900)
        killed = time.time()
        trainer = subprocess.run(["pgrep", "-f", "-s", str(hosts[3].proc.pid), "trainer.main"],
                                 capture_output=True, text=True).stdout.split()
        for pid in trainer:
            os.kill(int(pid), signal.SIGKILL)
        wait("a step after the restart", lambda: any(e["time"] > killed for e in steps(stack)),
             900)
        return measured(stack, started, killed)
    finally:
        for host in hosts:
            host.stop()
        Host.stop_all()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args(argv)
    rows: dict[str, list[dict[str, float]]] = {"pods": [], "vms": []}
    with tempfile.TemporaryDirectory() as tmp, GcsEmulator() as gcs:
        experiment = boot_experiment(Path(tmp) / "exp")
        image = build_image(Path(tmp) / "image")
        first = Stack(gcs, experiment, "first", steps=1)
        first_host = Host(image, Path(tmp) / "first", "first-w-0")
        result = first_host.boot(first)
        if result.returncode != 0:
            raise SystemExit(result.stderr[-3000:])
        # as `pulumi up` (or `multislice env-publish`) publishes it: every later stack's spec
        # pins it, and no host or pod builds
        [env] = first_host.envs()
        first.publish_env(env)
        for repeat in range(args.repeats):
            order = ("pods", "vms") if repeat % 2 == 0 else ("vms", "pods")
            for kind in order:
                run = run_pods if kind == "pods" else run_vms
                row = run(gcs, experiment, image, Path(tmp) / f"{kind}{repeat}",
                          f"{kind}{repeat}", first, args.steps)
                rows[kind].append(row)
                print(f"repeat {repeat} {kind:4s}: start -> first step "
                      f"{row['start_to_first_step_s']:.1f} s, failure -> first step after "
                      f"{row['failure_to_first_step_s']:.1f} s; restarted attempt: "
                      f"{phase_line(row['restart_phases'])}", flush=True)
                if "controller" in row:
                    print(f"  JobSet controller: {row.pop('controller')}", flush=True)
    times = ("start_to_first_step_s", "failure_to_first_step_s")
    medians = {kind: {k: statistics.median(r[k] for r in rs) for k in times}
               for kind, rs in rows.items()}
    phases = {kind: {which: {p: statistics.median(r[which].get(p, 0.0) for r in rs)
                             for p in PHASES}
                     for which in ("first_phases", "restart_phases")}
              for kind, rs in rows.items()}
    ratios = {k: medians["pods"][k] / medians["vms"][k] for k in medians["pods"]}
    print(f"median start -> first step: pods {medians['pods']['start_to_first_step_s']:.1f} s, "
          f"VMs {medians['vms']['start_to_first_step_s']:.1f} s (pods/VMs "
          f"{ratios['start_to_first_step_s']:.2f}); failure -> first step after: pods "
          f"{medians['pods']['failure_to_first_step_s']:.1f} s, VMs "
          f"{medians['vms']['failure_to_first_step_s']:.1f} s (pods/VMs "
          f"{ratios['failure_to_first_step_s']:.2f})")
    for kind in rows:
        print(f"median phases of the restarted attempt, {kind}: "
              f"{phase_line(phases[kind]['restart_phases'])}")
    print(json.dumps({"repeats": args.repeats, "median": medians, "pods_over_vms": ratios,
                      "phases": phases}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
