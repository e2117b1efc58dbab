"""The example stacks the suite checks are exactly the ones the repository ships."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.support.examples import EXAMPLE_STACK_NAMES, ROOT


def test_the_suites_example_stacks_are_the_tracked_stack_files():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: nothing says which stack files ship")
    tracked = subprocess.run(["git", "ls-files", "stacks/Pulumi.*.yaml"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    assert sorted(tracked) == sorted(f"stacks/{name}" for name in EXAMPLE_STACK_NAMES)
