"""Wire the components for one validated StackConfig; returns the stack outputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pulumi

from infra.cloud.identity import IdentityArgs, TrainerIdentity
from infra.cloud.network import NetworkArgs, SliceNetwork
from infra.cloud.services import (
    COMPUTE_API,
    GKE_API,
    REQUIRED_APIS,
    TPU_API,
    ProjectServices,
    ServicesArgs,
)
from infra.cloud.storage import ExperimentStorage, StorageArgs
from infra.packaging.archive import build_archive, write_archive
from infra.preview.run_check import RunCheck, model_shape
from infra.stack_config import manifest
from infra.stack_config.schema import StackConfig
from infra.tpu_vm.queued_resource import MultisliceQueuedResource, MultisliceQueuedResourceArgs

ARCHIVE_CACHE = ".multislice/archives"


def _model_shape(cfg: StackConfig, experiment: Path) -> dict[str, Any] | None:
    """The parameter-shaping keys of the model the spec trains, by the experiment's own code;
    None when it cannot say (its trainer settings were checked already)."""
    from infra.packaging.experiment import ExperimentError, model_summary, trainer_overrides

    try:
        return model_shape(model_summary(experiment, *trainer_overrides(cfg))["model"])
    except ExperimentError:
        return None


def create_stack(cfg: StackConfig, base_dir: Path) -> dict[str, Any]:
    if cfg.gke is not None and cfg.gke.kind == "capacity":
        return _create_capacity(cfg)
    n = cfg.names
    prefix = n.prefix
    exp_dir = Path(cfg.experiment_dir)
    if not exp_dir.is_absolute():
        exp_dir = base_dir / exp_dir
    archive = build_archive(exp_dir)
    archive_path = write_archive(archive, base_dir / ARCHIVE_CACHE)

    gke = cfg.orchestration == "gke"
    workload_only = gke and cfg.gke is not None and cfg.gke.kind == "workload"
    # First, before anything is created: an existing cluster that cannot run the stack is one
    # line at preview (infra/gke/cluster_check.py).
    cluster_check = None
    if gke and cfg.gke and cfg.gke.cluster:
        from infra.gke.kinds import check_existing_cluster

        cluster_check = check_existing_cluster(cfg)
    services = ProjectServices(f"{prefix}-apis",
                               ServicesArgs(project=cfg.project, apis=_apis(cfg)))
    after_apis = pulumi.ResourceOptions(depends_on=[services])
    # An existing cluster brings its own network, and so does a shared one (multislice:network,
    # checked first); the stack's VPC is for TPU VMs or a new cluster.
    network: pulumi.Resource | None = None
    if cfg.network is not None:
        network = _check_shared_network(cfg)
    elif not (gke and cfg.gke and cfg.gke.cluster):
        network = _network(cfg, after_apis)
    storage = ExperimentStorage(
        f"{prefix}-storage",
        StorageArgs(
            project=cfg.project,
            location=cfg.region,
            bucket_name=n.bucket,
            archive_path=archive_path,
            archive_object=archive.object_name,
            labels=cfg.all_labels(),
            delete_on_destroy=cfg.delete_bucket_on_destroy,
            adopt_existing=cfg.adopt_bucket,
            soft_delete_days=cfg.soft_delete_days,
            kms_key=cfg.bucket_kms_key,
        ),
        opts=after_apis,
    )
    identity = TrainerIdentity(
        f"{prefix}-identity",
        IdentityArgs(
            project=cfg.project, account_id=n.service_account_id, bucket=storage.bucket.name,
            write_prefixes=manifest.host_write_prefixes(cfg),
            data_buckets=list(cfg.data_buckets), deployer=cfg.deployer,
            index_repository=_index_repository(cfg),
            **({"project_roles": ()} if workload_only else {}),
        ),
        opts=after_apis,
    )
    # A spec whose model cannot restore the run's checkpoints is refused at preview, before it
    # is written (infra/preview/run_check.py).
    run_check = RunCheck(f"{prefix}-run-check", {
        "project": cfg.project, "bucket": n.bucket,
        "run_prefix": n.run_dir.removeprefix(f"gs://{n.bucket}/"),
        "model_shape": _model_shape(cfg, exp_dir)}, opts=pulumi.ResourceOptions(parent=storage))
    checks: list[pulumi.Resource] = [run_check]
    env_output: dict[str, Any] = {}
    # The environment the hosts install: the deployer's, pinned by digest in the spec
    # (infra/preview/env_check.py); with none pinned, each host builds its own.
    spec_text: pulumi.Input[str] = manifest.launch_spec_text(cfg, archive.sha256)
    from infra.packaging.lock import LOCK_FILE
    from infra.preview.env_check import EnvCheck, env_key

    key = env_key(exp_dir / LOCK_FILE)
    if key is not None:
        env_check = EnvCheck(f"{prefix}-env-check", {
            "project": cfg.project, "bucket": n.bucket, "key": key,
            # relative to the project root, the providers' working directory: the same
            # input (and render) on every machine
            "lock": _relative(exp_dir / LOCK_FILE, base_dir),
            "stack_file": f"stacks/Pulumi.{cfg.stack}.yaml",
            **({"package_index": cfg.package_index.url,
                "python_mirror": cfg.package_index.python_mirror or ""}
               if cfg.package_index else {}),
            **_hosts_build(cfg)},
            opts=pulumi.ResourceOptions(parent=storage, depends_on=[storage.bucket]))
        checks.append(env_check)
        env_output = {"environment": env_check.environment}
        spec_text = env_check.sha256.apply(
            lambda digest: manifest.launch_spec_text(cfg, archive.sha256, digest or None))
    # A spec that lands before a grant it needs (a new data bucket, a gs:// init_from) restarts
    # every trainer into a 403: IAM takes minutes to propagate, so it is written after them.
    storage.publish_launch_spec(n.launch_spec_object, spec_text,
                                after=[*identity.grants, *checks])
    common = {
        "bucket": storage.bucket.name,
        "archive": f"gs://{n.bucket}/{archive.object_name}",
        "run_dir": n.run_dir,
        "launch_spec": n.launch_spec_uri,
        "service_account": identity.account.email,
        "bucket_on_destroy": _bucket_on_destroy(cfg),
        **env_output,
    }
    if gke:
        assert network is None or isinstance(network, SliceNetwork)
        from infra.gke.kinds import create_experiment

        return {**create_experiment(cfg, services, network, storage, identity, spec_text,
                                    cluster_check),
                **common}
    assert network is not None
    # The spec names the network, subnet and account by their derived paths (so it is fully known
    # at preview and in the offline render); depends_on orders creation after them.
    queued = MultisliceQueuedResource(
        f"{prefix}-tpu",
        MultisliceQueuedResourceArgs(spec=manifest.queued_resource_spec(cfg)),
        opts=pulumi.ResourceOptions(
            depends_on=[services, network, storage, identity,
                        *([identity.deployer_act_as] if identity.deployer_act_as else [])],
        ),
    )
    return {
        "queued_resource_name": queued.queued_resource_name,
        "node_names": queued.node_names,
        **common,
        **manifest.commands(cfg),
    }


def _hosts_build(cfg: StackConfig) -> dict[str, Any]:
    """Whether the hosts may build the environment when none is published, and why not: not
    without internet, and never as pods on shared capacity (a GKE workload stack's: a build
    there would take minutes of other teams' chips at every pod start)."""
    if cfg.gke is not None and cfg.gke.kind == "workload":
        return {"hosts_build": False,
                "hosts_cannot_build": ["gke.kind: 'workload'", "on shared capacity (its pods "
                                       "install only a published environment)"]}
    if cfg.egress == "none" and cfg.package_index is None:
        return {"hosts_build": False}
    return {"hosts_build": True}


def _relative(path: Path, base: Path) -> str:
    try:
        return str(path.resolve().relative_to(base.resolve()))
    except ValueError:
        return str(path)


def _check_shared_network(cfg: StackConfig) -> pulumi.Resource:
    """A platform team's network, checked at preview (infra/preview/network_check.py); nothing is
    created in it."""
    from infra.preview.network_check import NetworkCheck

    assert cfg.network is not None
    n = cfg.names
    return NetworkCheck(f"{n.prefix}-network-check", {
        "host_project": cfg.network.project or cfg.project, "network": cfg.network.name,
        "subnet": cfg.network.subnet, "region": cfg.region, "zone": cfg.zone,
        "tags": [n.slice_tag, *[t for t in cfg.tags if t != n.slice_tag]],
        "service_account": n.service_account_email, "egress": cfg.egress,
        "warn_only": list(cfg.network.warn_only), "strict": cfg.network.strict})


def _network(cfg: StackConfig, opts: pulumi.ResourceOptions) -> SliceNetwork:
    n = cfg.names
    return SliceNetwork(
        f"{n.prefix}-network",
        NetworkArgs(
            project=cfg.project,
            region=cfg.region,
            subnet_cidr=cfg.subnet_cidr,
            slice_tag=n.slice_tag,
            ssh_from_iap=cfg.ssh_from_iap,
            network_name=n.network,
            subnet_name=n.subnet,
            firewall_internal_name=n.firewall_internal,
            firewall_iap_ssh_name=n.firewall_iap_ssh,
            router_name=n.router,
            nat_name=n.nat,
            nat=cfg.egress == "nat",
        ),
        opts=opts,
    )


def _bucket_on_destroy(cfg: StackConfig) -> str:
    n = cfg.names
    return (
        "deleted with everything in it (delete_bucket_on_destroy: true)"
        if cfg.delete_bucket_on_destroy else
        f"kept: `pulumi destroy` leaves gs://{n.bucket} (checkpoints, environments, logs); "
        f"delete it with `gcloud storage rm -r gs://{n.bucket}`, or set "
        "multislice:delete_bucket_on_destroy: true, run `pulumi up`, then `pulumi destroy` "
        "(destroy reads the setting from the stack's state, not from the stack file)"
        + (f"; with soft delete on, deleted objects stay billed for {cfg.soft_delete_days} "
           "days (multislice:soft_delete_days)" if cfg.soft_delete_days else "")
    )


def _index_repository(cfg: StackConfig) -> tuple[str, str, str] | None:
    """The Artifact Registry repository of the stack's package index, when the stack may grant
    on it (its own project); preview warns about one elsewhere (checks.shared_problems)."""
    repository = cfg.package_index.artifact_registry if cfg.package_index else None
    return repository if repository and repository[0] == cfg.project else None


def _apis(cfg: StackConfig) -> tuple[str, ...]:
    """The APIs the stack enables in its project (none with enable_apis: false). GKE creates the TPU VMs of its node pools itself
    (the TPU API is the queued resource's); a workload stack's cluster, node pools and network
    are the admin's, in the cluster's project."""
    if not cfg.enable_apis:
        return ()
    if cfg.orchestration != "gke":
        return REQUIRED_APIS
    assert cfg.gke is not None
    if cfg.gke.kind == "workload":
        return tuple(a for a in REQUIRED_APIS if a not in (TPU_API, COMPUTE_API))
    return (*(a for a in REQUIRED_APIS if a != TPU_API), GKE_API)


def _create_capacity(cfg: StackConfig) -> dict[str, Any]:
    """gke.kind capacity: the shared parts a capacity has (its APIs, and the network of a cluster
    it creates), then what it owns (infra/gke/kinds.py)."""
    from infra.gke.kinds import check_existing_cluster, create_capacity

    assert cfg.gke is not None
    n = cfg.names
    check = check_existing_cluster(cfg) if cfg.gke.cluster else None
    services = ProjectServices(f"{n.prefix}-apis",
                               ServicesArgs(project=cfg.project, apis=_apis(cfg)))
    network = _network(cfg, pulumi.ResourceOptions(depends_on=[services])) \
        if cfg.gke.create_cluster else None
    return create_capacity(cfg, services, network, check)
