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
        return _create_gke_capacity(cfg)
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
    cluster_check = _check_existing_cluster(cfg) if gke and cfg.gke and cfg.gke.cluster else None
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
        ),
        opts=after_apis,
    )
    identity = TrainerIdentity(
        f"{prefix}-identity",
        IdentityArgs(
            project=cfg.project, account_id=n.service_account_id, bucket=storage.bucket.name,
            write_prefixes=manifest.host_write_prefixes(cfg),
            data_buckets=list(cfg.data_buckets), deployer=cfg.deployer,
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
            "hosts_build": not (cfg.egress == "none" and cfg.package_index is None)},
            opts=pulumi.ResourceOptions(parent=storage, depends_on=[storage.bucket]))
        checks.append(env_check)
        env_output = {"environment": env_check.environment}
        spec_text = pulumi.Output.all(env_check.sha256, env_check.tree_sha256).apply(
            lambda digests: manifest.launch_spec_text(cfg, archive.sha256, digests[0] or None,
                                                      digests[1] or None))
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
        "egress": cfg.egress})


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
        owned_objects,
        team_namespace_objects,
        workload_access,
    )
    from infra.gke.k8s_names import CLUSTER_NAMESPACES
    from infra.gke.topology import ACCELERATOR_LABEL, TOPOLOGY_LABEL, gke_slice

    assert cfg.gke is not None and cfg.gke.cluster is not None
    installs = cfg.gke.installs()
    capacity_stack = cfg.gke.kind == "capacity"
    uses_kueue = cfg.gke.queued or capacity_stack
    crds = [*(() if installs["jobset"] else JOBSET_CRDS),
            *(KUEUE_CRDS if uses_kueue and not installs["kueue"] else ())]
    cluster_project = gke_manifest.cluster_project(cfg)
    found = gcp.container.get_cluster(name=gke_manifest.cluster_name(cfg),
                                      location=gke_manifest.cluster_location(cfg),
                                      project=cluster_project)
    named = cfg.gke.namespace is not None and cfg.gke.namespace not in CLUSTER_NAMESPACES
    declares_namespace = (cfg.gke.kind == "all" and cfg.gke.local_queue is None
                          and gke_manifest.namespace(cfg) not in CLUSTER_NAMESPACES)
    shape = gke_slice(cfg.topology)
    # What the stack creates under names made from its stack name alone: on a shared cluster
    # another team's stack of that name may hold them (refused at preview, naming the owner).
    owned = (owned_objects(gke_manifest.namespace(cfg) if declares_namespace else None,
                           [o for o in (gke_manifest.capacity_objects(cfg) if capacity_stack
                                        else gke_manifest.kueue_objects(cfg)
                                        if cfg.gke.queueing else [])
                            if "namespace" not in o["metadata"]], cfg.owner_labels(),
                           gke_manifest.pod_security_level(cfg))
             if cfg.gke.kind != "workload" else [])
    return ClusterCheck(f"{cfg.names.prefix}-cluster-check", check_inputs(
        found, cluster_path=cfg.gke.cluster, project=cluster_project, capacity=cfg.capacity,
        family=cfg.topology.family, crds=crds,
        objects=owned + (team_namespace_objects(cfg.gke.team_names)
                         if capacity_stack else admin_objects(
            gke_manifest.namespace(cfg), cfg.gke.local_queue, cfg.gke.priority_class,
            named_namespace=named and not declares_namespace,
            pod_security=gke_manifest.pod_security_level(cfg))),
        # The stack's own namespace does not exist before its first `pulumi up`: only a named
        # one is asked what the deployer may do in it.
        access=workload_access(gke_manifest.namespace(cfg), cfg.gke.queueing)
        if named and not capacity_stack else [],
        need_pools={"machine_type": shape.machine_type, "topology": shape.topology,
                    "count": cfg.slices} if cfg.gke.kind == "workload" else None,
        needs_network_policy=capacity_stack,
        installs={**({"JobSet": list(JOBSET_CRDS)} if installs["jobset"] else {}),
                  **({"Kueue": list(KUEUE_CRDS)} if installs["kueue"] else {})},
        uses_kueue=uses_kueue,
        creates_queue_objects=capacity_stack or cfg.gke.queueing,
        queue_fit={"namespace": gke_manifest.namespace(cfg), "queue": cfg.gke.local_queue,
                   "shape_labels": {ACCELERATOR_LABEL: shape.accelerator,
                                    TOPOLOGY_LABEL: shape.topology},
                   "chips": cfg.slices * shape.nodes * shape.chips_per_node,
                   "slices": cfg.slices} if cfg.gke.local_queue else None,
        admission_policy=capacity_stack and all(installs.values())))


