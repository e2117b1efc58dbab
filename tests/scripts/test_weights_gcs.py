"""Published weights through the production storage path: a Hugging Face checkpoint converted
into the bucket (gs://, on fake-gcs-server), a 2-slice `multislice local` run that starts from it
with train.init_from=gs://..., and its checkpoint exported back to a Hugging Face directory with
the original bits (the learning rate is below float32's resolution, so training changes none)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from scripts.emulators.gcs_emulator import GcsEmulator, serving_bucket
from scripts.local.command import run_local
from scripts.new import render_template

pytestmark = pytest.mark.slow

BUCKET = "ms-weights-test"
HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
      "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu",
      "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
      "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
      "tie_word_embeddings": True, "torch_dtype": "bfloat16"}


def hf_checkpoint(directory: Path) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    d, f, v, k = 64, 128, 256, 16
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (4 * k, d),
                   p + "self_attn.k_proj.weight": (2 * k, d),
                   p + "self_attn.v_proj.weight": (2 * k, d),
                   p + "self_attn.o_proj.weight": (d, 4 * k),
                   p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                   p + "mlp.down_proj.weight": (d, f), p + "input_layernorm.weight": (d,),
                   p + "post_attention_layernorm.weight": (d,)}
    tensors = {n: (rng.normal(size=s) * 0.2 + (len(s) == 1)).astype(ml_dtypes.bfloat16)
               for n, s in shapes.items()}
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(HF))
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return tensors


@pytest.fixture(scope="module")
def gcs() -> Iterator[GcsEmulator]:
    with serving_bucket(BUCKET) as emulator:
        yield emulator


def test_a_run_on_the_bucket_starts_from_converted_weights_and_exports_them_back(
        gcs: GcsEmulator, tmp_path: Path) -> None:
    experiment = render_template("weightsgcs", tmp_path / "experiments")
    tensors = hf_checkpoint(tmp_path / "hf")
    weights = f"gs://{BUCKET}/weights/tiny-llama"

    def trainer_module(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", *argv], cwd=experiment, text=True,
                              capture_output=True, timeout=300, env={**os.environ, **gcs.env})

    done = trainer_module("trainer.convert", "from-hf", str(tmp_path / "hf"), "--name",
                          "tiny-llama", "--output", weights)
    assert done.returncode == 0, done.stderr[-3000:]
    assert gcs.exists(BUCKET, "weights/tiny-llama/weights.json")
    assert (experiment / "configs" / "tiny-llama.toml").exists()

    run_dir = f"gs://{BUCKET}/runs/from-weights"
    sets = ["model.seq_len=32", "train.global_batch_size=8", "optim.learning_rate=1e-30",
            "data.worker_count=0", "checkpoint.save_interval_steps=2",
            f"train.init_from={weights}"]
    code = run_local(experiment=experiment, slices=2, devices_per_slice=2, run_dir=run_dir,
                     log_dir=tmp_path / "logs",
                     trainer_args=["--config", "tiny-llama", "--steps", "2",
                                   *[x for s in sets for x in ("--set", s)]],
                     init_timeout_s=120, stall_timeout_s=240, stop_grace_s=2)
    assert code == 0, (tmp_path / "logs" / "logs" / "slice-0.log").read_text()[-3000:]
    rows = [json.loads(line) for line in
            gcs.get(BUCKET, "runs/from-weights/metrics.jsonl").decode().splitlines()]
    assert [r["init_from"] for r in rows if r["event"] == "fresh_start"] == [weights]

    done = trainer_module("trainer.convert", "to-hf", run_dir, "--config", "tiny-llama",
                          "--dtype", "bfloat16", "--output", str(tmp_path / "back"))
    assert done.returncode == 0, done.stderr[-3000:]
    with safe_open(tmp_path / "back" / "model.safetensors", framework="numpy") as f:
        assert sorted(f.keys()) == sorted(tensors)
        for name, value in tensors.items():
            assert f.get_tensor(name).tobytes() == value.tobytes(), name
