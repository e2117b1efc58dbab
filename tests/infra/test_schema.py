import re
from pathlib import Path

import pytest
import yaml

from infra.stack_config.schema import StackConfigError, parse_stack
from infra.stack_config.validation import load_stack_file, validate_stack
from infra.tpu_vm.checks import queueing_window_to_api
from tests.infra.conftest import base_config, make_full_experiment
from tests.support.examples import EXAMPLE_STACK_NAMES


def _validate(raw, root: Path):
    cfg = parse_stack(raw, "exp1")
    return cfg, validate_stack(cfg, base_dir=root)


def test_valid_config_derives_run_dir_from_stack_not_time(project_root):
    cfg, warnings = _validate(base_config(), project_root)
    assert settled(warnings) == []
    assert cfg.names.run_dir == "gs://my-proj-ms-exp1/runs/exp1"
    assert list(cfg.names.node_ids) == ["ms-exp1-0", "ms-exp1-1"]
    assert cfg.resolved_mesh() == {
        "ici_data": 1,
        "ici_fsdp": 4,
        "ici_tensor": 1,
        "dcn_data": 2,
        "dcn_fsdp": 1,
        "dcn_tensor": 1,
        "ici_pipeline": 1,
        "dcn_pipeline": 1,
    }


def test_a_pipeline_over_dcn_passes_preview_and_reaches_the_trainer(project_root):
    from infra.boot.launch import trainer_argv
    from infra.stack_config.manifest import launch_spec

    cfg, warnings = _validate(base_config(trainer={
        "config": "tiny", "steps": 20, "mesh": {"dcn_pipeline": 2, "dcn_data": 1},
        "overrides": {"train.pipeline_microbatches": 4}}), project_root)
    assert settled(warnings) == []
    assert cfg.resolved_mesh()["dcn_pipeline"] == 2
    argv = trainer_argv(launch_spec(cfg, "0" * 64))
    assert "mesh.dcn_pipeline=2" in argv and "mesh.ici_pipeline=1" not in argv
    assert "train.pipeline_microbatches=4" in argv


SINGLE_HOST_NOTE = "is a single-host slice; whether the TPU API accepts a multislice"


def settled(warnings: list[str]) -> list[str]:
    """The warnings besides the note on a multislice of single-host slices (the base config's
    2 x v4-8 is one), which test_a_multislice_of_single_host_slices_names_the_uncertainty
    checks."""
    return [w for w in warnings if SINGLE_HOST_NOTE not in w]


def test_a_multislice_of_single_host_slices_names_the_uncertainty(project_root):
    _, warnings = _validate(base_config(accelerator_type="v4-8", slices=2), project_root)
    [note] = [w for w in warnings if SINGLE_HOST_NOTE in w]
    assert note.startswith("accelerator_type: v4-8 is a single-host slice") and "GKE" in note
    _, warnings = _validate(base_config(accelerator_type="v4-8", slices=1,
                                        trainer={"config": "tiny", "steps": 20,
                                                 "mesh": {"dcn_data": 1}}), project_root)
    assert not [w for w in warnings if SINGLE_HOST_NOTE in w]  # one slice: no multislice
    _, warnings = _validate(base_config(accelerator_type="v4-16", slices=2,
                                        trainer={"config": "tiny", "steps": 20,
                                                 "mesh": {"ici_fsdp": 8}}), project_root)
    assert not [w for w in warnings if SINGLE_HOST_NOTE in w]  # 2 hosts a slice


def test_dcn_tensor_above_one_warns_but_passes(project_root):
    mesh = {"dcn_data": 1, "dcn_tensor": 2}
    _, warnings = _validate(base_config(trainer={"mesh": mesh}), project_root)
    warnings = settled(warnings)
    assert len(warnings) == 1 and "dcn_tensor" in warnings[0] and "2" in warnings[0]


