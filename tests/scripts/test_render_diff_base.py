"""`multislice render STACK --diff-base REF`: the base rendered from a git ref by its own code, and
a diff whose body agrees with its verdict (archive files named, no alarm on what is kept)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from scripts import render
from scripts.cli import main as cli
from scripts.new import render_template
from scripts.render import base_manifest
from scripts.render_base import BaseRefError

ROOT = render.ROOT
PROJECT_PARTS = ("__main__.py", "Pulumi.yaml", "pyproject.toml", "infra", "scripts", "template")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-C",
                           str(repo), *args], check=True, capture_output=True, text=True).stdout


def trainer(steps: int) -> dict:
    return {"config": "tiny", "steps": steps, "mesh": {"ici_fsdp": 16, "dcn_data": -1},
            "overrides": {"train.global_batch_size": 64}}


def write_stack(repo: Path, **overrides) -> Path:
    config = {"project": "my-proj", "region": "us-central2", "zone": "us-central2-b",
              "accelerator_type": "v5litepod-16", "slices": 2, "capacity": "spot",
              "experiment_dir": "experiments/demo",
              "trainer": trainer(100)}
    config.update(overrides)
    path = repo / "stacks" / "Pulumi.dev.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"config": {f"multislice:{k}": v for k, v in config.items()}}))
    return path


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A copy of the toolkit in its own git repository, with one commit that has a stack config
    naming experiments/demo, which (like the example stacks) is not committed."""
    repo = tmp_path / "repo"
    repo.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for part in PROJECT_PARTS:
        source = ROOT / part
        if source.is_dir():
            shutil.copytree(source, repo / part, ignore=ignore)
        else:
            shutil.copy(source, repo / part)
    (repo / ".gitignore").write_text(".multislice/\nexperiments/\n")
    write_stack(repo)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "base")
    render_template("demo", repo / "experiments")
    return repo


