import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trainer.config import ConfigError, Topology, load_config
from trainer.dataset.input_pipeline import DataError
from trainer.dataset.loader import ensure_dataset
from trainer.runtime.metrics import MetricsWriter, last_step_row, read_metrics
from trainer.runtime.preemption import EXIT_PREEMPTED
from trainer.train import TrainingDiverged, resolve_for_run, run

ROOT = Path(__file__).resolve().parent.parent
CONTRACT_STEP_FIELDS = {"step", "loss", "step_time_s", "tokens_per_s", "tflops_per_device", "mfu"}
CONTRACT_SUMMARY_FIELDS = {"final_step", "final_loss", "params_digest", "tokens_per_s",
                           "tflops_per_device", "mfu", "num_slices", "devices_per_slice",
                           "device_kind"}
STEPS = 40


def quiet(_: str) -> None:
    pass


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    """The built-in corpus, prepared once for the module's runs, which name it in data.path."""
    path = str(tmp_path_factory.mktemp("shared") / "data")
    ensure_dataset(load_config("tiny", [f"data.path={path}", "data.prepare_if_missing=true"]), "")
    return path


def tiny(data_dir: str, *overrides: str):
    return load_config("tiny", [f"data.path={data_dir}", *overrides])


def rows_of(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def losses_of(rows: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows if r["event"] == "step"}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, data_dir):
    run_dir = tmp_path_factory.mktemp("run")
    lines: list[str] = []
    with pytest.MonkeyPatch.context() as patch:  # this run's own cache, in RUN_DIR
        patch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
        summary = run(tiny(data_dir), STEPS, str(run_dir), log=lines.append)
    return run_dir, summary, lines


def test_loss_goes_down_on_tiny(tiny_run):
    run_dir, summary, _ = tiny_run
    losses = [r["loss"] for r in rows_of(run_dir) if r["event"] == "step"]
    assert len(losses) == STEPS
    # Uniform bytes start near ln(256) = 5.5; the corpus structure is learnable well below 3.
    assert losses[0] > 5.0
    assert summary["final_loss"] < 3.0


def test_llama_family_preset_trains_on_cpu(tmp_path, data_dir):
    config = load_config("llama-tiny", [f"data.path={data_dir}", "data.prepare_if_missing=true"])
    summary = run(config, 30, str(tmp_path), log=quiet)
    losses = [r["loss"] for r in rows_of(tmp_path) if r["event"] == "step"]
    assert losses[0] > 5.0 and summary["final_loss"] < 3.2
    assert summary["eval_loss"] is not None and summary["eval_loss"] < losses[0]