BAD_CONFIGS = [
    ("pre-v4", {"accelerator_type": "v3-8"}, "needs v4 or later"),
    ("unknown family", {"accelerator_type": "x1-8"}, "unknown TPU family 'x1'"),
    ("bad size", {"accelerator_type": "v5litepod-12"}, "has no slice of size 12"),
    ("zero slices", {"slices": 0}, "slices: value 0 is out of range; allowed 1..256"),
    ("too many slices", {"slices": 257}, "slices: value 257 is out of range"),
    (
        "ici product",
        {"trainer": {"mesh": {"ici_fsdp": 2}}},
        "product is 2 but must equal devices per slice of v4-8 (4)",
    ),
    (
        "dcn product",
        {"trainer": {"mesh": {"dcn_data": 3}}},
        "product is 3 but must equal the slice count (2)",
    ),
    (
        "two fills",
        {"trainer": {"mesh": {"ici_data": -1, "ici_fsdp": -1}}},
        "has 2 axes set to -1; at most one per group",
    ),
    (
        "fill not divisible",
        {"trainer": {"mesh": {"ici_tensor": 3}}},
        "fixed axes (3) does not divide devices per slice of v4-8 (4)",
    ),
    (
        "negative axis",
        {"trainer": {"mesh": {"ici_data": -2}}},
        "trainer.mesh.ici_data: value -2 is not allowed",
    ),
    (
        "spot with reservation",
        {"capacity": "spot", "reservation_name": "r1"},
        "capacity: 'spot' and reservation_name 'r1' are exclusive",
    ),
    (
        "reservation without reserved",
        {"reservation_name": "r1"},
        "a reservation needs capacity 'reserved'",
    ),
    ("unknown capacity", {"capacity": "preemptible"}, "capacity: value 'preemptible'"),
    (
        "zone outside region",
        {"zone": "europe-west4-a"},
        "zone: 'europe-west4-a' is not in region 'us-central2'",
    ),
    (
        "cidr garbage",
        {"subnet_cidr": "10.0.0.300/20"},
        "subnet_cidr: '10.0.0.300/20' does not parse",
    ),
    ("cidr public", {"subnet_cidr": "8.8.0.0/16"}, "must be a private IPv4 range"),
    (
        "missing experiment",
        {"experiment_dir": "experiments/nope"},
        "experiment_dir: '",
    ),
    (
        "not template shaped",
        {"experiment_dir": "."},
        "missing pyproject.toml, configs, trainer/main.py",
    ),
    ("bad label", {"labels": {"Team": "x"}}, "labels: Team='x' is not a valid GCP label"),
    ("bad tag", {"tags": ["Bad_Tag"]}, "tags: 'Bad_Tag' is not a valid network tag"),
    ("bad window", {"valid_until": "tomorrow"}, "valid_until: 'tomorrow' is neither a duration"),
    ("bad python", {"python_version": "2.7"}, "python_version: '2.7' is not allowed"),
    ("unknown key", {"acelerator_type": "v4-8"}, "acelerator_type: unknown key"),
    ("missing zone", {"zone": None}, "zone: required but not set"),
    (
        "mesh via overrides",
        {"trainer": {"overrides": {"mesh.ici_fsdp": 4}}},
        "trainer.overrides: 'mesh.ici_fsdp' is not allowed",
    ),
    (
        "a credential's name in the overrides",
        {"trainer": {"overrides": {"hf.token": "x"}}},
        "trainer.overrides: 'hf.token' looks like a credential (its name says it holds one); "
        "overrides are written to the launch spec in the bucket",
    ),
    (
        "a credential's value in the overrides",
        {"trainer": {"overrides": {"init.from": "hf_" + "a1B2" * 8}}},
        "trainer.overrides: 'init.from' looks like a credential (its value has a credential's "
        "shape)",
    ),
    ("steps zero", {"trainer": {"steps": 0}}, "trainer.steps: value 0 is not allowed"),
    (
        "reservation name format",
        {"capacity": "reserved", "reservation_name": "My Reservation"},
        "reservation_name: 'My Reservation' is neither a reservation id",
    ),
    (
        "reservation in another zone",
        {"capacity": "reserved",
         "reservation_name": "projects/my-proj/locations/us-central1-a/reservations/r1"},
        "is in zone 'us-central1-a' but the slices are in 'us-central2-b'",
    ),
    ("project format", {"project": "My_Project"}, "project: 'My_Project' is not a Google Cloud"),
    ("region format", {"region": "uscentral", "zone": "uscentral-b"}, "region: 'uscentral' is not"),
    ("zone format", {"zone": "us-central2"}, "zone: 'us-central2' is not a zone name"),
    (
        "runtime for another generation",
        {"accelerator_type": "v5litepod-16", "runtime_version": "v2-alpha-tpuv6e",
         "zone": "us-central2-b", "slices": 1},
        "runtime_version: 'v2-alpha-tpuv6e' is the software image for TPU v6e",
    ),
    ("bucket name", {"bucket_name": "My_Bucket"}, "bucket_name: 'My_Bucket' is not a valid bucket"),
    ("bucket google", {"bucket_name": "google-runs"}, "may not start with 'goog' or contain"),
    (
        "toolkit label",
        {"labels": {"multislice-stack": "other"}},
        "overrides a label the toolkit sets itself",
    ),
    (
        "too many labels",
        {"labels": {f"k{i}": "v" for i in range(64)}},
        "make 65; a GCP resource allows at most 64",
    ),
    (
        "inverted window",
        {"valid_after": "2027-02-01T00:00:00Z", "valid_until": "2027-01-01T00:00:00Z"},
        "is not before '2027-01-01T00:00:00Z'; the interval is empty",
    ),
    ("window in the past", {"valid_until": "2020-01-01T00:00:00Z"}, "is in the past"),
    ("window without zone", {"valid_until": "2027-01-01T00:00:00"}, "has no time zone"),
    ("python too old", {"python_version": "3.10"}, "python_version: '3.10' is not allowed"),
    ("python with no VM interpreter", {"python_version": "3.99"},
     "python_version: '3.99' is not allowed; use one of 3.11, 3.12, 3.13"),
    (
        "python the experiment refuses",
        {"python_version": "3.13", "experiment_requires": ">=3.11,<3.13"},
        "cannot run demo, whose pyproject.toml requires Python >=3.11,<3.13",
    ),
    (
        "preset missing",
        {"trainer": {"config": "huge"}},
        "trainer.config: 'huge' is not a preset of demo (no huge.toml",
    ),
    (
        "override the experiment rejects",
        {"trainer": {"config": "tiny", "overrides": {"model.n_layerz": 2}}},
        "demo's config rejects these settings",
    ),
    (
        "data in a bucket the VMs cannot read",
        {"trainer": {"config": "tiny", "overrides": {"data.path": "gs://other-team/corpus"}}},
        "trainer: data.path 'gs://other-team/corpus' is in bucket 'other-team', which the TPU "
        "VMs' service account cannot read (it reads 'my-proj-ms-exp1'); add 'other-team' to "
        "multislice:data_buckets",
    ),
    (
        "weights in a bucket the VMs cannot read",
        {"trainer": {"config": "tiny", "overrides": {"train.init_from": "gs://hub/llama"}}},
        "trainer: train.init_from 'gs://hub/llama' is in bucket 'hub', which the TPU VMs'",
    ),
    ("data bucket with a path", {"data_buckets": ["gs://corpora/en"]},
     "data_buckets: 'gs://corpora/en' is not a bucket name; give the name alone"),
    ("data bucket is the stack's", {"data_buckets": ["my-proj-ms-exp1"]},
     "data_buckets: 'my-proj-ms-exp1' is the stack's own bucket"),
    ("data bucket twice", {"data_buckets": ["corpora", "corpora"]},
     "data_buckets: 'corpora' listed more than once"),
    (
        "a negative pipeline unroll",
        {"trainer": {"config": "tiny", "mesh": {"dcn_pipeline": 2, "dcn_data": 1},
                     "overrides": {"train.pipeline_unroll_layers": -1}}},
        "train.pipeline_unroll_layers = -1: must be >= 0",
    ),
    (
        "pipeline micro-batches not a multiple of the stages",
        {"trainer": {"config": "tiny", "mesh": {"dcn_pipeline": 2, "dcn_data": 1},
                     "overrides": {"train.pipeline_microbatches": 3}}},
        "train.pipeline_microbatches = 3 is not a multiple of the 2 pipeline stages",
    ),
    (
        "pipeline product",
        {"trainer": {"config": "tiny", "mesh": {"dcn_pipeline": 3}}},
        "trainer.mesh: dcn_data=-1, dcn_fsdp=1, dcn_tensor=1, dcn_pipeline=3: the product of "
        "the fixed axes (3) does not divide the slice count (2)",
    ),
    (
        "batch does not divide the mesh",
        {"trainer": {"config": "tiny", "overrides": {"train.global_batch_size": 6}}},
        "train.global_batch_size = 6 is not divisible by the 8 batch shards",
    ),
    ("seed out of range", {"trainer": {"config": "tiny", "seed": 2**32}}, "train.seed = 4294967296"),
    ("run name not a path segment", {"run_name": "Wide_1"},
     "run_name: value 'Wide_1' is not allowed: String should match pattern"),
    ("spec polled too often", {"spec_poll_s": 1},
     "spec_poll_s: value 1 is not allowed: Input should be greater than or equal to 5"),
    (
        "nested unknown key",
        {"trainer": {"config": "tiny", "mesh": {"ici_fdsp": 4}}},
        "allowed keys of trainer.mesh: dcn_data, dcn_fsdp, dcn_pipeline, dcn_tensor, ici_data, ici_fsdp",
    ),
]


