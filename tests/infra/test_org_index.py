"""The organisation's package index on the deployer's side: `multislice env-publish` and the
build in `pulumi up` ask the stack's index (and CPython mirror) with the deployer's own token, as
the hosts ask it with theirs, and a failure says what could not be reached, never the token."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.packaging.env_build import Index, build
from infra.preview.env_check import stack_index
from infra.stack_config.schema import StackConfig
from infra.stack_config.validation import stack_problems
from scripts.emulators.package_index import PackageIndex
from tests.infra.conftest import base_config
from tests.infra.pulumi_mocks import run_program

TOKEN = "ya29.deployer-secret-token"
KEY = "0" * 64 + "-cpython3.11.7-x86_64"


def lock(tmp_path: Path) -> Path:
    path = tmp_path / "requirements-tpu.lock"
    path.write_text("# multislice lock: python 3.11.7\nnumpy==2.0.0 --hash=sha256:" + "0" * 64
                    + "\n")
    return path


@pytest.fixture
def index(tmp_path) -> PackageIndex:
    (tmp_path / "wheels").mkdir()
    with PackageIndex(tmp_path / "wheels", token=TOKEN) as served:
        yield served


def failed_build(tmp_path: Path, index: Index) -> str:
    with pytest.raises(RuntimeError) as caught:
        build(lock(tmp_path), KEY, "3.11.7", None, tmp_path / "build.log", index=index)
    return str(caught.value)


def test_the_deployers_build_asks_the_stacks_index_with_its_token_and_says_what_failed(
        tmp_path, index):
    # the stand-in serves no uv wheel: the build asks it (authenticated), then stops there
    said = failed_build(tmp_path, Index(index.url, token=TOKEN))
    assert any(path == "/simple/uv/" and agent.startswith("pip/")
               for path, agent in index.agents), index.agents
    assert "could not pip install uv" in said and f"check that this machine reaches {index.url}" \
        in said, said
    assert "Cloud NAT" not in said and TOKEN not in said
    log = (tmp_path / "build.log").read_text()
    assert "uv" in log and TOKEN not in log
    assert said.endswith(f"(build log: {tmp_path / 'build.log'})")


def test_an_index_that_refuses_the_deployer_is_named_with_its_answer(tmp_path, index):
    index.refuse = True
    said = failed_build(tmp_path, Index(index.url, token=TOKEN))
    assert "could not pip install uv==" in said and TOKEN not in said
    assert f"{index.url} answered 403 to the credentials of your account" in said, said
    # no credentials at all: Artifact Registry's 401
    said = failed_build(tmp_path, Index(index.url, token=""))
    assert f"{index.url} answered 401" in said, said


def test_a_refusal_by_artifact_registry_names_the_role_and_the_command_that_grants_it():
    from tests.infra.test_startup_functions import run_functions, startup_functions

    script = f"""
index_answer() {{ echo 403; }}
metadata() {{ echo ms-exp-tpu@my-proj.iam.gserviceaccount.com; }}
PACKAGE_INDEX=https://us-central2-python.pkg.dev/platform/pypi/simple/
{startup_functions("reach_hint")}
reach_hint index"""
    out = run_functions(script).stdout
    assert out.startswith("https://us-central2-python.pkg.dev/platform/pypi/simple/ answered "
                          "403: the service account of the hosts needs "
                          "roles/artifactregistry.reader on the repository (`gcloud artifacts "
                          "repositories add-iam-policy-binding pypi --project=platform "
                          "--location=us-central2 --member=serviceAccount:ms-exp-tpu@my-proj.iam."
                          "gserviceaccount.com --role=roles/artifactregistry.reader`"), out


def test_artifact_registry_gets_the_deployers_own_token(monkeypatch):
    monkeypatch.setenv("GOOGLE_OAUTH_ACCESS_TOKEN", TOKEN)
    url = "https://us-central2-python.pkg.dev/platform/pypi/simple/"
    assert stack_index(url, "https://mirror.internal/python").environ() == {
        "PACKAGE_INDEX": url, "PYTHON_MIRROR": "https://mirror.internal/python",
        "INDEX_TOKEN": TOKEN}
    assert "INDEX_TOKEN" not in stack_index("https://pypi.internal/simple/", None).environ()
    assert Index().environ() == {}  # no index: this machine's own settings


AR_INDEX = {"url": "https://us-central2-python.pkg.dev/my-proj/pypi/simple/"}


def test_the_hosts_get_read_on_an_artifact_registry_index_of_their_project(project_root):
    mocks, _ = run_program(base_config(package_index=AR_INDEX), project_root)
    [grant] = mocks.of_type("gcp:artifactregistry/repositoryIamMember:RepositoryIamMember")
    assert {k: grant.inputs[k] for k in ("project", "location", "repository", "role")} == {
        "project": "my-proj", "location": "us-central2", "repository": "pypi",
        "role": "roles/artifactregistry.reader"}
    assert grant.inputs["member"] == "serviceAccount:ms-exp-tpu@my-proj.iam.gserviceaccount.com"
    # the hosts read the spec only once the grant exists
    mocks, _ = run_program(base_config(), project_root)
    assert mocks.of_type("gcp:artifactregistry/repositoryIamMember:RepositoryIamMember") == []


def test_an_index_in_another_project_is_a_warning_with_the_owners_command(project_root):
    other = {"url": "https://us-central2-python.pkg.dev/platform/pypi/simple/"}
    cfg = StackConfig.model_validate({"stack": "exp", **base_config(package_index=other)})
    [warning] = [w for w in stack_problems(cfg)[1] if w.startswith("package_index")]
    assert ("gcloud artifacts repositories add-iam-policy-binding pypi --project=platform "
            "--location=us-central2 --member=serviceAccount:ms-exp-tpu@my-proj.iam."
            "gserviceaccount.com --role=roles/artifactregistry.reader") in warning
    mocks, _ = run_program(base_config(package_index=other), project_root)
    assert mocks.of_type("gcp:artifactregistry/repositoryIamMember:RepositoryIamMember") == []
