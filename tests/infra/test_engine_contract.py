"""The project as the Pulumi CLI launches it: program directory, virtualenv, dynamic provider.

No CLI here: tests/support/pulumi_engine.py holds the launch rules read from the CLI's source,
and these tests start the real processes by them (working directory, environment, interpreter).
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest

from scripts.emulators.tpu_emulator import TpuEmulator
from tests.infra.conftest import KEEPS, REPLACES, base_config
from tests.support.pulumi_engine import EngineContractError, Project

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "python").is_file(),
                                reason="needs the project's .venv (make test bootstraps it)")


def test_language_host_and_dynamic_provider_resolve_the_same_virtualenv():
    project = Project.load(ROOT)
    env = project.provider_environment()
    assert project.dynamic_provider_python(env).parent.parent == project.language_host_virtualenv()


def test_a_main_subdirectory_would_break_the_provider_launch(tmp_path):
    """The layout this replaces (main: infra/ with virtualenv .venv), pulumi/pulumi#7061."""
    (tmp_path / "infra").mkdir()
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").write_text("")
    (tmp_path / "Pulumi.yaml").write_text(
        "name: x\nmain: infra/\nruntime:\n  name: python\n  options:\n    virtualenv: .venv\n")
    project = Project.load(tmp_path)
    assert project.language_host_virtualenv() == tmp_path / ".venv"
    with pytest.raises(EngineContractError, match="infra/.venv"):
        project.dynamic_provider_python(project.provider_environment())


def _struct(props: dict):
    from google.protobuf import json_format, struct_pb2

    return json_format.ParseDict(props, struct_pb2.Struct())


@pytest.mark.slow
def test_dynamic_provider_started_like_the_engine_checks_and_creates_through_the_emulator():
    """Unpickle the provider in a fresh interpreter in the engine's working directory, then
    check, create and delete a queued resource through the real TPU client and the emulator."""
    import grpc
    from pulumi.dynamic.dynamic import serialize_provider
    from pulumi.runtime.proto import provider_pb2, provider_pb2_grpc

    from infra.stack_config.manifest import queued_resource_spec
    from infra.stack_config.schema import parse_stack
    from infra.tpu_vm.provider import QueuedResourceProvider

    spec = queued_resource_spec(parse_stack(base_config(), "exp"))
    spec.update(wait_for_active_s=30, poll_interval_s=0.05, delete_timeout_s=30)
    props = {**spec, "__provider": serialize_provider(QueuedResourceProvider(
        retry_deadline_s=20, retry_initial_s=0.05))}
    urn = "urn:pulumi:exp::multislice::pulumi-python:dynamic:Resource::ms-exp-qr"
    project = Project.load(ROOT)
    with TpuEmulator(delete_polls=0) as emu:
        proc, port = project.start_dynamic_provider({"MULTISLICE_TPU_API_ENDPOINT": emu.url})
        try:
            stub = provider_pb2_grpc.ResourceProviderStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
            checked = stub.Check(provider_pb2.CheckRequest(urn=urn, olds=_struct({}),
                                                           news=_struct(props)), timeout=60)
            assert list(checked.failures) == []
            created = stub.Create(provider_pb2.CreateRequest(urn=urn, properties=checked.inputs),
                                  timeout=60)
            assert created.id.endswith("/queuedResources/ms-exp-qr")
            assert emu.state_of("ms-exp-qr") == "ACTIVE"
            stub.Delete(provider_pb2.DeleteRequest(id=created.id, urn=urn,
                                                   properties=created.properties), timeout=60)
            assert emu.state_of("ms-exp-qr") is None
        finally:
            proc.kill()
            proc.wait()


def _qr_spec(**changes):
    from infra.stack_config.manifest import queued_resource_spec
    from infra.stack_config.schema import parse_stack

    return queued_resource_spec(parse_stack(base_config(**changes), "exp"))


@pytest.mark.slow
def test_the_engine_launched_provider_diffs_day_two_changes_in_place_and_names_replacements():
    """Diff as the engine calls it (gRPC, a fresh provider process): code and trainer changes
    never replace the queued resource; shape and software changes do, naming the field."""
    import grpc
    from pulumi.dynamic.dynamic import serialize_provider
    from pulumi.runtime.proto import provider_pb2, provider_pb2_grpc

    from infra.tpu_vm.provider import QueuedResourceProvider

    provider = serialize_provider(QueuedResourceProvider())
    urn = "urn:pulumi:exp::multislice::pulumi-python:dynamic:Resource::ms-exp-qr"
    old = {**_qr_spec(), "__provider": provider}
    project = Project.load(ROOT)
    proc, port = project.start_dynamic_provider({})
    try:
        stub = provider_pb2_grpc.ResourceProviderStub(grpc.insecure_channel(f"127.0.0.1:{port}"))

        def diff(changes: dict) -> provider_pb2.DiffResponse:
            new = {**_qr_spec(**changes), "__provider": provider}
            return stub.Diff(provider_pb2.DiffRequest(id="qr", urn=urn, olds=_struct(old),
                                                      news=_struct(new)), timeout=60)

        for what, changes in KEEPS.items():
            assert list(diff(changes).replaces) == [], what
        for what, (changes, field) in REPLACES.items():
            assert field in list(diff(changes).replaces), what
    finally:
        proc.kill()
        proc.wait()


def test_program_run_from_its_directory_reads_the_engine_config(project_root):
    """The language host's steps: cwd = program directory, config in PULUMI_CONFIG, run the
    directory's __main__.py. A misspelled key must fail there, naming it."""
    project = Project.load(ROOT)
    raw = base_config(experiment_dir=str(project_root / "experiments" / "demo"))
    config = {f"multislice:{k}": v if isinstance(v, str) else json.dumps(v) for k, v in raw.items()}
    config["multislice:slcies"] = "4"
    driver = textwrap.dedent("""
        import runpy, sys
        import pulumi
        from pulumi.runtime import config as c
        c.set_all_config(c.get_config_env(), c.get_config_secret_keys_env())
        class Mocks(pulumi.runtime.Mocks):
            def new_resource(self, args):
                return args.name + "-id", dict(args.inputs)
            def call(self, args):
                return {}
        pulumi.runtime.set_mocks(Mocks(), project="multislice", stack="exp", preview=True)
        @pulumi.runtime.test
        def run():
            runpy.run_path(".", run_name="__main__")
        try:
            run()
        except pulumi.RunError as exc:
            print(exc, file=sys.stderr)
            raise SystemExit(7)
        """)
    python = project.language_host_virtualenv() / "bin" / "python"
    done = subprocess.run([str(python), "-c", driver], cwd=project.program_directory,
                          env=project.program_environment(config), capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 7, done.stderr[-2000:]
    assert "multislice:slcies: unknown key (did you mean 'slices'?)" in done.stderr
    assert "Traceback" not in done.stderr