def _apis(cfg: StackConfig) -> tuple[str, ...]:
    """The APIs the stack uses in its project. GKE creates the TPU VMs of its node pools itself
    (the TPU API is the queued resource's); a workload stack's cluster, node pools and network
    are the admin's, in the cluster's project."""
    if cfg.orchestration != "gke":
        return REQUIRED_APIS
    assert cfg.gke is not None
    if cfg.gke.kind == "workload":
        return tuple(a for a in REQUIRED_APIS if a not in (TPU_API, COMPUTE_API))
    return (*(a for a in REQUIRED_APIS if a != TPU_API), GKE_API)


def _cluster_args(cfg: StackConfig, network: SliceNetwork | None,
                  check: pulumi.Resource | None) -> Any:
    from infra.gke import manifest as gke_manifest
    from infra.gke.cluster import NewCluster
    from infra.gke.resources import ClusterArgs

    assert cfg.gke is not None
    n = cfg.names
    new = None
    if cfg.gke.create_cluster:
        assert network is not None
        new = NewCluster(
            name=gke_manifest.cluster_name(cfg), project=cfg.project,
            location=gke_manifest.cluster_location(cfg), zone=cfg.zone,
            network=network.network.id, subnetwork=network.subnet.id,
            cpu_pool_name=n.gke_cpu_pool, node_account_email="",
            release_channel=cfg.gke.release_channel, labels=cfg.toolkit_labels(),
            authorized_networks=list(cfg.gke.authorized_networks),
            private_endpoint=cfg.gke.private_endpoint,
            deletion_protection=cfg.gke.deletion_protection)
    return ClusterArgs(project=gke_manifest.cluster_project(cfg),
                       name=gke_manifest.cluster_name(cfg),
                       location=gke_manifest.cluster_location(cfg), new=new, check=check)


def _capacity_args(cfg: StackConfig, network: SliceNetwork | None,
                   check: pulumi.Resource | None) -> Any:
    from infra.gke import manifest as gke_manifest
    from infra.gke.resources import CapacityArgs

    assert cfg.gke is not None
    capacity = cfg.gke.kind == "capacity"
    return CapacityArgs(
        cluster=_cluster_args(cfg, network, check),
        node_pools=gke_manifest.node_pools(cfg),
        node_account_id=cfg.names.gke_node_account_id,
        image_repository=None if capacity else gke_manifest.image_repository(cfg.gke.image),
        deployer=cfg.deployer,
        install_jobset=cfg.gke.installs()["jobset"],
        install_kueue=cfg.gke.installs()["kueue"],
        queue_objects=gke_manifest.capacity_objects(cfg) if capacity else [],
        # Only a created cluster's: an existing cluster's team namespaces are the platform's
        # (checked at preview, never created or deleted by a stack).
        team_namespaces=cfg.gke.team_names if capacity and cfg.gke.create_cluster else [],
        namespace_labels={**cfg.owner_labels(), **gke_manifest.namespace_labels(cfg)},
    )


def _create_gke_capacity(cfg: StackConfig) -> dict[str, Any]:
    """gke.kind capacity: no experiment, bucket or trainer; the cluster, pools, controllers and
    queue that teams' workload stacks run on."""
    from infra.gke import manifest as gke_manifest
    from infra.gke.resources import GkeCapacity

    assert cfg.gke is not None
    n = cfg.names
    check = _check_existing_cluster(cfg) if cfg.gke.cluster else None
    services = ProjectServices(f"{n.prefix}-apis",
                               ServicesArgs(project=cfg.project, apis=_apis(cfg)))
    network = _network(cfg, pulumi.ResourceOptions(depends_on=[services])) \
        if cfg.gke.create_cluster else None
    queue_objects = gke_manifest.capacity_objects(cfg)
    capacity = GkeCapacity(f"{n.prefix}-gke-capacity", _capacity_args(cfg, network, check),
                           opts=pulumi.ResourceOptions(depends_on=[
                               services, *([network] if network else [])]))
    return {
        "cluster": cfg.gke.cluster or gke_manifest.cluster_name(cfg),
        "node_pools": [p.name for p in capacity.node_pools],
        "cluster_queues": sorted(o["metadata"]["name"] for o in queue_objects
                                 if o["kind"] == "ClusterQueue"),
        "local_queues": sorted(f"{o['metadata']['namespace']}/{o['metadata']['name']}"
                               for o in queue_objects if o["kind"] == "LocalQueue"),
        **_billing(cfg),
        **_control_plane(cfg),
    }


