from pathlib import Path

import pytest


def make_experiment(root: Path) -> Path:
    """A minimal template-shaped experiment directory (what `multislice new` renders)."""
    exp = root / "experiments" / "demo"
    (exp / "configs").mkdir(parents=True)
    (exp / "trainer").mkdir()
    (exp / "pyproject.toml").write_text('[project]\nname = "demo"\nversion = "0.1.0"\n')
    (exp / "configs" / "tiny.toml").write_text("[train]\ntotal_steps = 10\n")
    (exp / "trainer" / "__init__.py").write_text("")
    (exp / "trainer" / "main.py").write_text("print('train')\n")
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
