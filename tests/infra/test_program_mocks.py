"""The Pulumi program under the mock runtime: every resource and its security-relevant settings."""

import json
import runpy

import pytest

from infra.packaging.archive import build_archive
from infra.stack_config.schema import StackConfigError
from infra.tpu_vm.request import build_queued_resource_request
from tests.infra.conftest import KEEPS, REPLACES, base_config
from tests.infra.pulumi_mocks import DYNAMIC, run_program

NETWORK = "gcp:compute/network:Network"
SUBNET = "gcp:compute/subnetwork:Subnetwork"
FIREWALL = "gcp:compute/firewall:Firewall"
ROUTER = "gcp:compute/router:Router"
NAT = "gcp:compute/routerNat:RouterNat"
BUCKET = "gcp:storage/bucket:Bucket"
OBJECT = "gcp:storage/bucketObject:BucketObject"
ACCOUNT = "gcp:serviceaccount/account:Account"
BUCKET_IAM = "gcp:storage/bucketIAMMember:BucketIAMMember"
PROJECT_IAM = "gcp:projects/iAMMember:IAMMember"
SERVICE = "gcp:projects/service:Service"
SA_IAM = "gcp:serviceaccount/iAMMember:IAMMember"

SEED_V5E = base_config(
    accelerator_type="v5litepod-16",
    slices=4,
    capacity="spot",
    tags=["example-tag-1", "example-tag-2"],
    labels={"team": "research"},
    trainer={
        "config": "tiny",
        "steps": 100,
        "mesh": {"ici_fsdp": 16, "dcn_data": 4},
        "overrides": {"train.global_batch_size": 64},  # 64 batch shards
    },
)


@pytest.fixture(params=[1, 4], ids=["1-slice", "4-slices"])
def program(request, project_root):
    slices = request.param
    cfg = base_config(
        slices=slices,
        accelerator_type="v4-8" if slices == 1 else "v5litepod-16",
        capacity="spot",
        tags=["example-tag-1"],
    )
    if slices > 1:  # 4 x 16 devices: 64 batch shards
        cfg["trainer"] = {**cfg["trainer"], "overrides": {"train.global_batch_size": 64}}
    mocks, outputs = run_program(cfg, project_root)
    return slices, mocks, outputs


def test_network_has_mtu_8896_and_no_auto_subnets(program):
    _, mocks, _ = program
    net = mocks.one(NETWORK)
    net.expect("mtu", 8896)
    net.expect("autoCreateSubnetworks", False)
    sub = mocks.one(SUBNET)
    sub.expect("privateIpGoogleAccess", True)
    sub.expect("ipCidrRange", "10.128.0.0/20")


def test_slice_firewall_allows_all_tcp_udp_icmp_from_and_to_the_slice_tag_only(program):
    _, mocks, _ = program
    (fw,) = mocks.of_type(FIREWALL)  # ssh_from_iap defaults off: no SSH rule at all
    fw.expect("allows", [{"protocol": "tcp"}, {"protocol": "udp"}, {"protocol": "icmp"}])
    fw.expect("sourceTags", ["ms-exp-slice"])
    fw.expect("targetTags", ["ms-exp-slice"])
    assert "sourceRanges" not in fw.inputs, (
        f"{fw.urn}: has sourceRanges {fw.inputs.get('sourceRanges')}"
    )


def test_no_rule_anywhere_is_open_to_the_internet(program):
    _, mocks, _ = program
    for fw in mocks.of_type(FIREWALL):
        assert "0.0.0.0/0" not in (fw.inputs.get("sourceRanges") or []), fw.urn


def test_egress_goes_through_cloud_nat(program):
    _, mocks, _ = program
    mocks.one(ROUTER).expect("region", "us-central2")
    nat = mocks.one(NAT)
    nat.expect("natIpAllocateOption", "AUTO_ONLY")
    nat.expect("sourceSubnetworkIpRangesToNat", "ALL_SUBNETWORKS_ALL_IP_RANGES")