def _control_plane(cfg: StackConfig) -> dict[str, str]:
    """Who can reach a created cluster's control plane (render shows it)."""
    assert cfg.gke is not None
    if not cfg.gke.create_cluster:
        return {}
    if cfg.gke.private_endpoint:
        reach = ("reachable on its private endpoint only (gke.private_endpoint): run pulumi "
                 "from inside the VPC")
    elif cfg.gke.authorized_networks:
        reach = (f"reachable only from {', '.join(cfg.gke.authorized_networks)} "
                 "(gke.authorized_networks)")
    else:
        reach = ("reachable from anywhere, with credentials: set gke.authorized_networks to "
                 "your offices' and CI's ranges, or gke.private_endpoint: true")
    return {"control_plane": reach}


def _billing(cfg: StackConfig) -> dict[str, str]:
    """What stays billed once a run has finished, and how to stop it (render shows it)."""
    assert cfg.gke is not None
    if cfg.gke.kind == "workload":
        return {"billing": "nothing of its own but the bucket: the node pools are the "
                           "admin's (their capacity stack says what they cost idle)"}
    if cfg.gke.pools_scale_to_zero(cfg.capacity):
        return {"billing": "the TPU node pools scale to zero nodes when no pod runs on them "
                           "(GKE's cluster autoscaler): a finished run stops billing TPUs"}
    return {"billing": f"the {cfg.slices} TPU node pool(s) stay up and billed after the run "
                       "completes, until `pulumi destroy`; set multislice:gke.scale_to_zero: "
                       "true to have them scale to zero nodes between runs"}


def _create_gke(cfg: StackConfig, services: ProjectServices, network: SliceNetwork | None,
                storage: ExperimentStorage, identity: TrainerIdentity,
                spec_text: pulumi.Input[str],
                cluster_check: pulumi.Resource | None) -> dict[str, Any]:
    from infra.gke import manifest as gke_manifest
    from infra.gke.k8s_names import CLUSTER_NAMESPACES
    from infra.gke.resources import GkeSlices, GkeWorkload
    from infra.gke.workload import WorkloadArgs

    n = cfg.names
    assert cfg.gke is not None
    # A stack of kind all declares its namespace (ms-STACK, or the one it names), never one
    # every cluster has, nor the admin's that holds their queue (local_queue); a workload stack
    # runs in the admin's. The cluster check refuses a named one that exists and is not this
    # stack's (no AlreadyExists at up); a named one is retained on destroy.
    own_namespace = (cfg.gke.kind == "all" and cfg.gke.local_queue is None
                     and cfg.gke.namespace not in CLUSTER_NAMESPACES)
    workload = WorkloadArgs(
        jobset=gke_manifest.jobset(cfg, pulumi.Output.from_input(spec_text).apply(
            gke_manifest.launch_spec_sha256)),
        namespace=gke_manifest.namespace(cfg),
        create_namespace=own_namespace,
        retain_namespace=own_namespace and cfg.gke.namespace is not None,
        namespace_labels={**cfg.owner_labels(), **gke_manifest.namespace_labels(cfg)},
        k8s_service_account=n.k8s_service_account,
        service_account_email=n.service_account_email,
        service_account_name=identity.account.name,
        workload_identity_member=gke_manifest.workload_identity_member(cfg),
        boot_config_map=n.boot_config_map,
        boot_files=gke_manifest.boot_files(),
        labels=cfg.toolkit_labels(),
        kueue_objects=gke_manifest.kueue_objects(cfg) if cfg.gke.queueing else [],
    )
    after = pulumi.ResourceOptions(depends_on=[
        services, storage, identity, *([network] if network else []),
        *([identity.deployer_act_as] if identity.deployer_act_as else [])])
    outputs: dict[str, Any] = {
        "cluster": cfg.gke.cluster or gke_manifest.cluster_name(cfg),
        "jobset": f"{gke_manifest.namespace(cfg)}/{n.jobset}",
        **_billing(cfg),
        **_control_plane(cfg),
    }
    if cfg.gke.kind == "workload":
        GkeWorkload(f"{n.prefix}-gke-workload", _cluster_args(cfg, None, cluster_check),
                    workload, opts=after)
        return outputs
    slices = GkeSlices(f"{n.prefix}-gke-slices", _capacity_args(cfg, network, cluster_check),
                       workload, opts=after)
    return {**outputs, "node_pools": [p.name for p in slices.node_pools]}