@pytest.mark.parametrize(
    ("case", "override", "message"), BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS]
)
def test_bad_stack_config_fails_with_its_own_message(project_root, case, override, message):
    override = dict(override)
    stack = "exp1"
    requires = override.pop("experiment_requires", None)
    if requires:
        pyproject = project_root / "experiments" / "demo" / "pyproject.toml"
        pyproject.write_text(f'[project]\nname = "demo"\nrequires-python = "{requires}"\n')
    raw = base_config(**override)
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(StackConfigError) as err:
        validate_stack(parse_stack(raw, stack), base_dir=project_root)
    assert message in str(err.value), f"{case}: {err.value}"
    # Each bad config trips exactly its own rule, not a cascade of unrelated ones.
    assert len(err.value.problems) == 1, err.value.problems


@pytest.mark.slow  # the experiment's model is built (abstractly) in a child interpreter
@pytest.mark.parametrize(("overrides", "message"), [
    ({"model.n_layers": 3}, "model.n_layers = 3 does not split into 2 pipeline stages "
                            "(mesh.ici_pipeline * mesh.dcn_pipeline = 2); use a number of "
                            "stages that divides 3: 1, 3"),
    ({"train.pipeline_repeats": 2}, "model.n_layers = 2 does not split into 2 pipeline stages "
                                    "x train.pipeline_repeats = 2 blocks"),
], ids=["stages", "repeats"])
def test_pipeline_stages_that_do_not_split_the_layers_are_refused_by_the_model(
        tmp_path, overrides, message):
    # How a model's layers stack is the model's to say (a variant may repeat units of several
    # layers): the preview asks the experiment's own model, as the trainer does at start.
    make_full_experiment(tmp_path)
    raw = base_config(trainer={"config": "tiny", "mesh": {"dcn_pipeline": 2, "dcn_data": 1},
                               "overrides": overrides})
    with pytest.raises(StackConfigError) as err:
        validate_stack(parse_stack(raw, "exp1"), base_dir=tmp_path)
    [problem] = err.value.problems
    assert problem.startswith(f"trainer: demo's model does not fit this mesh: {message}"), problem