def render_cli(repo: Path, *args: str) -> list[str]:
    """`multislice render` as a user runs it in that checkout (its code, from its root)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PULUMI_")}
    env["PYTHONPATH"] = str(repo)
    result = subprocess.run([sys.executable, "-m", "scripts.cli", "render", *args], cwd=repo,
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.splitlines()


@pytest.mark.slow  # three renders in subprocesses (head, base, and the base's `new`)
def test_diff_base_renders_the_ref_and_names_the_changed_files_of_the_archive(repo):
    write_stack(repo, trainer=trainer(500))
    model = repo / "experiments" / "demo" / "trainer" / "model" / "transformer.py"
    model.write_text(model.read_text() + "\n# a change of the model\n")
    (repo / "experiments" / "demo" / "trainer" / "extra.py").write_text("X = 1\n")

    lines = render_cli(repo, "stacks/Pulumi.dev.yaml", "--diff-base", "main")

    assert lines[0].startswith("base: main at ") and "rendered by its own code" in lines[0]
    assert lines[1] == ("base: experiments/demo is not committed at main: rendered from main's "
                        "template (`multislice new demo`), as CI does")
    archive = [line for line in lines if "/code/" in line and line.startswith("~ ")]
    assert len(archive) == 1 and archive[0].endswith(
        "(new object, old one deleted: the code archive is named by its content)"), lines
    start = lines.index(archive[0])
    assert lines[start + 1].startswith("~   files: 1 changed, 1 added, 0 removed (of "), lines
    assert lines[start + 2:start + 4] == ["~     trainer/model/transformer.py", "+     trainer/extra.py"]
    assert "+   inputs.source.string_asset(json).trainer.steps: 500" in lines
    # The body agrees with the verdict: nothing is REPLACED, no component "(changed)", and no
    # dependency line that only renames the archive.
    assert not [line for line in lines if "REPLACED" in line or line.endswith("(changed)")
                and "stack outputs" not in line], lines
    assert not [line for line in lines if line.startswith(("-   depends_on", "+   depends_on"))]
    assert lines[-2] == ("0 added, 0 removed, 0 replaced, 2 objects rewritten, 0 updated in "
                         "place, outputs changed")
    assert lines[-1] == ("verdict: keeps the queued resource; the VMs restart their trainers on "
                         "the new launch spec (saved at a step boundary, resumed from it)")
    assert git(repo, "status", "--porcelain") == " M stacks/Pulumi.dev.yaml\n"  # untouched
    assert git(repo, "worktree", "list").count("\n") == 1


@pytest.mark.slow  # two renders in subprocesses
def test_diff_base_uses_the_refs_own_boot_files_and_names_them_in_the_verdict(repo):
    """A toolkit upgrade that changes infra/boot/ replaces the queued resource (node metadata cannot
    change in place): the base, rendered by its own code, shows it, and the verdict says why."""
    startup = repo / "infra" / "boot" / "startup.sh"
    startup.write_text(startup.read_text() + "# a fix in a newer toolkit\n")

    lines = render_cli(repo, "stacks/Pulumi.dev.yaml", "--diff-base", "main")

    assert "+     # a fix in a newer toolkit" in lines, lines
    assert lines[-1] == ("verdict: REPLACES the queued resource (metadata changed: the toolkit's "
                         "boot files (infra/boot/startup.sh, launch.py)): the job gives up its "
                         "capacity and queues again")


@pytest.mark.slow  # two renders in subprocesses
def test_diff_base_of_a_code_change_on_a_workload_stack_keeps_its_jobset_and_its_place(repo):
    """A day-two code change on shared capacity: only the code archive and the launch spec
    object change; the JobSet (its Workload, its admission) is not replaced."""
    workload = {"orchestration": "gke", "region": "us-central1", "zone": "us-central1-a",
                "gke": {"kind": "workload", "namespace": "team-a", "local_queue": "v5e16",
                        "cluster": "projects/platform/locations/us-central1/clusters/shared"}}
    path = write_stack(repo, **workload)
    raw = yaml.safe_load(path.read_text())
    del raw["config"]["multislice:capacity"]  # the admin's pools decide it
    path.write_text(yaml.safe_dump(raw))
    git(repo, "commit", "-q", "-am", "a workload stack")
    model = repo / "experiments" / "demo" / "trainer" / "model" / "transformer.py"
    model.write_text(model.read_text() + "\n# day two\n")

    lines = render_cli(repo, "stacks/Pulumi.dev.yaml", "--diff-base", "main")

    changed = [line for line in lines if line.startswith(("~ ", "+ ", "- "))]
    assert not [line for line in changed if "JobSet" in line], lines
    assert [line for line in changed if "/launch/" in line], lines
    assert lines[-1] == render.GKE_WORKLOAD_KEEPS_WITH_NEW_SPEC, lines


def test_diff_base_of_a_stack_the_ref_lacks_shows_it_new(repo):
    other = repo / "stacks" / "Pulumi.prod.yaml"
    shutil.copy(repo / "stacks" / "Pulumi.dev.yaml", other)
    base, notes = base_manifest("main", other, root=repo)
    assert base["resources"] == []
    assert notes[-1] == ("base: stacks/Pulumi.prod.yaml is not in main: a new stack config, "
                         "everything in it is added")


@pytest.mark.parametrize("ref", ["no-such-branch", "main~5", "0" * 40])
def test_diff_base_of_a_ref_that_is_not_a_commit_is_one_line(repo, ref):
    with pytest.raises(BaseRefError) as caught:
        base_manifest(ref, repo / "stacks" / "Pulumi.dev.yaml", root=repo)
    assert str(caught.value) == (f"--diff-base {ref!r}: not a commit of the repository at "
                                 f"{repo.resolve()}; give a branch (main, origin/main), a tag or "
                                 "a commit sha")


def test_diff_base_outside_a_git_repository_is_one_line(tmp_path):
    with pytest.raises(BaseRefError, match="is not in a git repository"):
        base_manifest("main", tmp_path / "Pulumi.dev.yaml", root=tmp_path)


def test_diff_base_and_diff_cannot_be_given_together(tmp_path, capsys):
    with pytest.raises(SystemExit) as caught:
        cli(["render", str(tmp_path / "Pulumi.dev.yaml"), "--diff", "x.yaml",
             "--diff-base", "main"])
    assert caught.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
