"""multislice:egress: none: no NAT, the environment published before the boot, and preview's
check of it (the GCS emulator for the bucket)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.packaging.env_build import sha256_text
from infra.packaging.lock import LOCK_FILE
from infra.preview.env_check import EnvCheckProvider, env_key
from infra.stack_config.schema import StackConfig
from infra.stack_config.validation import stack_problems
from scripts.emulators.gcs_emulator import GcsEmulator
from tests.infra.conftest import base_config
from tests.infra.pulumi_mocks import run_program

ROUTER = "gcp:compute/router:Router"
NAT = "gcp:compute/routerNat:RouterNat"
SUBNET = "gcp:compute/subnetwork:Subnetwork"
SPEC = "gcp:storage/bucketObject:BucketObject"
LAUNCH_PY = Path(__file__).resolve().parents[2] / "infra" / "boot" / "launch.py"


def _spec(mocks) -> dict:
    (obj,) = [r for r in mocks.of_type(SPEC) if r.inputs.get("name", "").startswith("launch/")]
    return json.loads(obj.inputs["source"].text)


def test_an_egress_none_stack_has_no_nat_and_reaches_google_privately(project_root):
    mocks, _ = run_program(base_config(egress="none"), project_root)
    assert not mocks.of_type(ROUTER) and not mocks.of_type(NAT)
    assert mocks.one(SUBNET).inputs["privateIpGoogleAccess"] is True
    assert _spec(mocks)["egress"] == "none"
    (check,) = [r for r in mocks.of_type("pulumi-python:dynamic:Resource")
                if r.name.endswith("-env-check")]
    key = env_key(project_root / "experiments" / "demo" / LOCK_FILE)
    assert check.inputs["key"] == key and key.endswith("-x86_64")
    assert check.inputs["stack_file"] == "stacks/Pulumi.exp.yaml"


def test_the_default_keeps_its_nat_and_its_spec_byte_for_byte(project_root):
    mocks, _ = run_program(base_config(), project_root)
    assert mocks.of_type(ROUTER) and mocks.of_type(NAT)
    assert "egress" not in _spec(mocks)  # no new field: running hosts are not restarted
    # the deployer's environment is pinned once published (none here: the hosts build their own)
    (check,) = [r for r in mocks.resources if r.name.endswith("-env-check")]
    assert check.inputs["hosts_build"] is True and "env_sha256" not in _spec(mocks)


def test_an_external_ip_with_egress_none_is_refused():
    cfg = StackConfig.model_validate({"stack": "exp", **base_config(egress="none",
                                                                    external_ips=True)})
    assert any(p.startswith("external_ips: true with egress 'none'")
               for p in stack_problems(cfg)[0])


def test_the_launcher_reads_egress_with_its_default_and_refuses_another(tmp_path):
    spec = {"version": 3, "stack": "s", "trainer": {}, "archive_sha256": "a" * 64,
            "archive_uri": f"gs://b/code/{'a' * 64}.tar.gz", "run_dir": "gs://b/runs/s",
            "logs_uri": "gs://b/runs/s/logs", "python_version": "3.11", "mesh": {},
            "expect_slices": 1, "expect_devices_per_slice": 4, "envs_uri": "gs://b/envs",
            "lock_file": LOCK_FILE, "init_timeout_s": 1, "max_restarts": 0, "run_as": "root",
            "storage_retry_s": 0, "spec_poll_s": 5}

    def get(**changes) -> subprocess.CompletedProcess[str]:
        path = tmp_path / "spec.json"
        path.write_text(json.dumps({**spec, **changes}))
        return subprocess.run([sys.executable, str(LAUNCH_PY), "get", str(path), "egress"],
                              capture_output=True, text=True)

    assert get().stdout == "nat" and get(egress="none").stdout == "none"
    refused = get(egress="open")
    assert refused.returncode != 0 and "egress 'open' is not one of nat, none" in refused.stderr


@pytest.fixture(scope="module")
def gcs() -> Iterator[GcsEmulator]:
    with GcsEmulator() as gcs, pytest.MonkeyPatch.context() as patch:
        patch.setenv("STORAGE_EMULATOR_HOST", gcs.url)
        yield gcs


def crc32c_of(data: bytes) -> str:
    import base64

    import google_crc32c

    return base64.b64encode(google_crc32c.Checksum(data).digest()).decode()


def test_preview_refuses_a_bucket_without_the_environment_and_passes_a_new_bucket(gcs,
                                                                                  monkeypatch):
    props = {"project": "my-proj", "bucket": "my-proj-ms-off", "key": "k-cpython3.11.7-x86_64",
             "stack_file": "stacks/Pulumi.off.yaml"}
    import infra.packaging.env_build as env_build

    # a deployer's machine that cannot build it (here: not the hosts' machine type)
    monkeypatch.setattr(env_build.platform, "machine", lambda: "arm64")
    provider = EnvCheckProvider()
    assert provider.check({}, props).failures == []  # no bucket yet: the first pulumi up
    gcs.create_bucket("my-proj-ms-off")
    [failure] = provider.check({}, props).failures
    assert failure.reason.startswith(
        "egress: 'none', and gs://my-proj-ms-off/envs/ has no environment "
        "k-cpython3.11.7-x86_64 for the experiment's lock, which the hosts cannot build without "
        "internet, nor this machine (this machine is linux arm64; the TPU hosts are Linux x86_64")
    assert failure.reason.endswith(
        "run `multislice env-publish --stack-config stacks/Pulumi.off.yaml` on a Linux x86_64 "
        "machine that reaches the package index, then pulumi up again")
    # pulumi up on it says what it did not do
    outs = provider.create(props).outs
    assert outs["environment"].startswith(
        "not in gs://my-proj-ms-off/envs/, and this machine cannot build it") and \
        "the hosts wait for it" in outs["environment"] and outs["sha256"] == ""
    # a machine that can build it passes preview: up builds it
    monkeypatch.setattr(env_build.platform, "machine", lambda: "x86_64")
    assert provider.check({}, props).failures == []
    monkeypatch.setattr(env_build.platform, "machine", lambda: "arm64")
    gcs.put("my-proj-ms-off", "envs/k-cpython3.11.7-x86_64.tar.gz", b"not yet whole")
    assert provider.check({}, props).failures  # the .sha256 comes last: not whole yet
    digest = "d" * 64
    # A record of before this toolkit's (no crc32c line), as hosts of an older toolkit could
    # write one: an upgrade does not pin it, and the refusal says why.
    gcs.put("my-proj-ms-off", "envs/k-cpython3.11.7-x86_64.tar.gz.sha256",
            f"{digest}  k-cpython3.11.7-x86_64.tar.gz\n".encode())
    [failure] = provider.check({}, props).failures
    assert "its .sha256 record has no crc32c line: it predates this toolkit's records" in \
        failure.reason and "multislice env-publish" in failure.reason, failure.reason
    assert provider.create(props).outs["sha256"] == ""
    gcs.put("my-proj-ms-off", "envs/k-cpython3.11.7-x86_64.tar.gz.sha256",
            sha256_text("k-cpython3.11.7-x86_64", digest, crc32c_of(b"not yet whole")).encode())
    assert provider.check({}, props).failures == []
    # the archive replaced after its record, or gone: the record pins nothing
    gcs.put("my-proj-ms-off", "envs/k-cpython3.11.7-x86_64.tar.gz", b"other bytes")
    assert provider.check({}, props).failures
    gcs.put("my-proj-ms-off", "envs/k-cpython3.11.7-x86_64.tar.gz", b"not yet whole")
    assert provider.check({}, props).failures == []
    outs = provider.create(props).outs
    assert outs["sha256"] == digest and outs["environment"] == (
        f"gs://my-proj-ms-off/envs/k-cpython3.11.7-x86_64.tar.gz: published, sha256 {digest} "
        "(pinned in the launch spec)")
    # unchanged: no diff (a preview shows the spec as it is); republished: a change
    assert not provider.diff("id", outs, {**props, "environment": None, "sha256": None}).changes
    gcs.put("my-proj-ms-off", "envs/k-cpython3.11.7-x86_64.tar.gz.sha256",
            f"{'e' * 64}  k-cpython3.11.7-x86_64.tar.gz\n".encode())
    assert provider.diff("id", outs, {**props, "environment": None, "sha256": None}).changes


def test_a_workload_stack_on_shared_capacity_never_builds_and_preview_says_so(
        gcs, monkeypatch, project_root):
    from tests.infra.test_gke_kinds import workload_config

    mocks, _ = run_program(workload_config(), project_root)
    (check,) = [r for r in mocks.resources if r.name.endswith("-env-check")]
    assert check.inputs["hosts_build"] is False
    import infra.packaging.env_build as env_build

    monkeypatch.setattr(env_build.platform, "machine", lambda: "arm64")
    props = {key: check.inputs[key] for key in ("project", "key", "stack_file",
                                                 "hosts_build", "hosts_cannot_build")}
    props["bucket"] = "my-proj-ms-shared"
    gcs.create_bucket("my-proj-ms-shared")
    [failure] = EnvCheckProvider().check({}, props).failures
    assert failure.reason.startswith(
        "gke.kind: 'workload', and gs://my-proj-ms-shared/envs/ has no environment "
        f"{props['key']} for the experiment's lock, which the hosts cannot build on shared "
        "capacity (its pods install only a published environment), nor this machine"), \
        failure.reason
    assert "run `multislice env-publish --stack-config stacks/Pulumi.exp.yaml`" in failure.reason


def test_env_publish_refuses_what_cannot_build_a_hosts_environment(tmp_path, capsys,
                                                                   monkeypatch):
    from scripts.cli import main as cli

    (tmp_path / "Pulumi.yaml").write_text("name: multislice\nruntime: python\n")
    stack = tmp_path / "Pulumi.off.yaml"
    stack.write_text("config:\n  multislice:project: my-proj\n  multislice:region: us-central2\n"
                     "  multislice:zone: us-central2-b\n  multislice:accelerator_type: v4-8\n"
                     "  multislice:experiment_dir: experiments/missing\n")
    assert cli(["env-publish", "--stack-config", str(stack)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "experiments/missing/requirements-tpu.lock: no lock" in line
    import infra.packaging.env_build as env_build

    monkeypatch.setattr(env_build.platform, "machine", lambda: "arm64")
    assert "the TPU hosts are Linux x86_64" in env_build.machine_problem()


def test_an_organisations_index_reaches_the_hosts_without_a_credential_in_the_spec(project_root):
    index = "https://us-python.pkg.dev/my-proj/pypi-mirror/simple/"
    mirror = "https://artifacts.example.com/python-build-standalone"
    mocks, _ = run_program(base_config(egress="none", package_index={
        "url": index, "python_mirror": mirror}), project_root)
    spec = _spec(mocks)
    assert (spec["package_index"], spec["python_mirror"]) == (index, mirror)
    # the hosts build from it: no environment is required before the boot
    (check,) = [r for r in mocks.resources if r.name.endswith("-env-check")]
    assert check.inputs["hosts_build"] is True


@pytest.mark.parametrize("package_index, says", [
    ({"url": "https://user:secret@pypi.example.com/simple/"}, "package_index.url: value"),
    ({"url": "https://us-python.pkg.dev/p/r/simple/"},
     "with egress 'none' a host building the environment would download CPython from GitHub"),
], ids=["credentials in the url", "no python mirror"])
def test_an_index_with_a_secret_or_without_the_interpreter_is_refused(package_index, says):
    from infra.stack_config.schema import StackConfigError, parse_stack

    try:
        cfg = parse_stack(base_config(egress="none", package_index=package_index), "exp")
    except StackConfigError as exc:
        problems = exc.problems
    else:
        problems = stack_problems(cfg)[0]
    assert any(says in p for p in problems), problems
