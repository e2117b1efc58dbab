"""The deployer's environment (`make` installs requirements.lock, exact versions with hashes) is
the one pyproject.toml asks for: a dependency added without `make lock` fails here, not on a
teammate's `pulumi up`."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
# A pinned entry: NAME==VERSION, then its hashes (and an environment marker where it forks).
PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==([^ ;\\]+)(?:\s*;\s*([^\\]+?))?\s*\\?$")


def _pins() -> dict[str, list[tuple[Version, str]]]:
    pins: dict[str, list[tuple[Version, str]]] = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        match = PIN.match(line)
        if match:
            name = re.sub(r"[-_.]+", "-", match[1]).lower()
            pins.setdefault(name, []).append((Version(match[2]), (match[3] or "").strip()))
    return pins


def test_every_dependency_of_the_project_is_locked_within_its_range_with_hashes():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
    pins = _pins()
    text = (ROOT / "requirements.lock").read_text()
    assert text.count("--hash=sha256:") >= len(pins), "every pinned package has its hashes"
    problems = []
    for spec in wanted:
        req = Requirement(spec)
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        versions = [v for v, _ in pins.get(name, [])]
        if not versions:
            problems.append(f"{req.name}: not in requirements.lock")
        elif not any(req.specifier.contains(v, prereleases=True) for v in versions):
            problems.append(f"{req.name}: locked {versions}, pyproject asks {req.specifier}")
    assert not problems, "; ".join(problems) + ": run `make lock`"


def test_the_lock_says_how_it_is_made_again_and_make_installs_it_with_hashes():
    assert "#    make lock" in (ROOT / "requirements.lock").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert "--require-hashes -r $(LOCK)" in makefile and "--no-deps -e ." in makefile


def test_ci_previews_with_the_pulumi_cli_of_the_locked_sdk():
    (locked,) = [v for v, _ in _pins()["pulumi"]]
    workflow = (ROOT / ".github" / "workflows" / "ci.yml").read_text()
    assert f"pulumi-version: {locked} " in workflow
    assert f"--version {locked}" in (ROOT / "README.md").read_text()
