"""One stack-config loader: the program (through pulumi.Config), render and --stack-config agree."""

from __future__ import annotations

import json
from pathlib import Path

import pulumi
import pytest
import yaml

from infra.stack_config.pulumi_config import load_stack_config
from infra.stack_config.schema import StackConfigError
from infra.stack_config.stack_file import read_stack_file
from infra.stack_config.validation import load_stack_file
from scripts import render
from tests.infra.conftest import base_config
from tests.infra.pulumi_mocks import RecordingMocks


def _engine_config(raw: dict) -> dict[str, str]:
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in raw.items()}


def _load_through_pulumi(config: dict, base_dir: Path):
    """What the program sees: the engine's PULUMI_CONFIG mapping, read via pulumi.Config."""
    pulumi.runtime.set_mocks(RecordingMocks(), project="multislice", stack="exp", preview=True)
    pulumi.runtime.set_all_config(_engine_config(config))
    return load_stack_config(base_dir=base_dir)


def _namespaced(**overrides) -> dict:
    return {f"multislice:{k}": v for k, v in base_config(**overrides).items()}


def test_misspelled_key_under_pulumi_is_an_error_not_a_default(project_root):
    config = _namespaced()
    config["multislice:slcies"] = 4
    with pytest.raises(StackConfigError) as err:
        _load_through_pulumi(config, project_root)
    assert "multislice:slcies: unknown key (did you mean 'slices'?)" in str(err.value)


def test_misspelled_namespace_under_pulumi_is_an_error(project_root):
    config = _namespaced()
    config["multislcie:slices"] = 4
    with pytest.raises(StackConfigError, match="unknown namespace 'multislcie' \\(did you mean "
                                               "'multislice'\\?\\)"):
        _load_through_pulumi(config, project_root)


def test_gcp_keys_fill_in_and_other_provider_keys_pass(project_root):
    config = _namespaced()
    del config["multislice:project"]
    config["gcp:project"] = "from-gcp"
    config["gcp:impersonateServiceAccount"] = "x@y.iam.gserviceaccount.com"
    cfg, _ = _load_through_pulumi(config, project_root)
    assert cfg.project == "from-gcp"


def _write_stack(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_unnamespaced_key_belongs_to_the_project_as_the_cli_rewrites_it(project_root):
    doc = {"config": {**_namespaced(), "slices": 4}}
    del doc["config"]["multislice:slices"]
    doc["config"]["multislice:trainer"] = {"config": "tiny", "overrides": {
        "train.global_batch_size": 16}}
    path = _write_stack(project_root / "Pulumi.exp.yaml", yaml.safe_dump(doc))
    assert read_stack_file(path)["multislice:slices"] == "4"
    assert load_stack_file(path, base_dir=project_root).slices == 4


def test_the_same_key_with_and_without_namespace_is_a_duplicate(project_root):
    doc = {"config": {**_namespaced(), "slices": 4}}
    path = _write_stack(project_root / "Pulumi.exp.yaml", yaml.safe_dump(doc))
    with pytest.raises(StackConfigError, match="slices: the same key as multislice:slices"):
        load_stack_file(path, base_dir=project_root)


def test_duplicate_yaml_key_is_refused_like_the_cli_does(project_root):
    text = yaml.safe_dump({"config": _namespaced()}) + "  multislice:slices: 3\n"
    path = _write_stack(project_root / "Pulumi.exp.yaml", text)
    with pytest.raises(StackConfigError, match="duplicate key 'multislice:slices'"):
        load_stack_file(path, base_dir=project_root)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("multislice:slcies", 4, "unknown key (did you mean 'slices'?)"),
        ("multislice:trainer", {"config": "tiny", "stpes": 3}, "trainer.stpes: unknown key (did "
                                                                "you mean 'steps'?)"),
        ("multislice:labels", {"multislice-stack": "x"}, "overrides a label the toolkit sets"),
    ],
)
def test_render_and_the_stack_file_loader_give_the_same_error(project_root, key, value, message):
    """`multislice render` evaluates the program through pulumi.Config; both say the same."""
    (project_root / "Pulumi.yaml").write_text("name: multislice\nruntime: python\n")
    (project_root / "__main__.py").write_text((render.ROOT / "__main__.py").read_text())
    config = _namespaced()
    config[key] = value
    path = _write_stack(project_root / "Pulumi.exp.yaml", yaml.safe_dump({"config": config}))
    with pytest.raises(StackConfigError) as from_loader:
        load_stack_file(path, base_dir=project_root)
    with pytest.raises(render.RenderError) as from_render:
        render.build_manifest(path, root=project_root)
    assert message in str(from_loader.value)
    assert message in str(from_render.value)
    assert from_loader.value.problems[0] in str(from_render.value)