def test_bucket_is_private_uniform_and_labelled(program):
    _, mocks, _ = program
    bucket = mocks.one(BUCKET)
    bucket.expect("uniformBucketLevelAccess", True)
    bucket.expect("publicAccessPrevention", "enforced")
    bucket.expect("labels", {"multislice-stack": "exp"})
    bucket.expect("name", "my-proj-ms-exp")


def _objects(mocks) -> dict[str, object]:
    return {o.inputs["name"]: o for o in mocks.of_type(OBJECT)}


def test_archive_object_is_named_by_content_hash(program, project_root):
    _, mocks, _ = program
    sha = build_archive(project_root / "experiments" / "demo").sha256
    assert set(_objects(mocks)) == {f"code/{sha}.tar.gz", "launch/exp.json"}


def test_launch_spec_is_a_bucket_object_naming_the_archive_and_the_run(program, project_root):
    slices, mocks, outputs = program
    sha = build_archive(project_root / "experiments" / "demo").sha256
    obj = _objects(mocks)["launch/exp.json"]
    obj.expect("bucket", "my-proj-ms-exp")
    obj.expect("contentType", "application/json")
    spec = json.loads(obj.inputs["source"].text)
    assert spec["archive_sha256"] == sha and spec["run_dir"] == "gs://my-proj-ms-exp/runs/exp"
    assert spec["expect_slices"] == slices and spec["stack"] == "exp"
    assert "wait_for_active_s" not in obj.inputs["source"].text  # provider-only: not on VMs
    assert outputs["run_dir"] == spec["run_dir"]
    assert outputs["launch_spec"] == "gs://my-proj-ms-exp/launch/exp.json"
    # Replaced by delete-then-create (same name), after the archive it names exists.
    options = mocks.options[obj.name]
    assert options.delete_before_replace is True
    archive = _objects(mocks)[f"code/{sha}.tar.gz"]
    assert mocks.objects[archive.name] in (options.depends_on or []), options.depends_on


def test_service_account_is_dedicated_with_least_privilege(program):
    _, mocks, _ = program
    sa = mocks.one(ACCOUNT)
    sa.expect("accountId", "ms-exp-tpu")
    member = "serviceAccount:ms-exp-tpu@my-proj.iam.gserviceaccount.com"
    grants = {g.inputs["role"]: g for g in mocks.of_type(BUCKET_IAM)}
    assert sorted(grants) == ["roles/storage.objectUser", "roles/storage.objectViewer"]
    assert all(g.inputs["bucket"] == "my-proj-ms-exp" and g.inputs["member"] == member
               for g in grants.values())
    roles = sorted(r.inputs["role"] for r in mocks.of_type(PROJECT_IAM))
    assert roles == ["roles/logging.logWriter", "roles/monitoring.metricWriter"]
    assert all(r.inputs["member"] == member for r in mocks.of_type(PROJECT_IAM))


def test_queued_resource_inputs_and_full_request(program):
    slices, mocks, outputs = program
    qr = mocks.queued_resource()
    qr.expect("slices", slices)
    qr.expect("capacity", "spot")
    qr.expect("enable_external_ips", False)
    qr.expect("secure_boot", True)  # the default: only signed boot components run
    qr.expect("service_account_email", "ms-exp-tpu@my-proj.iam.gserviceaccount.com")
    qr.expect("tags", ["ms-exp-slice", "example-tag-1"])
    assert "compute@developer.gserviceaccount.com" not in json.dumps(qr.inputs), qr.urn
    request = build_queued_resource_request(qr.inputs)
    queued = request["queued_resource"]
    node_spec = queued["tpu"]["node_spec"][0]
    assert queued["spot"] == {}, qr.urn
    if slices == 1:
        assert node_spec["node_id"] == "ms-exp" and "multislice_params" not in node_spec, qr.urn
    else:
        assert node_spec["multislice_params"] == {"node_count": 4, "node_id_prefix": "ms-exp"}, (
            qr.urn
        )
    node = node_spec["node"]
    assert node["network_config"] == {
        "network": "projects/my-proj/global/networks/ms-exp-net",
        "subnetwork": "projects/my-proj/regions/us-central2/subnetworks/ms-exp-subnet",
        "enable_external_ips": False,
    }, qr.urn
    assert node["metadata"]["startup-script"].startswith("#!/bin/bash"), qr.urn
    assert node["shielded_instance_config"] == {"enable_secure_boot": True}, qr.urn
    # Only what is fixed for the stack: the code and the trainer live in the launch spec object.
    assert set(node["metadata"]) == {"startup-script", "multislice-launch-py",
                                     "launch-spec-uri", "enable-oslogin"}, qr.urn
    assert node["metadata"]["enable-oslogin"] == "TRUE"  # SSH by IAM, no metadata keys
    assert node["metadata"]["launch-spec-uri"] == "gs://my-proj-ms-exp/launch/exp.json"
    assert len(outputs["node_names"]) == slices


