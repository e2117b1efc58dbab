"""Every name derived from a stack: GCP resource names, Pulumi logical names, paths, node ids.

One function, so a re-run finds the same resources and the render output reads like the console:
each Pulumi resource's logical name is its GCP name (the VPC is ``ms-STACK-net`` in both). Names
never contain a timestamp: a resumed run must find its own bucket and run directory.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StackNames:
    prefix: str  # ms-STACK: every resource of the stack starts with it
    slice_tag: str  # network tag of every TPU VM (the firewall's source and target)
    network: str
    subnet: str
    firewall_internal: str
    firewall_iap_ssh: str
    router: str
    nat: str
    service_account_id: str
    service_account_email: str
    bucket: str
    run_dir: str  # gs://BUCKET/runs/STACK, or runs/STACK-RUN_NAME
    launch_spec_object: str  # launch/STACK.json: what every VM of the stack reads at boot
    queued_resource_id: str
    node_prefix: str
    node_ids: tuple[str, ...]  # the API's node ids, in slice order
    # orchestration gke (infra/gke/resources.py): one node pool per slice, in slice order; the workload
    gke_cluster: str  # the cluster a stack creates (create_cluster: true)
    gke_cpu_pool: str  # that cluster's small CPU pool for the controllers
    node_pools: tuple[str, ...]
    jobset: str  # the JobSet, and the default namespace of it and its service account
    k8s_service_account: str
    gke_node_account_id: str  # the GKE nodes' own service account (not the trainer's)
    gke_node_account_email: str
    boot_config_map: str  # the boot files (infra/boot/) every pod mounts

    @property
    def launch_spec_uri(self) -> str:
        return f"gs://{self.bucket}/{self.launch_spec_object}"

    def network_path(self, project: str, name: str | None = None) -> str:
        return f"projects/{project}/global/networks/{name or self.network}"

    def subnet_path(self, project: str, region: str, name: str | None = None) -> str:
        return f"projects/{project}/regions/{region}/subnetworks/{name or self.subnet}"


def node_ids(prefix: str, count: int) -> list[str]:
    """The node ids the API gives one node spec, in slice order: a single node is ``prefix`` (its
    ``node_id``); ``count`` > 1 nodes (``multislice_params``) are ``prefix-0`` .. ``prefix-N-1``."""
    if count == 1:
        return [prefix]
    return [f"{prefix}-{i}" for i in range(count)]


def stack_names(stack: str, project: str, slices: int, bucket_name: str | None = None,
                run_name: str | None = None) -> StackNames:
    prefix = f"ms-{stack}"
    account = f"{prefix}-tpu"  # <= 30 characters: why stack names are at most 20
    bucket = bucket_name or f"{project}-{prefix}"
    return StackNames(
        prefix=prefix,
        slice_tag=f"{prefix}-slice",
        network=f"{prefix}-net",
        subnet=f"{prefix}-subnet",
        firewall_internal=f"{prefix}-allow-internal",
        firewall_iap_ssh=f"{prefix}-allow-iap-ssh",
        router=f"{prefix}-router",
        nat=f"{prefix}-nat",
        service_account_id=account,
        service_account_email=f"{account}@{project}.iam.gserviceaccount.com",
        bucket=bucket,
        run_dir=f"gs://{bucket}/runs/{stack}" + (f"-{run_name}" if run_name else ""),
        launch_spec_object=f"launch/{stack}.json",
        queued_resource_id=f"{prefix}-qr",
        node_prefix=prefix,
        node_ids=tuple(node_ids(prefix, slices)),
        gke_cluster=f"{prefix}-gke",
        gke_cpu_pool=f"{prefix}-cpu",
        node_pools=tuple(f"{prefix}-s{i}" for i in range(slices)),
        jobset=prefix,
        k8s_service_account=f"{prefix}-trainer",
        gke_node_account_id=f"{prefix}-node",
        gke_node_account_email=f"{prefix}-node@{project}.iam.gserviceaccount.com",
        boot_config_map=f"{prefix}-boot",
    )