def test_metrics_and_summary_follow_the_contract(tiny_run, data_dir):
    run_dir, summary, lines = tiny_run
    rows = rows_of(run_dir)
    assert all({"event", "time"} <= row.keys() for row in rows)
    steps = [r for r in rows if r["event"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert all(r.keys() >= CONTRACT_STEP_FIELDS for r in steps)
    assert all(r["step_time_s"] > 0 and r["tokens_per_s"] > 0 for r in steps)
    assert len({r["batch_digest"] for r in steps}) == STEPS  # every step reads another batch
    events = [r["event"] for r in rows]
    assert events.index("data_ready") < events.index("fresh_start") < events.index("compile") \
        < events.index("step") < events.index("end")
    assert [r["step"] for r in rows if r["event"] == "checkpoint"] == [10, 20, 30, 40]
    assert "restart" not in events and "restore" not in events
    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert on_disk.keys() >= CONTRACT_SUMMARY_FIELDS
    assert on_disk["final_step"] == STEPS
    assert on_disk["params_digest"] == summary["params_digest"]
    assert len(summary["params_digest"]) == 64
    assert (summary["num_slices"], summary["devices_per_slice"]) == (1, 8)
    assert any(line.startswith("step 10/40 loss ") and "MFU" in line for line in lines)
    assert any(line.startswith("no checkpoint in ") and "starting fresh" in line
               for line in lines)
    assert (run_dir / "compile_cache").is_dir() and any((run_dir / "compile_cache").iterdir())
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["20", "30", "40"]
    # every checkpoint records the model it was built from (a deployer's preview reads it)
    meta = json.loads((run_dir / "checkpoints" / "40" / "meta" / "metadata").read_text())
    assert meta["model"]["d_model"] == 64 and meta["model"]["n_layers"] == 2


def tensorboard_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """Reads the TFRecord event files (u64 length, u32 crc, payload, u32 crc) of `run_dir`."""
    from tensorboardX.proto import event_pb2

    scalars: dict[str, dict[int, float]] = {}
    for path in run_dir.glob("events.out.tfevents.*"):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


def test_tensorboard_event_files_mirror_the_metrics(tiny_run):
    run_dir, _, _ = tiny_run
    scalars = tensorboard_scalars(run_dir)
    losses = losses_of(rows_of(run_dir))
    assert sorted(scalars["train/loss"]) == sorted(losses)
    assert all(scalars["train/loss"][s] == pytest.approx(losses[s], rel=1e-6) for s in losses)
    assert sorted(scalars["checkpoint/blocking_s"]) == [10, 20, 30, 40]


def test_resumed_run_continues_bit_for_bit(tmp_path, tiny_run, data_dir):
    reference_dir, reference, _ = tiny_run
    first = run(tiny(data_dir), 25, str(tmp_path), log=quiet)  # saves 10, 20 and 25 (final)
    assert first["final_step"] == 25
    lines: list[str] = []
    resumed = run(tiny(data_dir), STEPS, str(tmp_path), log=lines.append)
    assert resumed["params_digest"] == reference["params_digest"]
    assert resumed["rng_digest"] == reference["rng_digest"]
    assert resumed["start_step"] == 25
    assert any(line.startswith("resuming run ") and " at checkpoint step 25 from " in line
               for line in lines)
    rows = rows_of(tmp_path)
    want = losses_of(rows_of(reference_dir))
    assert losses_of(rows) == want  # steps 1-25 from the first run, 26-40 after the resume
    # A new invocation of a finished run resumes; it is not a restart of an attempt.
    assert [r["restored_step"] for r in rows if r["event"] == "restore"] == [25]
    assert not [r for r in rows if r["event"] == "restart"]


def test_a_resume_on_another_data_set_is_refused_and_touches_nothing(tmp_path, data_dir):
    from trainer.dataset.prepare import prepare

    run(tiny(data_dir), 10, str(tmp_path), log=quiet)  # checkpoint 10 records the data set
    other = tmp_path / "other-data"
    prepare(other, seq_len=64, seed=1, num_sentences=4000)  # same shape, other records
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    with pytest.raises(DataError, match=r"checkpoint step 10 in .* was trained on another data "
                                        r"set \(metadata.json sha256 [0-9a-f]{12}\) than the "
                                        r"one in .*other-data now"):
        run(tiny(str(other)), 20, str(tmp_path), log=quiet)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before
    # The data it was trained on resumes as before.
    assert run(tiny(data_dir), 12, str(tmp_path), log=quiet)["start_step"] == 10


def test_unreadable_checkpoints_end_in_one_line_without_orbax_noise(tmp_path, tiny_run,
                                                                   data_dir):
    # Orbax restores every array in one asyncio.gather; a corrupt chunk used to close the loop
    # under the sibling reads, printing thousands of lines (`Event loop is closed`, TensorStore
    # specs) before and after the trainer's own message.
    run_dir = tmp_path / "run"
    shutil.copytree(tiny_run[0], run_dir)
    chunks = [p for p in (run_dir / "checkpoints").glob("*/state/**/d/*") if p.is_file()]
    assert chunks
    for chunk in chunks:
        chunk.write_bytes(b"\0" * 100)
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.main", "--config", "tiny", "--steps", str(STEPS + 5),
         "--set", f"data.path={data_dir}", "--run-dir", str(run_dir)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert lines[-1].startswith("error: none of the checkpoints"), lines[-3:]
    assert "Error reading" in lines[-1], lines[-1]  # the real cause, not a spec dump
    for noise in ("Event loop is closed", "TensorStore details", "Traceback",
                  "never retrieved", "Exception ignored"):
        assert noise not in proc.stderr, proc.stderr[-3000:]
    checkpoints = len({p.parts[-4] for p in chunks})
    assert len(lines) <= checkpoints + 4, lines  # one warning per step tried, then the error


@pytest.mark.parametrize("mode", ["train", "check"])
def test_gs_data_on_storage_that_does_not_answer_is_one_line_in_seconds(tmp_path, mode):
    import socket
    import time

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"  # nothing listens there afterwards
    argv = ["--check"] if mode == "check" else ["--steps", "2", "--run-dir", str(tmp_path)]
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.main", "--config", "tiny", *argv,
         "--set", "data.path=gs://team-data/corpus"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "STORAGE_EMULATOR_HOST": closed})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"error: gs://team-data/corpus: the storage endpoint {closed} is not reachable "
        "(Connection refused); check the network, or STORAGE_EMULATOR_HOST"]
    assert time.monotonic() - start < 60


