"""Everything derived from a validated StackConfig: the launch spec (an object in the bucket),
the queued-resource spec (with the VMs' fixed metadata), and the ready-to-paste commands. Pure (no
pulumi import), so the Pulumi program and the CLI's offline render produce the same values.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infra.packaging.lock import LOCK_FILE

if TYPE_CHECKING:  # annotations only: the schema's validation reaches this module lazily
    from infra.stack_config.schema import StackConfig

# What every TPU VM and GKE pod boots: in the VMs' metadata, in the pods' boot ConfigMap
BOOT_FILES_DIR = Path(__file__).resolve().parents[1] / "boot"
STARTUP_SCRIPT_PATH = BOOT_FILES_DIR / "startup.sh"
LAUNCH_PY_PATH = BOOT_FILES_DIR / "launch.py"
LAUNCH_SPEC_VERSION = 3
NETWORK_MTU = 8896
IAP_SOURCE_RANGE = "35.235.240.0/20"
LOGGING_ROLES = ("roles/logging.logWriter", "roles/monitoring.metricWriter")
# The hosts read the whole bucket (objectViewer: get and list) and write only under the prefixes
# of host_write_prefixes, through an IAM Condition on the object's name: objectUser there (create,
# overwrite and delete: checkpoint rotation deletes old steps), never on the launch spec, code/
# or envs/, which are the deployer's. Neither role touches bucket IAM or settings.
BUCKET_READ_ROLE = "roles/storage.objectViewer"
BUCKET_WRITE_ROLE = "roles/storage.objectUser"
# On each of a stack's data_buckets: read and list objects, nothing else.
DATA_BUCKET_ROLE = "roles/storage.objectViewer"


def startup_script() -> str:
    return STARTUP_SCRIPT_PATH.read_text()


def launch_spec(cfg: StackConfig, archive_sha256: str,
                env_sha256: str | None = None) -> dict[str, Any]:
    """What every VM reads from the stack's launch spec object (see infra/boot/launch.py): the code,
    the trainer and the run. Changing it keeps the queued resource: running hosts notice the new
    object generation and restart their trainers on it. Provider-only settings (waiting for
    ACTIVE, polling, delete timeouts) are not in it, so they never restart a trainer.
    `env_sha256`: the digest of the deployer's environment archive (infra/preview/env_check.py), the
    only environment the hosts install that they did not build."""
    topo = cfg.topology
    return {
        "version": LAUNCH_SPEC_VERSION,
        "stack": cfg.stack,
        "trainer": cfg.trainer.model_dump(mode="json"),
        "archive_uri": f"gs://{cfg.names.bucket}/code/{archive_sha256}.tar.gz",
        "archive_sha256": archive_sha256,
        "run_dir": cfg.names.run_dir,
        "logs_uri": f"{cfg.names.run_dir}/logs",
        "python_version": cfg.python_version,
        "mesh": cfg.resolved_mesh(),
        "expect_slices": cfg.slices,
        "expect_devices_per_slice": topo.devices,
        "envs_uri": f"gs://{cfg.names.bucket}/envs",
        "lock_file": LOCK_FILE,
        "init_timeout_s": cfg.trainer.init_timeout_s,
        "max_restarts": cfg.trainer.max_restarts,
        "run_as": cfg.trainer.run_as,
        "storage_retry_s": cfg.storage_retry_s,
        "spec_poll_s": cfg.spec_poll_s,
        # only when set: a spec of the default stays byte for byte what it was (no restart)
        **({"egress": cfg.egress} if cfg.egress != "nat" else {}),
        **({"package_index": cfg.package_index.url} if cfg.package_index else {}),
        **({"python_mirror": cfg.package_index.python_mirror}
           if cfg.package_index and cfg.package_index.python_mirror else {}),
        **({"env_sha256": env_sha256} if env_sha256 else {}),
    }


def host_write_prefixes(cfg: StackConfig) -> list[str]:
    """The object-name prefixes of the stack's bucket the hosts write (each ends in "/"): the
    run directory (checkpoints, metrics, logs, the compile cache), the boot logs beside the spec
    (written before a spec names the run), and a data set the hosts prepare in the bucket."""
    n = cfg.names
    own = f"gs://{n.bucket}/"
    prefixes = [n.run_dir.removeprefix(own) + "/", n.launch_spec_object.removesuffix(".json")
                + ".boot/"]
    data_path = str((cfg.trainer.overrides or {}).get("data.path", ""))
    if data_path.startswith(own) and not any(data_path.removeprefix(own).startswith(p)
                                             for p in prefixes):
        prefixes.append(data_path.removeprefix(own).rstrip("/") + "/")
    return prefixes


def host_write_condition(bucket: str, prefixes: list[str]) -> str:
    """The CEL expression of the hosts' conditioned write grant (Cloud Storage's resource names:
    projects/_/buckets/BUCKET/objects/NAME)."""
    return " || ".join(
        f'resource.name.startsWith("projects/_/buckets/{bucket}/objects/{prefix}")'
        for prefix in prefixes)


def launch_spec_text(cfg: StackConfig, archive_sha256: str,
                     env_sha256: str | None = None) -> str:
    """The launch spec object's bytes: sorted and indented, so a PR diff reads field by field."""
    return json.dumps(launch_spec(cfg, archive_sha256, env_sha256),
                      sort_keys=True, indent=1) + "\n"