def test_iap_ssh_rule_only_when_asked_and_only_from_the_iap_range(project_root):
    mocks, outputs = run_program(base_config(ssh_from_iap=True), project_root)
    ssh = [fw for fw in mocks.of_type(FIREWALL) if fw.name.endswith("allow-iap-ssh")]
    assert len(ssh) == 1
    ssh[0].expect("sourceRanges", ["35.235.240.0/20"])
    ssh[0].expect("allows", [{"protocol": "tcp", "ports": ["22"]}])
    assert outputs["ssh_command"].endswith("--tunnel-through-iap")


def test_seed_v5e_example_reproduces_the_seed_request(project_root):
    mocks, _ = run_program(SEED_V5E, project_root, stack="seed-v5e")
    qr = mocks.queued_resource()
    request = build_queued_resource_request(qr.inputs)
    node_spec = request["queued_resource"]["tpu"]["node_spec"][0]
    assert node_spec["node"]["accelerator_type"] == "v5litepod-16"
    assert node_spec["node"]["runtime_version"] == "v2-alpha-tpuv5-lite"
    assert node_spec["multislice_params"]["node_count"] == 4
    assert {"example-tag-1", "example-tag-2"} <= set(node_spec["node"]["tags"])
    assert node_spec["node"]["labels"] == {"multislice-stack": "seed-v5e", "team": "research"}


def test_invalid_config_fails_before_any_resource_is_registered(project_root):
    with pytest.raises(StackConfigError, match="zone: 'europe-west4-a' is not in region"):
        run_program(base_config(zone="europe-west4-a"), project_root)


def test_entry_point_wires_the_same_program(project_root, monkeypatch):
    """__main__.py itself (what `pulumi up` runs), against the mock runtime."""
    import pulumi

    from tests.infra.pulumi_mocks import RecordingMocks

    mocks = RecordingMocks()
    pulumi.runtime.set_mocks(mocks, project="multislice", stack="exp", preview=False)
    cfg = base_config(experiment_dir=str(project_root / "experiments" / "demo"))
    pulumi.runtime.set_all_config(
        {f"multislice:{k}": v if isinstance(v, str) else json.dumps(v) for k, v in cfg.items()}
    )

    @pulumi.runtime.test
    def run():
        runpy.run_path("__main__.py", run_name="__main__")

    run()
    assert sorted(r.name for r in mocks.of_type(DYNAMIC)) == [
        "ms-exp-env-check", "ms-exp-qr", "ms-exp-run-check"]
    assert {r.typ for r in mocks.resources} >= {NETWORK, SUBNET, FIREWALL, NAT, BUCKET, ACCOUNT}


def test_serialized_provider_round_trips_and_accepts_the_recorded_inputs(project_root):
    """The engine stores the provider pickled in `__provider`; `pulumi up` unpickles it."""
    import base64

    import dill

    from infra.tpu_vm.provider import QueuedResourceProvider

    mocks, _ = run_program(base_config(slices=4), project_root)
    qr = mocks.queued_resource()
    provider = dill.loads(base64.b64decode(qr.inputs["__provider"]))
    assert isinstance(provider, QueuedResourceProvider), qr.urn
    inputs = {k: v for k, v in qr.inputs.items() if k != "__provider"}
    assert provider.check({}, inputs).failures == [], qr.urn


