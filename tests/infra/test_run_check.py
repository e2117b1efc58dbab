"""Preview refuses a launch spec whose model cannot restore the run's checkpoints: the run check's
provider reads the newest complete checkpoint's recorded model from the bucket with the real
google-cloud-storage client, against fake-gcs-server (STORAGE_EMULATOR_HOST)."""

from __future__ import annotations

import json

import pytest

from infra.preview.run_check import RunCheckProvider, model_shape
from scripts.emulators.gcs_emulator import GcsEmulator

BUCKET = "my-proj-ms-dev"
DEFAULT = {"vocab_size": 256, "d_model": 768, "n_layers": 12, "n_heads": 12, "d_ff": 3072,
           "dtype": "bfloat16", "seq_len": 1024}


@pytest.fixture(scope="module")
def gcs():
    with GcsEmulator() as emulator, pytest.MonkeyPatch.context() as patch:
        for key, value in emulator.env.items():
            patch.setenv(key, value)
        emulator.create_bucket(BUCKET)
        yield emulator


def _checkpoint(gcs: GcsEmulator, run: str, step: int, model: dict | None,
                committed: bool = True) -> None:
    base = f"{run}/checkpoints/{step}"
    meta = {"version": 1, "step": step, **({"model": model} if model is not None else {})}
    gcs.put(BUCKET, f"{base}/meta/metadata", json.dumps(meta).encode())
    gcs.put(BUCKET, f"{base}/state/_METADATA", b"{}")
    if committed:
        gcs.put(BUCKET, f"{base}/commit_success.txt", b"Checkpoint commit was successful")


def _check(run: str, model: dict, bucket: str = BUCKET) -> list[str]:
    props = {"project": "my-proj", "bucket": bucket, "run_prefix": run,
             "model_shape": model_shape(model)}
    return [f.reason for f in RunCheckProvider().check({}, props).failures]


def test_a_new_model_shape_on_a_run_with_checkpoints_is_one_line_at_preview(gcs):
    _checkpoint(gcs, "runs/dev", 200, DEFAULT)
    _checkpoint(gcs, "runs/dev", 400, DEFAULT)
    tiny = {**DEFAULT, "d_model": 64, "n_layers": 2}
    (problem,) = _check("runs/dev", tiny)
    assert problem == (
        "multislice:trainer: the model's shape changes (d_model 768 -> 64, n_layers 12 -> 2), "
        "but gs://my-proj-ms-dev/runs/dev holds the old model's checkpoints (newest: step 400), "
        "which the new one cannot restore: every trainer would stop on them; set a new "
        "multislice:run_name (the old run keeps its checkpoints)")
    # runtime settings (precision, sequence length under RoPE) restore fine
    assert _check("runs/dev", {**DEFAULT, "dtype": "float32", "seq_len": 2048}) == []


def test_nothing_to_refuse_without_a_complete_checkpoint_that_recorded_its_model(gcs):
    tiny = {**DEFAULT, "d_model": 64}
    assert _check("runs/fresh", tiny) == []                 # a new run_name: nothing there
    assert _check("runs/dev", tiny, bucket="not-made-yet") == []  # the first preview
    _checkpoint(gcs, "runs/old", 10, None)                  # from before checkpoints said
    assert _check("runs/old", tiny) == []
    _checkpoint(gcs, "runs/cut", 20, DEFAULT)
    _checkpoint(gcs, "runs/cut", 30, tiny, committed=False)  # an interrupted save of the new
    (problem,) = _check("runs/cut", tiny)                    # one is never restored: 20 is
    assert "(newest: step 20)" in problem


def test_a_model_summary_is_asked_once_until_the_experiments_code_changes(tmp_path,
                                                                          monkeypatch):
    import os

    from infra.packaging import experiment as exp_module
    from tests.infra.conftest import make_full_experiment

    exp = make_full_experiment(tmp_path)
    asked = []
    real = exp_module._ask_model_summary
    monkeypatch.setattr(exp_module, "_ask_model_summary",
                        lambda *args: asked.append(args) or real(*args))
    first = exp_module.model_summary(exp, "tiny", [])
    first["model"]["d_model"] = -1  # the caller's copy: the kept answer is not changed
    assert exp_module.model_summary(exp, "tiny", [])["model"]["d_model"] == 64
    assert len(asked) == 1
    preset = exp / "configs" / "tiny.toml"
    preset.write_text(preset.read_text().replace("d_model = 64", "d_model = 32"))
    os.utime(preset, ns=(preset.stat().st_atime_ns, preset.stat().st_mtime_ns + 10**9))
    assert exp_module.model_summary(exp, "tiny", [])["model"]["d_model"] == 32
    assert len(asked) == 2


def test_without_a_model_shape_no_bucket_is_asked(monkeypatch):
    from infra.preview import run_check

    monkeypatch.setattr(run_check, "storage_client",
                        lambda project: pytest.fail("a storage client was made"))
    props = {"project": "p", "bucket": BUCKET, "run_prefix": "runs/dev", "model_shape": None}
    assert run_check.RunCheckProvider().check({}, props).failures == []
