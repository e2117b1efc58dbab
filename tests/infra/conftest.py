import shutil
from pathlib import Path

import pytest

from infra.packaging.lock import write_lock

TEMPLATE = Path(__file__).resolve().parents[2] / "template" / "{{cookiecutter.project_slug}}"


def make_experiment(root: Path, rel: str = "experiments/demo") -> Path:
    """A small template-shaped experiment (what `multislice new` renders): the template's own
    config code and presets, so preview-time checks run the code a real fork has."""
    exp = root / rel
    (exp / "configs").mkdir(parents=True)
    (exp / "trainer").mkdir()
    (exp / "pyproject.toml").write_text(
        '[project]\nname = "demo"\nversion = "0.1.0"\nrequires-python = ">=3.11"\n'
        "[project.optional-dependencies]\ntpu = []\n"
    )
    for preset in ("base", "tiny", "default"):
        shutil.copy(TEMPLATE / "configs" / f"{preset}.toml", exp / "configs")
    # the config code and what it imports
    for module in ("config.py", "model/rope.py", "runtime/storage.py"):
        (exp / "trainer" / module).parent.mkdir(exist_ok=True)
        shutil.copy(TEMPLATE / "trainer" / module, exp / "trainer" / module)
    for package in ("", "model/", "runtime/"):
        (exp / "trainer" / f"{package}__init__.py").write_text("")
    (exp / "trainer" / "main.py").write_text("print('train')\n")
    write_lock(exp, "3.11", extra_args=["--offline"])  # nothing to resolve: no dependencies
    return exp


def make_full_experiment(root: Path, rel: str = "experiments/demo") -> Path:
    """make_experiment with the template's whole trainer package, so the experiment can count
    its model's parameters (trainer.model.transformer) as a fork does."""
    exp = make_experiment(root, rel)
    shutil.copytree(TEMPLATE / "trainer", exp / "trainer", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    return exp


@pytest.fixture
def project_root(tmp_path: Path) -> Path:
    make_experiment(tmp_path)
    return tmp_path


def base_config(**overrides):
    cfg = {
        "project": "my-proj",
        "region": "us-central2",
        "zone": "us-central2-b",
        "accelerator_type": "v4-8",
        "slices": 2,
        "experiment_dir": "experiments/demo",
        "trainer": {"config": "tiny", "steps": 20},
    }
    cfg.update(overrides)
    return cfg


KEEPS = {  # day-two changes: the launch spec object changes, the queued resource does not
    "trainer steps": {"trainer": {"steps": 5000}},
    "trainer overrides": {"trainer": {"overrides": {"optim.learning_rate": 1e-4}}},
    "restart settings": {"trainer": {"max_restarts": 3, "init_timeout_s": 120}},
    "provider-only": {"wait_for_active_s": 7200},
    "run name and spec polling": {"run_name": "second", "spec_poll_s": 30},
}
REPLACES = {  # what defines the machines
    "slices": ({"slices": 4}, "slices"),
    "accelerator": ({"accelerator_type": "v4-16"}, "accelerator_type"),
    "runtime": ({"runtime_version": "tpu-ubuntu2204-base-v2"}, "runtime_version"),
    "secure boot off": ({"secure_boot": False}, "secure_boot"),
}