@pytest.mark.slow  # the experiment's model is built (abstractly) in a child interpreter
def test_an_elastic_floor_the_stack_cannot_shrink_to_fails_at_preview(tmp_path):
    # The trainer checks every size from elastic.min_slices to the job's at its start; preview
    # asks the same of the experiment, so a stack of 2 slices with a floor of 3 never queues.
    make_full_experiment(tmp_path)
    raw = base_config(trainer={"config": "tiny", "overrides": {"elastic.min_slices": 3}})
    with pytest.raises(StackConfigError) as err:
        validate_stack(parse_stack(raw, "exp1"), base_dir=tmp_path)
    [problem] = err.value.problems
    assert "elastic.min_slices = 3 but the job has 2 slices" in problem, problem


def test_bad_config_messages_are_all_distinct():
    assert len({m for _, _, m in BAD_CONFIGS}) == len(BAD_CONFIGS)


def test_queueing_window_converts_durations_and_timestamps():
    assert queueing_window_to_api("6h") == {"duration": "21600s"}
    assert queueing_window_to_api("2026-12-01T00:00:00Z") == {"time": "2026-12-01T00:00:00Z"}


def test_queueing_window_keeps_the_time_zone_of_a_timestamp():
    # 09:00 in Tokyo is midnight UTC: the offset is applied, never dropped.
    assert queueing_window_to_api("2026-12-01T09:00:00+09:00") == {"time": "2026-12-01T00:00:00Z"}
    assert queueing_window_to_api("2026-11-30T19:00:00-05:00") == {"time": "2026-12-01T00:00:00Z"}


def test_zone_not_known_to_offer_the_generation_warns(project_root):
    cfg = parse_stack(base_config(accelerator_type="v5litepod-16", slices=1,
                                  trainer={"config": "tiny", "overrides": {
                                      "train.global_batch_size": 16}}), "exp1")
    warnings = validate_stack(cfg, base_dir=project_root)
    assert any("us-central2-b' is not listed as offering TPU v5litepod" in w for w in warnings)
    assert any("us-central1-a" in w for w in warnings)  # names where it is offered


