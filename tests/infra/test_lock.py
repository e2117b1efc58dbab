"""The experiment's TPU lock (infra/packaging/lock.py): fresh in the template, refused when stale at preview."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from infra.packaging.experiment import experiment_problems, local_tier_problems
from infra.packaging.lock import (
    LOCK_FILE,
    TPU_PLATFORM,
    LockError,
    check_lock,
    read_header,
    write_lock,
)
from infra.stack_config.schema import parse_stack
from scripts.new import DEFAULT_PYTHON, render_template
from tests.infra.conftest import base_config, make_experiment


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return render_template("lockcheck", tmp_path_factory.mktemp("exp"))


def test_the_template_ships_a_fresh_lock_with_libtpu_and_a_hash_for_every_pin(rendered):
    # Fails when someone changes the template's dependencies without `multislice lock`.
    header = check_lock(rendered, DEFAULT_PYTHON)
    assert (header["python"], header["platform"]) == (DEFAULT_PYTHON, TPU_PLATFORM)
    text = (rendered / LOCK_FILE).read_text()
    pins = re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+) \\$", text, flags=re.M)
    names = {name for name, _ in pins}
    assert {"jax", "jaxlib", "libtpu", "gcsfs", "orbax-checkpoint", "grain"} <= names
    blocks = re.split(r"\n(?=[A-Za-z0-9_.\-]+==)", text)
    assert all("--hash=sha256:" in block for block in blocks[1:]), "a pin without a hash"


def test_changing_a_dependency_makes_the_lock_stale_but_the_description_does_not(
        rendered, tmp_path):
    exp = tmp_path / "exp"
    exp.mkdir()
    (exp / LOCK_FILE).write_text((rendered / LOCK_FILE).read_text())
    pyproject = (rendered / "pyproject.toml").read_text()
    (exp / "pyproject.toml").write_text(pyproject.replace(
        'description = "', 'description = "Changed: '))
    check_lock(exp, DEFAULT_PYTHON)
    (exp / "pyproject.toml").write_text(pyproject.replace(
        '"optax>=0.2.4,<0.3"', '"optax>=0.2.5,<0.3"'))
    with pytest.raises(LockError, match=rf"{LOCK_FILE} is stale: .*multislice lock "
                                        rf"--experiment {exp} --python {DEFAULT_PYTHON}"):
        check_lock(exp, DEFAULT_PYTHON)


def test_a_lock_for_another_python_or_platform_or_none_at_all_is_refused(tmp_path):
    exp = make_experiment(tmp_path)
    with pytest.raises(LockError, match=r"resolved for Python '3.11', but the stack runs "
                                        r"python_version '3.12'"):
        check_lock(exp, "3.12")
    write_lock(exp, "3.11", platform="aarch64-manylinux_2_28", extra_args=["--offline"])
    assert read_header(exp / LOCK_FILE)["platform"] == "aarch64-manylinux_2_28"
    with pytest.raises(LockError, match=rf"platform 'aarch64-manylinux_2_28'; TPU VMs need "
                                        rf"'{TPU_PLATFORM}'"):
        check_lock(exp, "3.11")
    (exp / LOCK_FILE).unlink()
    with pytest.raises(LockError, match=rf"{LOCK_FILE} is missing"):
        check_lock(exp, "3.11")


def test_an_experiment_without_a_tpu_extra_cannot_be_locked(tmp_path):
    exp = make_experiment(tmp_path)
    (exp / "pyproject.toml").write_text('[project]\nname = "x"\nversion = "0"\n')
    with pytest.raises(LockError, match=r"no \[project.optional-dependencies\] tpu extra"):
        check_lock(exp, "3.11")


def test_preview_refuses_a_stale_lock_naming_the_fix(tmp_path):
    exp = make_experiment(tmp_path)
    cfg = parse_stack(base_config(experiment_dir=str(exp)), "dev")
    assert experiment_problems(cfg, exp) == ([], [])
    pyproject = exp / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace("tpu = []", 'tpu = ["jax[tpu]"]'))
    problems, _ = experiment_problems(cfg, exp)
    assert problems == [f"experiment_dir: {exp / LOCK_FILE} is stale: pyproject.toml's "
                        "dependencies, tpu extra or requires-python changed since it was made; "
                        f"remake it with `multislice lock --experiment {exp} --python 3.11`"]


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (lambda t: re.sub(r"(?m)^optax==\S+", "optax==0.2.99", t, count=1), None),
        (lambda t: re.sub(r"(?m)^(gcsfs==\S+ \\)\n(\s+--hash=sha256:\S+( \\)?\n)+", r"\1\n", t,
                          count=1), "gcsfs=="),
        (lambda t: t + "requests==2.32.3\n", "requests==2.32.3 has no --hash line"),
    ],
    ids=["hand-edited pin", "removed hashes", "added package"],
)
def test_a_lock_body_edited_by_hand_is_refused_at_preview(rendered, tmp_path, edit, problem):
    exp = tmp_path / "exp"
    exp.mkdir()
    (exp / "pyproject.toml").write_text((rendered / "pyproject.toml").read_text())
    text = (rendered / LOCK_FILE).read_text()
    edited = edit(text)
    assert edited != text
    (exp / LOCK_FILE).write_text(edited)
    with pytest.raises(LockError) as err:
        check_lock(exp, DEFAULT_PYTHON)
    message = str(err.value)
    assert "was edited after `multislice lock` made it" in message
    assert f"multislice lock --experiment {exp} --python {DEFAULT_PYTHON}" in message
    if problem:
        assert problem in message, message


@pytest.mark.slow  # three child interpreters that import the experiment's model
def test_preview_refuses_a_local_checkpoint_tier_that_cannot_fit_a_hosts_boot_disk(rendered):
    # llama-3.2-1b: 1.24e9 parameters x 12 bytes (float32 and Adam's two moments) = 13.8 GiB a
    # slice. One host of v5litepod-8 keeps 3 + 1 parts: 55.2 GiB, over half its 100 GiB boot disk.
    def problems(accelerator: str, keep: int) -> list[str]:
        cfg = parse_stack(base_config(
            experiment_dir=str(rendered), accelerator_type=accelerator, zone="us-west4-a",
            region="us-west4", trainer={"config": "llama-3.2-1b", "steps": 20, "overrides": {
                "checkpoint.local_every": 50, "checkpoint.local_max_to_keep": keep}}), "dev")
        return local_tier_problems(cfg, rendered)

    [refused] = problems("v5litepod-8", 3)
    assert refused.startswith("trainer: checkpoint.local_every = 50 keeps 3 + 1 local part(s) "
                              "of 13.8 GiB on each host of v5litepod-8 (1,235,814,400 "
                              "parameters x 12 bytes"), refused
    assert "55.2 GiB, over the 50 GiB the tier may take of a host's 100 GiB boot disk" in refused
    assert "lower checkpoint.local_max_to_keep to 2" in refused
    assert problems("v5litepod-8", 2) == []  # 41.4 GiB
    assert problems("v5litepod-16", 3) == []  # four hosts a slice: 3.5 GiB parts