def test_entry_point_reports_a_bad_config_as_a_clean_run_error(project_root):
    import pulumi

    from tests.infra.pulumi_mocks import RecordingMocks

    mocks = RecordingMocks()
    pulumi.runtime.set_mocks(mocks, project="multislice", stack="exp", preview=True)
    cfg = base_config(slices=300, experiment_dir=str(project_root / "experiments" / "demo"))
    pulumi.runtime.set_all_config(
        {f"multislice:{k}": v if isinstance(v, str) else json.dumps(v) for k, v in cfg.items()}
    )

    @pulumi.runtime.test
    def run():
        runpy.run_path("__main__.py", run_name="__main__")

    with pytest.raises(pulumi.RunError, match="slices: value 300 is out of range; allowed 1..256"):
        run()
    assert mocks.resources == []  # nothing was registered before validation failed


def test_the_program_enables_the_apis_it_uses_and_never_disables_them(program):
    _, mocks, _ = program
    services = mocks.of_type(SERVICE)
    assert sorted(s.inputs["service"] for s in services) == [
        "cloudresourcemanager.googleapis.com", "compute.googleapis.com", "iam.googleapis.com",
        "storage.googleapis.com", "tpu.googleapis.com"]
    for service in services:
        service.expect("disableOnDestroy", False)
        service.expect("project", "my-proj")


def test_the_queued_resource_and_the_other_components_wait_for_the_apis(program):
    _, mocks, _ = program
    apis = mocks.objects["ms-exp-apis"]
    for component in ("ms-exp-tpu", "ms-exp-network", "ms-exp-storage", "ms-exp-identity"):
        assert apis in (mocks.options[component].depends_on or []), component


def test_destroy_keeps_the_bucket_by_default_and_says_how_to_delete_it(project_root):
    mocks, outputs = run_program(base_config(), project_root)
    bucket = mocks.one(BUCKET)
    bucket.expect("forceDestroy", False)
    assert mocks.options[bucket.name].retain_on_delete is True, bucket.urn
    assert outputs["bucket_on_destroy"].startswith(f"kept: `pulumi destroy` leaves gs://"
                                                   f"{bucket.inputs['name']}")
    assert f"gcloud storage rm -r gs://{bucket.inputs['name']}" in outputs["bucket_on_destroy"]


def test_delete_bucket_on_destroy_deletes_it_with_its_contents(project_root):
    mocks, outputs = run_program(base_config(delete_bucket_on_destroy=True), project_root)
    bucket = mocks.one(BUCKET)
    bucket.expect("forceDestroy", True)
    assert not mocks.options[bucket.name].retain_on_delete, bucket.urn
    assert outputs["bucket_on_destroy"].startswith("deleted with everything in it")


def test_destroy_deletes_the_bucket_only_after_an_up_records_the_setting(project_root):
    # `pulumi destroy` runs no program: it reads retainOnDelete and forceDestroy from the state
    # the last `pulumi up` wrote. So flipping the setting must change what an up records, and the
    # output must say to run one before destroying.
    kept, kept_outputs = run_program(base_config(), project_root)
    deleted, _ = run_program(base_config(delete_bucket_on_destroy=True), project_root)
    before, after = kept.one(BUCKET), deleted.one(BUCKET)
    assert (before.inputs["forceDestroy"], after.inputs["forceDestroy"]) == (False, True)
    assert (kept.options[before.name].retain_on_delete,
            bool(deleted.options[after.name].retain_on_delete)) == (True, False)
    message = kept_outputs["bucket_on_destroy"]
    assert message.index("delete_bucket_on_destroy: true") < message.index("`pulumi up`") \
        < message.index("then `pulumi destroy`"), message


def test_adopt_bucket_imports_the_kept_bucket_where_the_program_declares_it(project_root):
    mocks, _ = run_program(base_config(), project_root)
    assert mocks.one(BUCKET).import_id is None  # a new stack creates its bucket
    mocks, _ = run_program(base_config(adopt_bucket=True), project_root)
    bucket = mocks.one(BUCKET)
    assert bucket.import_id == bucket.inputs["name"] == "my-proj-ms-exp"
    # Under the storage component, as the program declares it, and not protected: a root-level
    # protected import (what `pulumi import` makes) would be created again and refused deletion.
    options = mocks.options[bucket.name]
    assert options.parent is mocks.objects["ms-exp-storage"]
    assert not options.protect
    assert options.retain_on_delete is True  # still kept by destroy


