"""One rule for relative paths: what a user types on `multislice local`'s command line is read
relative to where they typed it, though the trainers run in the experiment directory."""

from __future__ import annotations

import shutil
from pathlib import Path

from scripts.cli import main
from scripts.local.typed_paths import absolute_trainer_paths
from tests.scripts.test_local import FAKE_TRAINER


def test_path_settings_and_preset_files_are_made_absolute_and_nothing_else(tmp_path):
    args = ["--config", "presets/mine.toml", "--set", "data.path=data/corpus",
            "--set=train.init_from=~/weights", "--set", "optim.learning_rate=3e-4",
            "--set", "data.path=gs://bucket/corpus", "--set", "train.init_from=",
            "--config=tiny", "--steps", "5"]
    out, changed = absolute_trainer_paths(args, tmp_path)
    home = str(Path("~/weights").expanduser())
    assert out == ["--config", f"{tmp_path}/presets/mine.toml",
                   "--set", f"data.path={tmp_path}/data/corpus",
                   f"--set=train.init_from={home}", "--set", "optim.learning_rate=3e-4",
                   "--set", "data.path=gs://bucket/corpus", "--set", "train.init_from=",
                   "--config=tiny", "--steps", "5"]
    assert changed == [f"--config {tmp_path}/presets/mine.toml",
                       f"data.path={tmp_path}/data/corpus", f"train.init_from={home}"]
    assert absolute_trainer_paths(["--set"], tmp_path) == (["--set"], [])  # argparse says it


def test_a_quoted_path_setting_is_resolved_inside_its_quotes(tmp_path):
    # The trainer reads a --set value as a TOML scalar: `"/abs"` is the path /abs, and a quoted
    # relative path is relative like a bare one; the quotes were once taken as part of the path.
    args = ["--set", 'data.path="/srv/corpus"', "--set", "train.init_from = 'weights/ft'",
            "--set", "data.path=3"]
    out, changed = absolute_trainer_paths(args, tmp_path)
    assert out == ["--set", 'data.path="/srv/corpus"',
                   "--set", f'train.init_from ="{tmp_path}/weights/ft"',
                   "--set", "data.path=3"]
    assert changed == [f'train.init_from ="{tmp_path}/weights/ft"']


def test_local_hands_the_trainer_the_path_the_user_typed_from_their_directory(
        tmp_path, monkeypatch, capsys):
    # The case: from the repository root, a data.path that starts with the experiment's
    # own path. Read against the experiment it would be experiments/x/experiments/x/...
    root = tmp_path / "repo"
    experiment = root / "experiments" / "x"
    (experiment / "trainer").mkdir(parents=True)
    (experiment / "trainer" / "__init__.py").write_text("")
    shutil.copy(FAKE_TRAINER, experiment / "trainer" / "main.py")
    monkeypatch.chdir(root)
    code = main(["local", "--experiment", "experiments/x", "--slices", "1",
                 "--devices-per-slice", "1", "--run-dir", "runs/x", "--", "--steps", "2",
                 "--fake-dump-env", "--set", "data.path=experiments/x/data/corpus"])
    assert code == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert f"relative to {root}: data.path={experiment}/data/corpus" in err
    log = (root / "runs" / "x" / "logs" / "slice-0.log").read_text()
    assert f"--set data.path={experiment}/data/corpus" in log, log
