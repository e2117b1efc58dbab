"""A differential oracle for the GKE workload: xpk, the tool GKE's docs point TPU teams to,
renders the same job with `xpk workload create --dry-run` (offline), and the fields that decide
where and how the pods run must agree with the JobSet infra/gke/manifest.py renders. Every field
that differs on purpose is listed in INTENDED with the reason.

Dev-only (`pytest --oracle tests/infra/test_gke_xpk_oracle.py`): xpk pins versions this
toolkit's venv does not have, so it is installed from PyPI into a venv of its own."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.gke import manifest as gke_manifest
from infra.stack_config.schema import StackConfig

pytestmark = [pytest.mark.oracle, pytest.mark.slow]
XPK_VERSION = "1.16.0"
SPEC_SHA256 = gke_manifest.launch_spec_sha256("{}")
UV = Path(sys.executable).with_name("uv")

# Field (as compared below) -> why ours differs from xpk's on purpose.
INTENDED = {
    "hostNetwork": "Workload Identity gives the pods the stack's service account; its metadata "
                   "server tells pods apart by IP, which host-network pods share with the node",
    "privileged": "not needed for TPU access on GKE 1.28 and later; least privilege",
    "replicated_job_name": "'slice': the pods' host names say which slice they are on",
    "max_restarts": "the stack's trainer.max_restarts (xpk: its --max-restarts, default 0)",
    "fail_on_exit": "the trainer's exit contract (docs/CONTRACTS.md): 2 and 3 are deterministic; "
                    "xpk fails on every status below 128 but 42",
    "termination_grace_s": "the trainer saves at its next step boundary on SIGTERM: 900 s, as a "
                           "TPU VM's startup script allows",
    "queue_label": "Kueue only with gke.queueing",
}


@pytest.fixture(scope="module")
def xpk(tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("xpk-venv")
    subprocess.run([str(UV), "venv", "-q", "-p", sys.executable, str(venv)], check=True)
    subprocess.run([str(UV), "pip", "install", "-q", "--python", str(venv / "bin" / "python"),
                    f"xpk=={XPK_VERSION}"], check=True, timeout=600)
    return venv / "bin" / "xpk"


def xpk_jobset(xpk: Path, tmp_path: Path, accelerator_type: str, slices: int) -> dict[str, Any]:
    out = subprocess.run(
        [str(xpk), "workload", "create", "--dry-run", "--cluster", "train", "--project",
         "my-proj", "--zone", "us-central1-a", "--tpu-type", accelerator_type, "--num-slices",
         str(slices), "--workload", "ms-gke", "--docker-image", "r/boot:1", "--command",
         "bash /etc/multislice/boot/startup.sh"],
        cwd=tmp_path, env={**os.environ, "HOME": str(tmp_path)}, capture_output=True,
        text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout + out.stderr
    block = re.search(r"Temp file \(\w+\) content: \n(apiVersion: jobset.*?)\n\[XPK\]", text,
                      re.S)
    assert block, text[-3000:]
    return yaml.safe_load(block[1])


def fields(jobset: dict[str, Any]) -> dict[str, Any]:
    """What decides placement, resources, replicas, parallelism and restarts."""
    (rjob,) = jobset["spec"]["replicatedJobs"]
    job = rjob["template"]["spec"]
    pod = job["template"]["spec"]
    (container,) = pod["containers"]
    fail_rules = [r for r in job.get("podFailurePolicy", {}).get("rules", [])
                  if r["action"] == "FailJob"]
    return {
        "exclusive_topology": jobset["metadata"]["annotations"].get(
            "alpha.jobset.sigs.k8s.io/exclusive-topology"),
        "replicas": rjob["replicas"],
        "replicated_job_name": rjob["name"],
        "parallelism": job["parallelism"],
        "completions": job["completions"],
        "backoff_limit": job["backoffLimit"],
        "restart_policy": pod["restartPolicy"],
        "node_selector": {k: v for k, v in pod["nodeSelector"].items() if v},
        "tpu_limit": container["resources"]["limits"]["google.com/tpu"],
        "hostNetwork": bool(pod.get("hostNetwork")),
        "privileged": bool((container.get("securityContext") or {}).get("privileged")),
        "tolerations": pod.get("tolerations") or [],
        "shm_in_memory": any(v.get("emptyDir", {}).get("medium") == "Memory"
                             for v in pod.get("volumes") or []),
        "fail_jobset_on_pod_failure_policy": any(
            r["action"] == "FailJobSet" and "PodFailurePolicy" in r["onJobFailureReasons"]
            for r in jobset["spec"]["failurePolicy"].get("rules", [])),
        "max_restarts": jobset["spec"]["failurePolicy"]["maxRestarts"],
        "fail_on_exit": [(r["onExitCodes"]["operator"], sorted(r["onExitCodes"]["values"]))
                         for r in fail_rules],
        "termination_grace_s": pod.get("terminationGracePeriodSeconds"),
        "queue_label": "kueue.x-k8s.io/queue-name" in jobset["metadata"].get("labels", {}),
    }


@pytest.mark.parametrize(("accelerator_type", "slices"), [
    ("v5litepod-16", 2), ("v5litepod-8", 3), ("v6e-32", 2), ("v5p-16", 2), ("v4-16", 4),
])
def test_the_jobset_agrees_with_xpks_for_the_same_job_except_where_listed(
        xpk, tmp_path, accelerator_type, slices):
    theirs = fields(xpk_jobset(xpk, tmp_path, accelerator_type, slices))
    cfg = StackConfig.model_validate({
        "stack": "gke", "project": "my-proj", "region": "us-central1", "zone": "us-central1-a",
        "accelerator_type": accelerator_type, "slices": slices, "experiment_dir": "exp",
        "orchestration": "gke", "gke": {"cluster": "projects/my-proj/locations/us-central1/"
                                        "clusters/train", "image": "r/i@sha256:" + "a" * 64}})
    ours = fields(gke_manifest.jobset(cfg, SPEC_SHA256))
    differ = {k for k in ours if ours[k] != theirs[k]}
    assert differ - set(INTENDED) == set(), {k: (ours[k], theirs[k]) for k in differ}
    assert ours["replicas"] == slices and ours["parallelism"] == ours["completions"]