def test_soft_delete_keeps_deleted_checkpoints_a_week_by_default_and_can_be_turned_off(
        project_root):
    mocks, outputs = run_program(base_config(), project_root)
    assert mocks.one(BUCKET).inputs["softDeletePolicy"] == {"retentionDurationSeconds": 604800}
    assert "deleted objects stay billed for 7 days" in outputs["bucket_on_destroy"]
    mocks, outputs = run_program(base_config(soft_delete_days=0), project_root)
    assert mocks.one(BUCKET).inputs["softDeletePolicy"] == {"retentionDurationSeconds": 0}
    assert "soft delete" not in outputs["bucket_on_destroy"]


@pytest.mark.parametrize("days", [3, 91, -1])
def test_soft_delete_outside_the_range_cloud_storage_accepts_is_refused_at_preview(
        days, project_root):
    with pytest.raises(StackConfigError, match=rf"soft_delete_days: value {days} is not "
                       r"allowed; use 0 \(soft delete off\) or 7\.\.90 days"):
        run_program(base_config(soft_delete_days=days), project_root)


def test_the_launch_spec_is_written_after_every_grant_the_trainer_relies_on(project_root):
    # A spec that lands first restarts the trainers into a 403 on a bucket whose grant is still
    # propagating (a new data bucket on day two): it must wait for every role binding.
    mocks, _ = run_program(base_config(data_buckets=["corpora"]), project_root)
    spec = _objects(mocks)["launch/exp.json"]
    waits_for = mocks.options[spec.name].depends_on or []
    grants = [*mocks.of_type(BUCKET_IAM), *mocks.of_type(PROJECT_IAM)]
    assert len(grants) >= 3
    for grant in grants:
        assert mocks.objects[grant.name] in waits_for, grant.urn


def _qr_and_spec(config: dict, base_dir) -> tuple[dict, str]:
    mocks, _ = run_program(config, base_dir)
    return dict(mocks.queued_resource().inputs), _objects(mocks)["launch/exp.json"].inputs["source"].text


@pytest.mark.parametrize("what", [*KEEPS, "code"])
def test_day_two_changes_rewrite_the_launch_spec_and_keep_the_queued_resource(what, project_root):
    from infra.tpu_vm.provider import QueuedResourceProvider

    demo = project_root / "experiments" / "demo"
    old_qr, old_spec = _qr_and_spec(base_config(experiment_dir=str(demo)), project_root)
    if what == "code":
        code = min(demo.rglob("*.py"))
        code.write_text(code.read_text() + "\n# a one-line change\n")
        changes = {}
    else:
        changes = KEEPS[what]
    new_qr, new_spec = _qr_and_spec(base_config(experiment_dir=str(demo), **changes),
                                    project_root)
    diff = QueuedResourceProvider().diff("qr", old_qr, new_qr)
    assert diff.replaces == [], (what, diff.replaces)
    if what == "provider-only":
        assert new_spec == old_spec and diff.changes  # an update of the provider's inputs only
    else:
        assert new_spec != old_spec and new_qr == old_qr, what


@pytest.mark.parametrize("what", list(REPLACES))
def test_machine_changes_replace_the_queued_resource_naming_the_field(what, project_root):
    from infra.tpu_vm.provider import QueuedResourceProvider

    changes, field = REPLACES[what]
    old_qr, _ = _qr_and_spec(base_config(), project_root)
    new_qr, _ = _qr_and_spec(base_config(**changes), project_root)
    assert QueuedResourceProvider().diff("qr", old_qr, new_qr).replaces == [field]


