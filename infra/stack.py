"""Wire the components for one validated StackConfig; returns the stack outputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pulumi

from infra import manifest
from infra.archive import build_archive, write_archive
from infra.identity import IdentityArgs, TrainerIdentity
from infra.network import NetworkArgs, SliceNetwork
from infra.run_check import RunCheck, model_shape
from infra.schema import StackConfig
from infra.services import GKE_API, REQUIRED_APIS, TPU_API, ProjectServices, ServicesArgs
from infra.storage import ExperimentStorage, StorageArgs
from infra.tpu_vm.queued_resource import MultisliceQueuedResource, MultisliceQueuedResourceArgs

ARCHIVE_CACHE = ".multislice/archives"


def _model_shape(cfg: StackConfig, experiment: Path) -> dict[str, Any] | None:
    """The parameter-shaping keys of the model the spec trains, by the experiment's own code;
    None when it cannot say (its trainer settings were checked already)."""
    from infra.experiment import ExperimentError, model_summary, trainer_overrides

    try:
        return model_shape(model_summary(experiment, *trainer_overrides(cfg))["model"])
    except ExperimentError:
        return None


def create_stack(cfg: StackConfig, base_dir: Path) -> dict[str, Any]:
    n = cfg.names
    prefix = n.prefix
    exp_dir = Path(cfg.experiment_dir)
    if not exp_dir.is_absolute():
        exp_dir = base_dir / exp_dir
    archive = build_archive(exp_dir)
    archive_path = write_archive(archive, base_dir / ARCHIVE_CACHE)

    gke = cfg.orchestration == "gke"
    # First, before anything is created: an existing cluster that cannot run the stack is one
    # line at preview (infra/gke/cluster_check.py).
    cluster_check = _check_existing_cluster(cfg) if gke and cfg.gke and cfg.gke.cluster else None
    # GKE creates the TPU VMs of its node pools itself: the TPU API is the queued resource's.
    apis = (*(a for a in REQUIRED_APIS if a != TPU_API), GKE_API) if gke else REQUIRED_APIS
    services = ProjectServices(f"{prefix}-apis", ServicesArgs(project=cfg.project, apis=apis))
    after_apis = pulumi.ResourceOptions(depends_on=[services])
    # An existing cluster brings its own network; the stack's VPC is for TPU VMs or a new cluster.
    network = None if gke and cfg.gke and cfg.gke.cluster else SliceNetwork(
        f"{prefix}-network",
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
        ),
        opts=after_apis,
    )
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
        ),
        opts=after_apis,
    )
    identity = TrainerIdentity(
        f"{prefix}-identity",
        IdentityArgs(
            project=cfg.project, account_id=n.service_account_id, bucket=storage.bucket.name,
            data_buckets=list(cfg.data_buckets), deployer=cfg.deployer,
        ),
        opts=after_apis,
    )
    # A spec that lands before a grant it needs (a new data bucket, a gs:// init_from) restarts
    # every trainer into a 403: IAM takes minutes to propagate, so it is written after them.
    spec_text = manifest.launch_spec_text(cfg, archive.sha256)
    # A spec whose model cannot restore the run's checkpoints is refused at preview, before it
    # is written (infra/run_check.py).
    run_check = RunCheck(f"{prefix}-run-check", {
        "project": cfg.project, "bucket": n.bucket,
        "run_prefix": n.run_dir.removeprefix(f"gs://{n.bucket}/"),
        "model_shape": _model_shape(cfg, exp_dir)}, opts=pulumi.ResourceOptions(parent=storage))
    storage.publish_launch_spec(n.launch_spec_object, spec_text,
                                after=[*identity.grants, run_check])
    common = {
        "bucket": storage.bucket.name,
        "archive": f"gs://{n.bucket}/{archive.object_name}",
        "run_dir": n.run_dir,
        "launch_spec": n.launch_spec_uri,
        "service_account": identity.account.email,
        "bucket_on_destroy": _bucket_on_destroy(cfg),
    }
    if gke:
        return {**_create_gke(cfg, services, network, storage, identity, spec_text, cluster_check),
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


def _check_existing_cluster(cfg: StackConfig) -> pulumi.Resource:
    """The existing cluster as the GKE API describes it, checked against what the stack needs,
    and the CRDs of the controllers it does not install."""
    import pulumi_gcp as gcp

    from infra.gke import manifest as gke_manifest
    from infra.gke.cluster_check import (
        JOBSET_CRDS,
        KUEUE_CRDS,
        ClusterCheck,
        admin_objects,
        check_inputs,
    )

    assert cfg.gke is not None and cfg.gke.cluster is not None
    installs = cfg.gke.installs()
    crds = [*(() if installs["jobset"] else JOBSET_CRDS),
            *(KUEUE_CRDS if cfg.gke.queued and not installs["kueue"] else ())]
    found = gcp.container.get_cluster(name=gke_manifest.cluster_name(cfg),
                                      location=gke_manifest.cluster_location(cfg),
                                      project=cfg.project)
    return ClusterCheck(f"{cfg.names.prefix}-cluster-check", check_inputs(
        found, cluster_path=cfg.gke.cluster, project=cfg.project, capacity=cfg.capacity,
        family=cfg.topology.family, crds=crds,
        objects=admin_objects(gke_manifest.namespace(cfg), cfg.gke.local_queue,
                              cfg.gke.priority_class)))


def _create_gke(cfg: StackConfig, services: ProjectServices, network: SliceNetwork | None,
                storage: ExperimentStorage, identity: TrainerIdentity, spec_text: str,
                cluster_check: pulumi.Resource | None) -> dict[str, Any]:
    from infra.gke import manifest as gke_manifest
    from infra.gke.k8s_names import CLUSTER_NAMESPACES
    from infra.gke.resources import GkeArgs, GkeSlices

    n = cfg.names
    assert cfg.gke is not None
    slices = GkeSlices(
        f"{n.prefix}-gke-slices",
        GkeArgs(
            project=cfg.project,
            cluster_name=gke_manifest.cluster_name(cfg),
            location=gke_manifest.cluster_location(cfg),
            zone=cfg.zone,
            create_cluster=cfg.gke.create_cluster,
            node_pools=[gke_manifest.node_pool(cfg, i) for i in range(cfg.slices)],
            jobset=gke_manifest.jobset(cfg, gke_manifest.launch_spec_sha256(spec_text)),
            namespace=gke_manifest.namespace(cfg),
            k8s_service_account=n.k8s_service_account,
            node_account_id=n.gke_node_account_id,
            image_repository=gke_manifest.image_repository(cfg.gke.image),
            deployer=cfg.deployer,
            service_account_email=n.service_account_email,
            service_account_name=identity.account.name,
            workload_identity_member=gke_manifest.workload_identity_member(cfg),
            boot_config_map=n.boot_config_map,
            boot_files=gke_manifest.boot_files(),
            labels=cfg.toolkit_labels(),
            release_channel=cfg.gke.release_channel,
            network=network.network.id if network else None,
            subnetwork=network.subnet.id if network else None,
            cpu_pool_name=n.gke_cpu_pool,
            install_jobset=cfg.gke.installs()["jobset"],
            kueue_objects=gke_manifest.kueue_objects(cfg) if cfg.gke.queueing else [],
            install_kueue=cfg.gke.installs()["kueue"],
            cluster_check=cluster_check,
            # the admin's namespace (it holds their queue), or one every cluster has, is not
            # the stack's to declare: pulumi would adopt it and delete it on destroy
            create_namespace=(cfg.gke.local_queue is None
                              and cfg.gke.namespace not in CLUSTER_NAMESPACES),
        ),
        opts=pulumi.ResourceOptions(depends_on=[
            services, storage, identity, *([network] if network else []),
            *([identity.deployer_act_as] if identity.deployer_act_as else [])]),
    )
    return {
        "cluster": cfg.gke.cluster or gke_manifest.cluster_name(cfg),
        "node_pools": [p.name for p in slices.node_pools],
        "jobset": f"{gke_manifest.namespace(cfg)}/{n.jobset}",
    }