def test_stack_file_loader_reads_namespaced_keys(project_root):
    doc = {
        "config": {
            "gcp:project": "from-gcp",
            "multislice:region": "us-central2",
            "multislice:zone": "us-central2-b",
            "multislice:accelerator_type": "v5litepod-16",
            "multislice:slices": 4,
            "multislice:capacity": "spot",
            "multislice:experiment_dir": "experiments/demo",
            "multislice:trainer": {
                "config": "tiny",
                "mesh": {"ici_fsdp": 16, "dcn_data": 4},
                "overrides": {"train.global_batch_size": 64},
            },
        }
    }
    path = project_root / "Pulumi.seed.yaml"
    path.write_text(yaml.safe_dump(doc))
    cfg = load_stack_file(path)
    assert (cfg.stack, cfg.project, cfg.slices, cfg.capacity) == ("seed", "from-gcp", 4, "spot")
    assert cfg.resolved_mesh()["ici_fsdp"] == 16


def test_stack_file_loader_rejects_a_non_stack_file_name(tmp_path):
    path = tmp_path / "stack.yaml"
    path.write_text("config: {}\n")
    with pytest.raises(StackConfigError, match="not of the form Pulumi.<stack>.yaml"):
        load_stack_file(path)


@pytest.mark.parametrize("name", EXAMPLE_STACK_NAMES)
def test_example_stacks_are_valid(name):
    root = Path(__file__).resolve().parents[2]
    cfg = load_stack_file(root / "stacks" / name, check_files=False)
    assert cfg.stack == name[len("Pulumi.") : -len(".yaml")]
    assert cfg.names.run_dir.endswith(f"/runs/{cfg.stack}")


@pytest.mark.parametrize("name", EXAMPLE_STACK_NAMES)
def test_example_stacks_ask_for_a_zone_that_offers_their_accelerator(name):
    root = Path(__file__).resolve().parents[2]
    cfg = load_stack_file(root / "stacks" / name, check_files=False)
    warnings = validate_stack(cfg, base_dir=root, check_files=False)
    assert not [w for w in warnings if w.startswith("zone:")], warnings


def test_seed_example_matches_the_seed_command():
    root = Path(__file__).resolve().parents[2]
    cfg = load_stack_file(root / "stacks" / "Pulumi.seed-v5e.yaml", check_files=False)
    assert (cfg.accelerator_type, cfg.slices, cfg.capacity) == ("v5litepod-16", 4, "spot")
    assert cfg.tags == ["example-tag-1", "example-tag-2"]
    assert cfg.topology.hosts == 4


def test_relative_experiment_dir_resolves_against_the_pulumi_project_root(project_root):
    (project_root / "Pulumi.yaml").write_text("name: multislice\nruntime: python\n")
    sub = project_root / "stacks"
    sub.mkdir()
    doc = {"config": {f"multislice:{k}": v for k, v in base_config().items()}}
    (sub / "Pulumi.exp.yaml").write_text(yaml.safe_dump(doc))
    assert load_stack_file(sub / "Pulumi.exp.yaml").experiment_dir == "experiments/demo"


def test_a_gs_data_path_in_a_data_bucket_or_the_stacks_own_passes_preview(project_root):
    for data_path, buckets in (("gs://corpora/en/v1", ["corpora"]),
                               ("gs://my-proj-ms-exp1/data/en", [])):
        cfg, warnings = _validate(base_config(
            data_buckets=buckets,
            trainer={"config": "tiny", "overrides": {"data.path": data_path,
                                                     "train.init_from": data_path}}),
            project_root)
        assert settled(warnings) == [] and cfg.data_buckets == buckets


def test_pulumi_yaml_lists_every_stack_key():
    # README: Pulumi.yaml "lists every key"; the schema is what a key is.
    from infra.stack_config.schema import StackConfig

    text = (Path(__file__).resolve().parents[2] / "Pulumi.yaml").read_text()
    listed = set(re.findall(r"^#   ([a-z_]+(?:, [a-z_]+)*)\s", text, re.MULTILINE))
    keys = {key for group in listed for key in group.split(", ")}
    assert set(StackConfig.model_fields) - {"stack"} <= keys, \
        sorted(set(StackConfig.model_fields) - {"stack"} - keys)