def test_data_buckets_are_readable_and_nothing_more(project_root):
    mocks, _ = run_program(base_config(data_buckets=["corpora", "team-eval"]), project_root)
    member = "serviceAccount:ms-exp-tpu@my-proj.iam.gserviceaccount.com"
    grants = {(g.inputs["bucket"], g.inputs["role"], g.inputs["member"])
              for g in mocks.of_type(BUCKET_IAM)}
    assert grants == {("my-proj-ms-exp", "roles/storage.objectViewer", member),
                      ("my-proj-ms-exp", "roles/storage.objectUser", member),
                      ("corpora", "roles/storage.objectViewer", member),
                      ("team-eval", "roles/storage.objectViewer", member)}


def test_deployer_gets_act_as_on_the_vms_account_alone_before_the_queued_resource(project_root):
    mocks, _ = run_program(base_config(), project_root)
    assert mocks.of_type(SA_IAM) == []  # nobody is granted anything unless asked
    deployer = "serviceAccount:deploy@my-proj.iam.gserviceaccount.com"
    mocks, _ = run_program(base_config(deployer=deployer), project_root)
    grant = mocks.one(SA_IAM)
    grant.expect("serviceAccountId",
                 "projects/my-proj/serviceAccounts/ms-exp-tpu@my-proj.iam.gserviceaccount.com")
    grant.expect("role", "roles/iam.serviceAccountUser")
    grant.expect("member", deployer)
    assert mocks.objects[grant.name] in (mocks.options["ms-exp-tpu"].depends_on or [])


@pytest.mark.parametrize("member", ["deploy@my-proj.iam.gserviceaccount.com", "user:alice",
                                    "domain:example.com"])
def test_a_deployer_that_is_not_an_iam_member_is_refused_at_preview(member, project_root):
    with pytest.raises(StackConfigError, match="deployer"):
        run_program(base_config(deployer=member), project_root)


WRITE_ROLES = {"roles/storage.objectUser", "roles/storage.objectCreator",
               "roles/storage.objectAdmin", "roles/storage.admin", "roles/storage.legacyBucketWriter"}


@pytest.mark.parametrize("changes", [{}, {"run_name": "second", "trainer": {
    "overrides": {"data.path": "gs://my-proj-ms-exp/corpus/c4"}}}])
def test_the_hosts_write_only_their_run_boot_logs_and_data_never_the_spec_code_or_envs(
        project_root, changes):
    """No unconditional object write on the bucket: the trainer's account reads it all and writes
    under the run directory, the boot logs and a data set it prepares there, through an IAM
    Condition on the object name; the launch spec, code/ and envs/ are the deployer's."""
    import celpy

    mocks, _ = run_program(base_config(**changes), project_root)
    writes = [g for g in mocks.of_type(BUCKET_IAM) if g.inputs["role"] in WRITE_ROLES]
    assert len(writes) == 1 and writes[0].inputs["bucket"] == "my-proj-ms-exp"
    condition = writes[0].inputs.get("condition")
    assert condition and condition["title"] == "multislice-host-writes", condition
    program = celpy.Environment().program(celpy.Environment().compile(condition["expression"]))

    def writable(name: str) -> bool:
        activation = {"resource": celpy.json_to_cel(
            {"name": f"projects/_/buckets/my-proj-ms-exp/objects/{name}"})}
        return bool(program.evaluate(activation))

    run = "runs/exp-second" if changes.get("run_name") else "runs/exp"
    assert writable(f"{run}/checkpoints/100/state") and writable(f"{run}/logs/ms-exp-0.log")
    assert writable("launch/exp.boot/ms-exp-0.startup.log")
    assert writable("corpus/c4/train-0.arrayrecord") == ("trainer" in changes)
    for theirs in ["launch/exp.json", "code/" + "0" * 64 + ".tar.gz", "envs/KEY.tar.gz",
                   "envs/KEY.tar.gz.sha256", "runs/exp-other/checkpoints/1", "runs/ex/x",
                   "launch/exp.boot.json", "launch/other.boot/x.log"]:
        assert not writable(theirs), theirs
    others = [g for g in mocks.of_type(BUCKET_IAM) if g.inputs["role"] not in WRITE_ROLES]
    assert all(not g.inputs.get("condition") for g in others)