def vm_metadata(cfg: StackConfig) -> dict[str, str]:
    """The TPU VMs' metadata: fixed for a stack (the script, its helper, where the spec is), so
    a change of code or trainer settings never touches the queued resource."""
    return {
        "startup-script": startup_script(),
        "multislice-launch-py": LAUNCH_PY_PATH.read_text(),
        "launch-spec-uri": cfg.names.launch_spec_uri,
        # SSH through OS Login (IAM: roles/compute.osLogin, osAdminLogin for sudo), never keys
        # in metadata that anyone who can set metadata adds
        "enable-oslogin": "TRUE",
    }


def network_path(cfg: StackConfig) -> str:
    """The slices' VPC: the stack's own, or the shared one it names (multislice:network)."""
    shared = cfg.network
    if shared is None:
        return cfg.names.network_path(cfg.project)
    return cfg.names.network_path(shared.project or cfg.project, shared.name)


def subnet_path(cfg: StackConfig) -> str:
    shared = cfg.network
    if shared is None:
        return cfg.names.subnet_path(cfg.project, cfg.region)
    return cfg.names.subnet_path(shared.project or cfg.project, cfg.region, shared.subnet)


def queued_resource_spec(cfg: StackConfig) -> dict[str, Any]:
    """The dynamic provider's inputs (flat), from which infra.tpu_vm.request builds the API call."""
    n = cfg.names
    tags = [n.slice_tag, *[t for t in cfg.tags if t != n.slice_tag]]
    return {
        "project": cfg.project,
        "zone": cfg.zone,
        "queued_resource_id": n.queued_resource_id,
        "accelerator_type": cfg.topology.accelerator_type,
        "runtime_version": cfg.effective_runtime_version,
        "slices": cfg.slices,
        "node_prefix": n.node_prefix,
        "network": network_path(cfg),
        "subnetwork": subnet_path(cfg),
        "enable_external_ips": cfg.external_ips,
        "secure_boot": cfg.secure_boot,
        "tags": tags,
        "labels": cfg.all_labels(),
        "service_account_email": n.service_account_email,
        "metadata": vm_metadata(cfg),
        "capacity": cfg.capacity,
        "reservation_name": cfg.reservation_name,
        "valid_until": cfg.valid_until,
        "valid_after": cfg.valid_after,
        "wait_for_active_s": cfg.wait_for_active_s,
    }


def commands(cfg: StackConfig) -> dict[str, Any]:
    """Ready-to-paste commands for the stack outputs."""
    n = cfg.names
    logs = f"{n.run_dir}/logs"
    first_node = n.node_ids[0]
    ssh = (
        f"gcloud compute tpus tpu-vm ssh {first_node} --project={cfg.project} "
        f"--zone={cfg.zone} --worker=0"
    )
    out: dict[str, Any] = {
        "logs_list_command": f"gcloud storage ls {logs}/",
        "logs_tail_command": f"gcloud storage cat '{logs}/*.log' | tail -n 100",
        "metrics_command": f"gcloud storage cat {n.run_dir}/metrics.jsonl | tail -n 5",
        "status_command": (
            f"gcloud compute tpus queued-resources describe {n.queued_resource_id} "
            f"--project={cfg.project} --zone={cfg.zone}"
        ),
    }
    if cfg.ssh_from_iap:
        out["ssh_command"] = f"{ssh} --tunnel-through-iap"
    elif cfg.external_ips:
        out["ssh_command"] = ssh
    else:
        out["ssh_command"] = (
            "SSH is off (no external IPs, ssh_from_iap: false); set multislice:ssh_from_iap: true"
        )
    return out
