"""`multislice data prepare`: runs the experiment's trainer.prepare with the right record length."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from scripts.cli import main as cli_main
from scripts.new import render_template

SMALL = ["--num-sentences", "1500"]  # a corpus that prepares in about a second


@pytest.fixture(scope="module")
def experiment(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return render_template("data-cli", tmp_path_factory.mktemp("exp"))


def metadata(directory: Path) -> dict:
    return json.loads((directory / "metadata.json").read_text())


def test_default_template_prepares_records_as_long_as_the_config_seq_len(tmp_path: Path) -> None:
    out = tmp_path / "tiny-data"
    assert cli_main(["data", "prepare", "--output", str(out), "--config", "tiny", *SMALL]) == 0
    meta = metadata(out)
    assert meta["seq_len"] == 64  # configs/tiny.toml model.seq_len
    assert meta["num_records"] > 0
    for shard in meta["shards"]:
        size = (out / shard["file"]).stat().st_size
        assert size >= shard["num_records"] * 65  # each record holds seq_len + 1 byte tokens


def test_seq_len_flag_wins_and_relative_output_is_taken_from_the_callers_directory(
    experiment: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    code = cli_main(["data", "prepare", "--experiment", str(experiment), "--output", "rel",
                     "--seq-len", "32", "--num-shards", "3", *SMALL])
    assert code == 0
    meta = metadata(tmp_path / "rel")
    assert meta["seq_len"] == 32 and len(meta["shards"]) == 3
    assert not (experiment / "rel").exists()


def test_a_config_given_as_a_toml_path_sets_the_seq_len(experiment: Path, tmp_path: Path) -> None:
    config = tmp_path / "mine.toml"
    config.write_text("[model]\nseq_len = 48\n")
    out = tmp_path / "out"
    assert cli_main(["data", "prepare", "--experiment", str(experiment), "--output", str(out),
                     "--config", str(config), *SMALL, "--", "--num-shards", "2"]) == 0
    meta = metadata(out)
    assert meta["seq_len"] == 48 and len(meta["shards"]) == 2  # the argument after -- reached it


def test_prepare_errors_come_through_with_its_exit_code(
    experiment: Path, tmp_path: Path, capfd: pytest.CaptureFixture,
) -> None:
    missing = tmp_path / "missing.txt"
    code = cli_main(["data", "prepare", "--experiment", str(experiment),
                     "--output", str(tmp_path / "o"), "--input", str(missing)])
    assert code == 2
    assert f"input file {missing} does not exist" in capfd.readouterr().err


def test_gs_input_is_refused_before_anything_runs(
    experiment: Path, capsys: pytest.CaptureFixture,
) -> None:
    code = cli_main(["data", "prepare", "--experiment", str(experiment),
                     "--output", "/tmp/x", "--input", "gs://bucket/a.txt"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--input gs://bucket/a.txt: this input is read from local disk only" in err
    assert "trainer.prepare --output" not in err  # nothing was started


def test_unknown_config_names_the_file_and_the_presets(
    experiment: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
) -> None:
    code = cli_main(["data", "prepare", "--experiment", str(experiment),
                     "--output", str(tmp_path / "o"), "--config", "huge"])
    assert code == 2
    err = capsys.readouterr().err
    assert f"{experiment}/configs/huge.toml does not exist" in err
    assert "base, default, llama-3.2-1b, llama-tiny, tiny" in err
    assert not (tmp_path / "o").exists()


def test_a_config_without_seq_len_takes_base_and_a_bad_one_is_refused(
    experiment: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
) -> None:
    from scripts.data import config_seq_len

    config = tmp_path / "partial.toml"
    config.write_text("[model]\nd_model = 8\n")  # a preset lists only what it changes
    base = tomllib.loads((experiment / "configs" / "base.toml").read_text())
    assert config_seq_len(experiment, str(config)) == base["model"]["seq_len"]
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nseq_len = 'long'\n")
    code = cli_main(["data", "prepare", "--experiment", str(experiment),
                     "--output", str(tmp_path / "o"), "--config", str(bad)])
    assert code == 2
    assert "model.seq_len = 'long'" in capsys.readouterr().err


def test_a_directory_that_is_not_an_experiment_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture,
) -> None:
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "main.py").write_text("")
    code = cli_main(["data", "prepare", "--experiment", str(tmp_path), "--output",
                     str(tmp_path / "o")])
    assert code == 2
    assert "has no trainer/dataset/prepare.py" in capsys.readouterr().err


def test_a_non_empty_output_is_refused_and_overwrite_replaces_it_whole(
    experiment: Path, tmp_path: Path, capfd: pytest.CaptureFixture,
) -> None:
    out = tmp_path / "data"
    base = ["data", "prepare", "--experiment", str(experiment), "--output", str(out), *SMALL]
    assert cli_main([*base, "--num-shards", "4"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capfd.readouterr()
    assert cli_main([*base, "--num-shards", "2", "--seq-len", "32"]) == 2
    err = capfd.readouterr().err
    assert f"--output {out} is not empty: it holds a prepared data set (data-" in err, err
    assert "nothing was written" in err and "--overwrite" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # untouched

    # --overwrite: the new set replaces the old one whole; none of the old shards stays behind.
    assert cli_main([*base, "--num-shards", "2", "--seq-len", "32", "--overwrite"]) == 0
    meta = metadata(out)
    assert meta["seq_len"] == 32 and len(meta["shards"]) == 2
    shards = {p.name for p in out.iterdir() if p.name.startswith("data-")}
    assert shards == {s["file"] for s in meta["shards"]}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".data.")]  # no leftovers


def test_a_directory_of_other_files_or_a_file_is_not_prepared_into(
    experiment: Path, tmp_path: Path, capfd: pytest.CaptureFixture,
) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    argv = ["data", "prepare", "--experiment", str(experiment), *SMALL, "--output"]
    assert cli_main([*argv, str(mine)]) == 2
    assert "holds files that are not a prepared data set (notes.txt)" in capfd.readouterr().err
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    # --overwrite replaces a data set the toolkit wrote, never files it did not write
    assert cli_main([*argv, str(mine), "--overwrite"]) == 2
    err = capfd.readouterr().err
    assert "(notes.txt); nothing was written, even with --overwrite" in err, err
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    prepared = tmp_path / "prepared"
    assert cli_main([*argv, str(prepared)]) == 0
    (prepared / "notes.txt").write_text("mine too")
    before = {p.name: p.read_bytes() for p in prepared.iterdir()}
    capfd.readouterr()
    assert cli_main([*argv, str(prepared), "--overwrite"]) == 2
    assert "holds a prepared data set and files it did not write (notes.txt)" in \
        capfd.readouterr().err
    assert {p.name: p.read_bytes() for p in prepared.iterdir()} == before
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert cli_main([*argv, str(afile)]) == 2
    assert f"--output {afile} is a file, not a directory" in capfd.readouterr().err
    assert cli_main([*argv, "gs://bkt/data", "--overwrite"]) == 2
    assert "cannot be replaced atomically" in capfd.readouterr().err


def test_tokenizer_arguments_are_checked_before_any_input_is_read(
    experiment: Path, tmp_path: Path, capfd: pytest.CaptureFixture,
) -> None:
    missing = tmp_path / "never-read.txt"  # would fail as "does not exist" if it were read first
    out = tmp_path / "o"
    assert cli_main(["data", "prepare", "--experiment", str(experiment), "--output", str(out),
                     "--input", str(missing), "--tokenizer", "bpe"]) == 2
    err = capfd.readouterr().err
    assert "--tokenizer bpe needs --vocab-size N" in err and "does not exist" not in err
    assert not out.exists()


def test_the_closing_hint_names_the_vocabulary_the_model_needs(
    experiment: Path, tmp_path: Path, capfd: pytest.CaptureFixture,
) -> None:
    out = tmp_path / "bpe"
    assert cli_main(["data", "prepare", "--experiment", str(experiment), "--output", str(out),
                     "--tokenizer", "bpe", "--vocab-size", "300", "--seq-len", "32", *SMALL]) == 0
    assert "--set model.vocab_size=300 (or larger) and --set model.seq_len=32" in \
        capfd.readouterr().out


def test_a_seq_len_mismatch_names_the_command_that_prepared_the_data(
    experiment: Path, tmp_path: Path, capfd: pytest.CaptureFixture,
) -> None:
    out = tmp_path / "data"
    assert cli_main(["data", "prepare", "--experiment", str(experiment), "--output", str(out),
                     "--seq-len", "32", *SMALL, "--", "--num-shards", "2"]) == 0
    capfd.readouterr()
    recorded = metadata(out)["command"]
    assert recorded.startswith(f"multislice data prepare --experiment {experiment} --output "
                               f"{out} --seq-len 32")
    assert recorded.endswith("-- --num-shards 2")
    import sys

    sys.path.insert(0, str(experiment))
    try:
        from trainer.dataset.input_pipeline import DataError, open_dataset

        with pytest.raises(DataError) as err:
            open_dataset(out, seq_len=64)
    finally:
        sys.path.remove(str(experiment))
    assert (f"prepare it again with `multislice data prepare --experiment {experiment} --output "
            f"{out} --seq-len 64 --num-sentences 1500 --overwrite -- --num-shards 2`"
            in str(err.value)), str(err.value)
    assert "or set model.seq_len=32" in str(err.value)