def test_a_typo_in_a_nested_section_lists_that_sections_keys_with_a_suggestion(project_root):
    # gke is optional (Gke | None): its keys, not the top level's, are the ones to list.
    with pytest.raises(StackConfigError) as caught:
        parse_stack({**base_config(), "orchestration": "gke",
                     "gke": {"clustr": "projects/p/locations/l/clusters/c"}}, "dev")
    [problem] = caught.value.problems
    assert problem.startswith("gke.clustr: unknown key (did you mean 'cluster'?)"), problem
    assert "allowed keys of gke: authorized_networks, cluster, create_cluster," in problem
    assert "accelerator_type" not in problem


@pytest.mark.parametrize("overrides", [
    {"model.token_dropout": 0.1, "data.tokenizer": "bytes", "train.tokens": 10},
    {"checkpoint.keep_secrets_out": True, "data.path": "gs://b/corpus", "wandb.project": "x"}])
def test_overrides_that_only_resemble_a_credential_pass(overrides):
    from infra.stack_config.checks import secret_override_problems

    assert secret_override_problems(overrides) == []


# ---- least privilege, the LOW findings (issue 67): what a typed value may make the hosts do ----


@pytest.mark.parametrize("url", ["https://evil#.pkg.dev/simple/", "https://evil?.pkg.dev/s/",
                                 "https://x.pkg.dev/s/?a=1", "https://x.pkg.dev:99999/s/",
                                 "https://ev il.pkg.dev/s/", "https://x_y.pkg.dev/s/"])
def test_an_index_url_whose_parsed_host_is_not_the_one_shown_is_refused(url):
    # `https://evil#.pkg.dev/` looks like Artifact Registry (whose index gets the hosts' token)
    # and is host `evil` to every URL parser
    with pytest.raises(StackConfigError, match="package_index.url: value"):
        parse_stack(base_config(package_index={"url": url}), "s")


@pytest.mark.parametrize("raw", [
    {"package_index": {"url": "https://oauth2accesstoken:ya29.s3cret@us-python.pkg.dev/p/r/simple/"}},
    {"package_index": {"url": "https://us-python.pkg.dev/p/r/simple/",
                       "python_mirror": "https://mirror:s3cret@10.0.0.9/pbs"}},
    {"package_indx": {"url": "https://ci-bot:s3cret@pypi.example/simple/"}},
], ids=["index with a token", "mirror with a password", "misspelt key"])
def test_a_refused_url_never_repeats_its_credentials(raw):
    # A credential typed where none belongs is refused, and the refusal (a terminal, a CI log,
    # a pull request's comment) shows the URL with its user and password masked.
    with pytest.raises(StackConfigError) as refused:
        parse_stack(base_config(**raw), "s")
    message = str(refused.value)
    assert "s3cret" not in message and "://***@" in message, message
    assert len([line for line in message.splitlines() if line.startswith("  - ")]) == 1


def test_a_plain_index_and_mirror_url_are_accepted():
    cfg = parse_stack(base_config(package_index={
        "url": "https://us-python.pkg.dev/p/r/simple/",
        "python_mirror": "http://10.1.2.3:8080/python-build-standalone"}), "s")
    assert cfg.package_index is not None


@pytest.mark.parametrize("path", ["gs://my-proj-ms-s/launch", "gs://my-proj-ms-s/launch/x",
                                  "gs://my-proj-ms-s/envs/", "gs://my-proj-ms-s/code/data",
                                  "gs://my-proj-ms-s/", "gs://my-proj-ms-s"])
def test_a_data_path_at_or_above_what_only_deployers_write_is_refused(path):
    from infra.stack_config.checks import data_path_problems

    cfg = parse_stack(base_config(trainer={"config": "tiny", "steps": 2,
                                           "overrides": {"data.path": path}}), "s")
    [problem] = data_path_problems(cfg)
    assert problem.startswith(f"trainer: data.path {path!r} is at or above gs://my-proj-ms-s/")
    assert "gs://my-proj-ms-s/data/" in problem


def test_a_data_path_of_its_own_prefix_or_another_bucket_is_fine():
    from infra.stack_config.checks import data_path_problems

    for path in ("gs://my-proj-ms-s/data/c4", "gs://my-proj-ms-s/launcher-data",
                 "gs://other/launch/"):
        cfg = parse_stack(base_config(trainer={"config": "tiny", "steps": 2,
                                               "overrides": {"data.path": path}}), "s")
        assert data_path_problems(cfg) == [], path
