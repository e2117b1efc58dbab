"""Fixtures that more than one module of tests/scripts shares (one worker runs those modules:
their xdist_group says so)."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.new import render_template
from tests.support.resume_runs import launch


@pytest.fixture(scope="session")
def resume_experiment(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return render_template("resumecheck", tmp_path_factory.mktemp("experiments"))


@pytest.fixture(scope="session")
def resume_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Does not exist yet: the reference run prepares the built-in corpus here, the others reuse it.
    return tmp_path_factory.mktemp("shared") / "data"


@pytest.fixture(scope="session")
def resume_reference(resume_experiment: Path, resume_data_dir: Path,
                     tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The resume drills' uninterrupted run on local disk (2 slices x 2 devices), made once for
    test_resume.py and test_resume_gcs.py."""
    run_dir = tmp_path_factory.mktemp("reference")
    assert launch(resume_experiment, run_dir, resume_data_dir) == 0
    return run_dir