@pytest.mark.slow
def test_sigterm_saves_at_the_next_step_and_exits_42_then_resumes(tmp_path, tiny_run, data_dir):
    reference_dir, reference, _ = tiny_run
    args = [sys.executable, "-m", "trainer.main", "--config", "tiny", "--run-dir", str(tmp_path),
            "--set", f"data.path={data_dir}"]
    proc = subprocess.Popen([*args, "--steps", str(STEPS)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, MULTISLICE_STEP_MARKERS="1"))
    output = []
    for line in proc.stdout:
        output.append(line)
        if line.strip() == "MULTISLICE_STEP 3":
            proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == EXIT_PREEMPTED, "".join(output[-20:])
    rows = rows_of(tmp_path)
    preempted = next(r for r in rows if r["event"] == "preempted")
    stopped = preempted["step"]
    assert 3 < stopped < STEPS
    assert (tmp_path / "checkpoints" / str(stopped)).is_dir()
    assert max(losses_of(rows)) == stopped  # the step it stopped at was still recorded

    done = subprocess.run([*args, "--steps", str(STEPS)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f" at checkpoint step {stopped} from " in done.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["params_digest"] == reference["params_digest"]
    assert losses_of(rows_of(tmp_path)) == losses_of(rows_of(reference_dir))


def test_step_markers_only_for_a_launcher_and_the_profiled_steps_are_traced(
        tmp_path, capsys, data_dir, monkeypatch):
    config = tiny(data_dir, "profile.start_step=2", "profile.num_steps=2")
    monkeypatch.setenv("MULTISLICE_STEP_MARKERS", "1")  # what multislice local sets
    writes: list[str] = []
    real_write = sys.stdout.write
    sys.stdout.write = lambda text: writes.append(text) or real_write(text)
    try:
        summary = run(config, 3, str(tmp_path), log=quiet)
    finally:
        del sys.stdout.write
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if line.startswith("MULTISLICE_STEP")] == [
        "MULTISLICE_STEP 1", "MULTISLICE_STEP 2", "MULTISLICE_STEP 3"]
    # Each marker is one write of a whole line: the launchers share this stdout with C++ logs on
    # stderr, and a newline written apart from its text let one land mid-line ("3E1203 ...").
    assert [w for w in writes if "MULTISLICE_STEP" in w] == [
        "MULTISLICE_STEP 1\n", "MULTISLICE_STEP 2\n", "MULTISLICE_STEP 3\n"]
    monkeypatch.delenv("MULTISLICE_STEP_MARKERS")  # run by hand: a terminal gets no markers
    run(config, 4, str(tmp_path / "by-hand"), log=quiet)
    assert "MULTISLICE_STEP" not in capsys.readouterr().out
    assert summary["final_step"] == 3
    marks = [(r["step"], r["action"]) for r in rows_of(tmp_path) if r["event"] == "profile"]
    assert marks == [(2, "start"), (3, "stop")]
    assert [p for p in (tmp_path / "profile").rglob("*") if p.is_file()], "no trace written"


def test_missing_configured_data_path_fails_before_compiling(tmp_path):
    missing = tmp_path / "nowhere"
    config = load_config("tiny", [f"data.path={missing}", "data.prepare_if_missing=false"])
    with pytest.raises(DataError, match=f"data.path {missing} does not exist"):
        run(config, 2, str(tmp_path / "run"), log=quiet)
    assert "compile" not in {r["event"] for r in rows_of(tmp_path / "run")}
    assert not missing.exists()


def test_empty_data_directory_is_named_and_never_filled(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match=f"data directory {empty} is empty"):
        run(load_config("tiny", [f"data.path={empty}"]), 2, str(tmp_path / "run"), log=quiet)
    assert not any(empty.iterdir())


def test_resume_that_cannot_fit_the_topology_names_the_checkpoint():
    config = load_config("tiny", ["train.global_batch_size=12"])
    topology = Topology(num_slices=1, devices_per_slice=8, num_processes=1)
    with pytest.raises(ConfigError, match=r"^train.global_batch_size = 12 is not divisible"):
        resolve_for_run(config, topology, None, "R/checkpoints")
    with pytest.raises(ConfigError, match=r"cannot resume checkpoint step 30 in R/checkpoints on "
                                          r"1 slice\(s\) x 8 devices \(1 processes\): train\."
                                          r"global_batch_size = 12 is not divisible by the 8"):
        resolve_for_run(config, topology, 30, "R/checkpoints")


def test_metrics_reader_skips_a_torn_line_and_the_writer_ends_it(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"event": "step", "step": 7}\n{"event": "st')
    assert last_step_row(read_metrics(str(tmp_path)))["step"] == 7
    writer = MetricsWriter(str(tmp_path))
    writer.write("step", step=8)
    writer.close()
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [7, 8]


@pytest.mark.slow
def test_a_non_finite_step_exits_3_before_it_replaces_a_good_checkpoint(tmp_path, data_dir):
    good = run(tiny(data_dir), 10, str(tmp_path), log=quiet)  # saves step 10
    # Resume with a learning rate that overflows float32 within a step or two.
    args = [sys.executable, "-m", "trainer.main", "--config", "tiny", "--run-dir", str(tmp_path),
            "--set", f"data.path={data_dir}", "--steps", "40"]
    done = subprocess.run([*args, "--set", "optim.learning_rate=1e30"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 3, done.stderr[-2000:]
    assert re.search(r"error: step 1[1-9]: loss = .*\(not finite\).*newest checkpoint "
                     r"\(step 10\)", done.stderr) and "Traceback" not in done.stderr
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["10"]
    steps = [r for r in rows_of(tmp_path) if r["event"] == "step"]
    assert all(np.isfinite(r["loss"]) for r in steps)
    # The good checkpoint is intact: resuming with the real config finishes like never broken.
    resumed = run(tiny(data_dir), 10, str(tmp_path), log=quiet)
    assert resumed["params_digest"] == good["params_digest"]


def test_training_diverged_names_the_step_and_the_checkpoint_kept():
    message = str(TrainingDiverged(12, 5.5, float("nan"), 10, "R/checkpoints"))
    assert message.startswith("step 12: loss = 5.5, gradient norm = nan (not finite)")
    assert "the newest checkpoint (step 10) in R/checkpoints is from before it" in message


def test_eval_runs_on_held_out_batches_and_never_moves_the_training_data(tmp_path, tiny_run,
                                                                         data_dir):
    reference_dir, reference, _ = tiny_run
    evaluated = ["eval.every_steps=10", "eval.num_batches=2"]
    first = run(tiny(data_dir, *evaluated), 25, str(tmp_path), log=quiet)
    assert first["eval_step"] == 25
    resumed = run(tiny(data_dir, *evaluated), STEPS, str(tmp_path), log=quiet)
    # Same training as the run without evaluation, bit for bit, across a resume.
    assert resumed["params_digest"] == reference["params_digest"]
    assert losses_of(rows_of(tmp_path)) == losses_of(rows_of(reference_dir))
    evals = [r for r in rows_of(tmp_path) if r["event"] == "eval"]
    assert [r["step"] for r in evals] == [10, 20, 25, 30, 40]
    assert all(r["num_batches"] == 2 and np.isfinite(r["loss"]) for r in evals)
    assert evals[-1]["loss"] < evals[0]["loss"]
    assert resumed["eval_loss"] == evals[-1]["loss"] and resumed["eval_step"] == STEPS
    assert sorted(tensorboard_scalars(tmp_path)["eval/loss"]) == [10, 20, 25, 30, 40]


def test_eval_without_enough_held_out_records_fails_before_compiling(tmp_path, data_dir):
    with pytest.raises(DataError, match=r"held-out split of .* has \d+ records, fewer than "
                                        r"eval\.num_batches x eval batch = 100000 x 16"):
        run(tiny(data_dir, "eval.num_batches=100000"), 2, str(tmp_path), log=quiet)
    assert "compile" not in {r["event"] for r in rows_of(tmp_path)}


def test_check_reports_sizes_without_training(tmp_path, data_dir, capsys, monkeypatch):
    from trainer.main import main

    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)  # RUN_DIR/compile_cache

    assert main(["--config", "llama-3.2-1b", "--check"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["param_count"] == 1_235_814_400
    assert report["flops_per_token"] > 6 * 1_235_814_400
    assert report["mesh"]["fsdp"] == 8 and report["memory_per_device_gib"]["params"] == \
        pytest.approx(1_235_814_400 * 4 / 8 / 2**30, rel=0.01)
    # The data set is checked against the model: a vocabulary smaller than the data's fails.
    assert main(["--config", "tiny", "--check", "--run-dir", str(tmp_path), "--set",
                 f"data.path={data_dir}", "--set", "model.vocab_size=128"]) == 2
    assert "model.vocab_size = 128 is smaller" in capsys.readouterr().err
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "compile_cache").exists()


def test_check_fails_when_the_step_does_not_fit_or_a_shard_is_truncated(tmp_path, data_dir,
                                                                        tiny_run, capsys):

    from trainer.main import main

    # The 1B preset on 8 devices needs more than a 1 GiB device: exit 2, naming the parts.
    assert main(["--config", "llama-3.2-1b", "--check", "--device-memory-gib", "1"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"the train step needs about [\d.]+ GiB per device \(parameters [\d.]+, "
                     r"optimizer state [\d.]+, gradients [\d.]+, activations about [\d.]+\) "
                     r"but a device has 1\.00 GiB \(--device-memory-gib\)", err), err
    assert main(["--config", "tiny", "--check", "--device-memory-gib", "16"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["memory_per_device_gib"]["device_limit"] == 16.0
    with pytest.raises(SystemExit):
        main(["--config", "tiny", "--check", "--device-memory-gib", "nan"])
    capsys.readouterr()

    # A shard cut short (a copy that stopped halfway) opens with fewer records than listed.
    copy = tmp_path / "data"
    shutil.copytree(data_dir, copy)
    shard = next(copy.glob("data-00000-*"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    assert main(["--config", "tiny", "--check", "--set", f"data.path={copy}"]) == 2
    err = capsys.readouterr().err
    assert re.search(rf"data shard {re.escape(str(shard))} (holds \d+ records but metadata.json "
                     r"lists \d+|cannot be read \(.*\)): the file is truncated", err), err


def test_a_truncated_or_corrupt_shard_stops_training_in_one_line_naming_it(tmp_path, data_dir,
                                                                          capsys):
    from trainer.main import main

    truncated, corrupt = tmp_path / "truncated", tmp_path / "corrupt"
    shutil.copytree(data_dir, truncated)
    shutil.copytree(data_dir, corrupt)
    cut = next(truncated.glob("data-00000-*"))
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    rotten = next(corrupt.glob("data-00000-*"))
    data = bytearray(rotten.read_bytes())
    data[1000:len(data) // 2] = bytes((b * 7 + 13) % 256 for b in data[1000:len(data) // 2])
    rotten.write_bytes(bytes(data))  # same size, the middle changed: found when read
    for copy, shard in ((truncated, cut), (corrupt, rotten)):
        code = main(["--config", "tiny", "--steps", "3", "--set", f"data.path={copy}",
                     "--run-dir", str(tmp_path / f"run-{copy.name}")])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2, err
        assert err[-1].startswith("error: ") and f"data shard {shard}" in err[-1], err
        assert "prepare the data set again" in err[-1]


def test_deterministic_failures_before_the_first_step_exit_2(tmp_path, data_dir, tiny_run,
                                                             capsys):
    from trainer.main import main

    # A run directory, or its checkpoints directory, that is a regular file.
    as_file = tmp_path / "run-file"
    as_file.write_text("x")
    argv = ["--config", "tiny", "--steps", "2", "--set", f"data.path={data_dir}"]
    assert main([*argv, "--run-dir", str(as_file)]) == 2
    assert f"{as_file} (the run directory) is a regular file" in capsys.readouterr().err
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").write_text("x")
    assert main([*argv, "--run-dir", str(run_dir)]) == 2
    assert "(its checkpoints) is a regular file" in capsys.readouterr().err
    assert not (run_dir / "metrics.jsonl").exists()  # nothing trained
    # A run directory that cannot be created (its parent is a file; as root, mode bits would
    # not stop the write) is one line naming it.
    unwritable = as_file / "run"
    assert main([*argv, "--run-dir", str(unwritable)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"error: run directory {unwritable} cannot be written ({unwritable}: "
                       "Not a directory); give a --run-dir on a writable disk"), err

    # A metadata.json that is not an object, or lacks a field.
    for text, message in (("[1, 2]", "holds a JSON list, not an object"),
                          ('{"format": "x"}', "lacks the field 'seq_len'")):
        bad = tmp_path / f"bad-{len(text)}"
        bad.mkdir()
        (bad / "metadata.json").write_text(text)
        assert main(["--config", "tiny", "--steps", "2", "--set", f"data.path={bad}",
                     "--run-dir", str(tmp_path / f"r-{len(text)}")]) == 2
        assert message in capsys.readouterr().err


def test_an_out_of_memory_while_running_ends_in_one_line_and_exit_2(tmp_path, monkeypatch,
                                                                    capsys):
    # XLA allocates some buffers only when the step runs (CPU does so for every step): such a
    # failure is the same misfit as at compile time, not a crash to restart.
    import trainer.train as train_module
    from trainer.main import main

    def exhausted(*args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1 bytes.\n"
                           "more detail")

    monkeypatch.setattr(train_module, "_loop", exhausted)
    code = main(["--config", "tiny", "--steps", "1", "--run-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "does not fit in device memory while running" in err[0], err
    assert "model.remat" in err[0] and "more detail" not in err[0]


def test_an_out_of_memory_at_compile_time_is_a_config_error_naming_the_fixes():
    from trainer.train import compile_or_explain

    class Program:
        def compile_step(self):
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 123 bytes")

    with pytest.raises(ConfigError, match=r"does not fit in device memory when compiled "
                                          r"\(RESOURCE_EXHAUSTED: .*\); run --check .*"
                                          r"model\.remat"):
        compile_or_explain(Program(), load_config("tiny"))

    class Broken:
        def compile_step(self):
            raise RuntimeError("something else")

    with pytest.raises(RuntimeError, match="something else"):
        compile_or_explain(Broken(), load_config("tiny"))
