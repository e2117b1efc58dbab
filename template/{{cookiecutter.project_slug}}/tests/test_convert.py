"""Hugging Face Llama checkpoints in and out (trainer.convert), built here from random weights
with the safetensors library: no network, no torch.

The reference forward pass below is written from Hugging Face's Llama code (q/k/v/o projections
stored [out, in], `rotate_half` RoPE with the llama3 frequency scaling, RMSNorm, SwiGLU), on the
HF tensors themselves, so it checks the names, the reshapes and the tying independently of
trainer/hf/llama.py. With `transformers` and `torch` installed, the real LlamaForCausalLM is
compared too.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from trainer.config import CONFIG_DIR, load_config
from trainer.hf import convert
from trainer.hf import llama as hf_llama
from trainer.hf.weights import (
    MARKER,
    abstract_params,
    leaves_with_paths,
    open_params,
    set_in,
    with_params,
)
from trainer.main import main as train_main
from trainer.model.rope import Rope

HF_TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
    "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu",
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "bos_token_id": 1,
    "eos_token_id": 2, "attention_bias": False, "mlp_bias": False,
}


def hf_tensors(hf: dict, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    d, f, v = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    h, g, k = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (h * k, d),
                       p + "self_attn.k_proj.weight": (g * k, d),
                       p + "self_attn.v_proj.weight": (g * k, d),
                       p + "self_attn.o_proj.weight": (d, h * k),
                       p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                       p + "mlp.down_proj.weight": (d, f),
                       p + "input_layernorm.weight": (d,),
                       p + "post_attention_layernorm.weight": (d,)})
    if not hf["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, d)
    dtype = ml_dtypes.bfloat16 if hf["torch_dtype"] == "bfloat16" else np.float32
    return {name: (rng.normal(size=shape) * (0.5 if len(shape) == 1 else 0.2)
                   + (1.0 if len(shape) == 1 else 0.0)).astype(dtype)
            for name, shape in shapes.items()}


def write_hf(directory: Path, hf: dict, tensors: dict[str, np.ndarray], shards: int = 1) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(hf))
    (directory / "tokenizer_config.json").write_text('{"model_max_length": 256}')
    names = list(tensors)
    if shards == 1:
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return directory
    weight_map = {}
    for index in range(shards):
        part = names[index::shards]
        file = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return directory


def read_hf(directory: Path) -> dict[str, np.ndarray]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, framework="numpy") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    return out


@pytest.fixture
def preset_name(request):
    """A preset name no other test uses; its configs/NAME.toml is removed afterwards."""
    name = f"hf-test-{request.node.name.split('[')[0][-20:].replace('_', '-')}".lower()
    name += "".join(c for c in request.node.name.split("[")[-1] if c.isalnum())[:10] \
        if "[" in request.node.name else ""
    path = CONFIG_DIR / f"{name}.toml"
    path.unlink(missing_ok=True)
    yield name
    path.unlink(missing_ok=True)


# ---- the reference: Hugging Face's Llama forward pass, in numpy on HF's own tensors ---------

def llama3_inv_freq(hf: dict) -> np.ndarray:
    k = hf["head_dim"]
    inv = 1.0 / hf["rope_theta"] ** (np.arange(0, k, 2) / k)
    s = hf.get("rope_scaling")
    if not s:
        return inv
    old, lo, hi, factor = (s["original_max_position_embeddings"], s["low_freq_factor"],
                           s["high_freq_factor"], s["factor"])
    wavelen = 2 * math.pi / inv
    out = np.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    mid = ~(wavelen < old / hi) & ~(wavelen > old / lo)
    return np.where(mid, (1 - smooth) * out / factor + smooth * out, out)


def hf_forward(hf: dict, t: dict[str, np.ndarray], tokens: np.ndarray) -> np.ndarray:
    w = {n: np.asarray(a, np.float64) for n, a in t.items()}
    h, g, k = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    eps, length = hf["rms_norm_eps"], tokens.shape[1]

    def rms(x, weight):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * weight

    def rotate_half(x):
        return np.concatenate([-x[..., k // 2:], x[..., :k // 2]], -1)

    freqs = np.outer(np.arange(length), llama3_inv_freq(hf))
    emb = np.concatenate([freqs, freqs], -1)
    cos, sin = np.cos(emb)[None, None], np.sin(emb)[None, None]
    x = w["model.embed_tokens.weight"][tokens]
    b = tokens.shape[0]
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        y = rms(x, w[p + "input_layernorm.weight"])
        q = (y @ w[p + "self_attn.q_proj.weight"].T).reshape(b, length, h, k).transpose(0, 2, 1, 3)
        kk = (y @ w[p + "self_attn.k_proj.weight"].T).reshape(b, length, g, k).transpose(0, 2, 1, 3)
        v = (y @ w[p + "self_attn.v_proj.weight"].T).reshape(b, length, g, k).transpose(0, 2, 1, 3)
        q, kk = q * cos + rotate_half(q) * sin, kk * cos + rotate_half(kk) * sin
        kk, v = np.repeat(kk, h // g, 1), np.repeat(v, h // g, 1)
        scores = q @ kk.transpose(0, 1, 3, 2) / math.sqrt(k)
        scores = np.where(np.tril(np.ones((length, length), bool)), scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out = (probs @ v).transpose(0, 2, 1, 3).reshape(b, length, h * k)
        x = x + out @ w[p + "self_attn.o_proj.weight"].T
        y = rms(x, w[p + "post_attention_layernorm.weight"])
        gate, up = y @ w[p + "mlp.gate_proj.weight"].T, y @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    x = rms(x, w["model.norm.weight"])
    head = w["model.embed_tokens.weight"] if hf["tie_word_embeddings"] else w["lm_head.weight"]
    return x @ head.T


def our_logits(name: str, weights_dir: Path, tokens: np.ndarray) -> np.ndarray:
    config = load_config(name, ["model.dtype=float32"])
    source = open_params(str(weights_dir))
    params: dict = {}
    for path, leaf in leaves_with_paths(abstract_params(config.model)):
        set_in(params, path, source.read_host(path, leaf))
    model = with_params(config.model, jax.tree.map(jnp.asarray, params))
    return np.asarray(model(jnp.asarray(tokens)))


# ---- tests ------------------------------------------------------------------------------------

@pytest.mark.parametrize("tied,shards", [(True, 1), (False, 2)], ids=["tied", "untied-sharded"])
def test_imported_weights_compute_what_hugging_face_llama_computes(tmp_path, preset_name,
                                                                   tied, shards):
    hf = {**HF_TINY, "tie_word_embeddings": tied}
    tensors = hf_tensors(hf)
    src = write_hf(tmp_path / "hf", hf, tensors, shards=shards)
    out = tmp_path / "weights"
    assert convert.main(["from-hf", str(src), "--name", preset_name, "--output", str(out)]) == 0
    assert (out / MARKER).exists() and (out / "hf" / "tokenizer_config.json").exists()
    tokens = np.random.default_rng(1).integers(0, 256, size=(2, 24))
    want = hf_forward(hf, tensors, tokens)
    got = our_logits(preset_name, out, tokens)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    # The llama3 scaling is applied: without it the logits differ at this length already.
    plain = load_config(preset_name, ["model.rope_scaling=none"]).model.rope().inv_freq()
    assert not np.allclose(plain, load_config(preset_name).model.rope().inv_freq())


@pytest.mark.parametrize("tied,shards", [(True, 1), (False, 3)], ids=["tied", "untied-sharded"])
def test_import_then_export_gives_back_the_same_tensors_bit_for_bit(tmp_path, preset_name, tied,
                                                                    shards, capsys):
    hf = {**HF_TINY, "tie_word_embeddings": tied}
    tensors = hf_tensors(hf, seed=3)
    src = write_hf(tmp_path / "hf", hf, tensors, shards=shards)
    weights, back = tmp_path / "weights", tmp_path / "back"
    assert convert.main(["from-hf", str(src), "--name", preset_name, "--output",
                         str(weights)]) == 0
    # A shard limit below the model's size: numbered shards and an index, as HF writes them.
    limit = ["--max-shard-size", "64KiB"] if shards > 1 else []
    assert convert.main(["to-hf", str(weights), "--config", preset_name, "--output", str(back),
                         *limit]) == 0
    got = read_hf(back)
    assert sorted(got) == sorted(tensors)
    for name, value in tensors.items():
        assert got[name].dtype == value.dtype, name
        assert got[name].tobytes() == value.tobytes(), name
    files = sorted(p.name for p in back.iterdir())
    if shards > 1:
        index = json.loads((back / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(tensors)
        assert len({*index["weight_map"].values()}) > 1
    else:
        assert "model.safetensors" in files
    config = json.loads((back / "config.json").read_text())
    for key in ("vocab_size", "hidden_size", "num_key_value_heads", "rope_scaling",
                "tie_word_embeddings", "rope_theta", "bos_token_id", "eos_token_id",
                "torch_dtype"):
        assert config[key] == hf[key], key
    assert "tokenizer_config.json" in files
    assert not list(tmp_path.glob("back.partial-*"))


def test_the_llama_3_2_1b_preset_is_what_its_published_config_describes(tmp_path):
    # The published config.json of meta-llama/Llama-3.2-1B (its values, not its weights): the
    # preset must match field by field; 17 of the 32 RoPE frequencies are rescaled.
    published = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
        "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1,
        "bos_token_id": 128000, "eos_token_id": 128001,
    }
    fields = hf_llama.model_fields(published)
    preset = load_config("llama-3.2-1b").model
    for key in hf_llama.ARCHITECTURE_FIELDS:
        assert getattr(preset, key) == fields[key], key
    rope = preset.rope()
    changed = ~np.isclose(rope.inv_freq(), Rope(64, 500000.0).inv_freq(), rtol=0, atol=0)
    assert int(changed.sum()) == 17


def test_an_existing_preset_is_checked_and_every_mismatch_named(tmp_path, preset_name, capsys):
    src = write_hf(tmp_path / "hf", HF_TINY, hf_tensors(HF_TINY))
    (CONFIG_DIR / f"{preset_name}.toml").write_text(
        "[model]\nvocab_size = 256\nd_model = 64\nn_layers = 3\nn_heads = 4\nn_kv_heads = 4\n"
        "d_ff = 192\nmlp = \"swiglu\"\nrope_theta = 500000.0\n")
    code = convert.main(["from-hf", str(src), "--name", preset_name, "--output",
                         str(tmp_path / "w")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    named = {line.split("model.")[1].split(" ")[0] for line in err if " model." in line}
    assert {"n_layers", "n_kv_heads", "rope_scaling", "norm_eps"} <= named, err
    assert err[-1] == (f"error: fix configs/{preset_name}.toml or convert under a new --name")
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("change,message", [
    ({"attention_bias": True}, "attention_bias = true: the model has no biases"),
    ({"hidden_act": "gelu"}, "hidden_act = 'gelu': the model's gated MLP is SwiGLU"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "only rope_type 'llama3'"),
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"},
     "only LlamaForCausalLM (model_type 'llama') can be converted"),
    ({"num_hidden_layers": 0}, "num_hidden_layers = 0: expected a positive integer"),
])
def test_a_config_the_model_cannot_represent_is_one_line_per_field(tmp_path, preset_name,
                                                                   capsys, change, message):
    hf = {**HF_TINY, **change}
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(hf))
    code = convert.main(["from-hf", str(src), "--name", preset_name, "--output",
                         str(tmp_path / "w")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: {src}/config.json: ") and message in err[0], err
    assert not (tmp_path / "w").exists() and not (CONFIG_DIR / f"{preset_name}.toml").exists()


def test_several_unsupported_fields_each_get_their_line(tmp_path, preset_name, capsys):
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({**HF_TINY, "mlp_bias": True,
                                                 "hidden_act": "relu"}))
    assert convert.main(["from-hf", str(src), "--name", preset_name, "--output",
                         str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "hidden_act" in err[0] and "mlp_bias" in err[1], err


@pytest.mark.parametrize("damage,message", [
    ("bias", "tensor model.layers.0.self_attn.q_proj.bias has no place in the model"),
    ("missing", "tensor model.layers.1.mlp.up_proj.weight is missing"),
    ("shape", "tensor model.norm.weight has shape [32], the config needs [64]"),
])
def test_tensors_that_do_not_fit_the_config_are_named_before_anything_is_written(
        tmp_path, preset_name, capsys, damage, message):
    tensors = hf_tensors(HF_TINY)
    if damage == "bias":
        tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(64, ml_dtypes.bfloat16)
    elif damage == "missing":
        del tensors["model.layers.1.mlp.up_proj.weight"]
    else:
        tensors["model.norm.weight"] = np.ones(32, ml_dtypes.bfloat16)
    src = write_hf(tmp_path / "hf", HF_TINY, tensors)
    assert convert.main(["from-hf", str(src), "--name", preset_name, "--output",
                         str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not (tmp_path / "w").exists() and not (CONFIG_DIR / f"{preset_name}.toml").exists()


@pytest.mark.parametrize("damage,message", [
    ("config-fifo", "config.json: not a regular file (a pipe, device or directory)"),
    ("generation-list", "generation_config.json: expected a JSON object, got list"),
    ("tokenizer-truncated", "tokenizer.json: not readable JSON"),
])
def test_model_directory_files_that_are_not_what_the_format_says_are_refused_first(
        tmp_path, preset_name, capsys, damage, message):
    import os

    src = write_hf(tmp_path / "hf", HF_TINY, hf_tensors(HF_TINY))
    if damage == "config-fifo":  # reading it would wait forever for a writer
        (src / "config.json").unlink()
        os.mkfifo(src / "config.json")
    elif damage == "generation-list":
        (src / "generation_config.json").write_text("[1, 2]")
    else:
        (src / "tokenizer.json").write_text('{"version": "1.0", "model": {"vocab": {"a"')
    assert convert.main(["from-hf", str(src), "--name", preset_name, "--output",
                         str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "w").exists() and not (CONFIG_DIR / f"{preset_name}.toml").exists()


def test_a_truncated_safetensors_file_is_one_line_and_writes_nothing(tmp_path, preset_name,
                                                                      capsys):
    src = write_hf(tmp_path / "hf", HF_TINY, hf_tensors(HF_TINY))
    [tensors] = src.glob("*.safetensors")
    tensors.write_bytes(tensors.read_bytes()[: tensors.stat().st_size // 2])
    assert convert.main(["from-hf", str(src), "--name", preset_name, "--output",
                         str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and tensors.name in err[0], err
    assert not (tmp_path / "w").exists() and not (CONFIG_DIR / f"{preset_name}.toml").exists()


def test_damaged_saved_parameters_are_one_line_naming_them_for_export_and_init_from(
        tmp_path, preset_name, capsys):
    src = write_hf(tmp_path / "hf", HF_TINY, hf_tensors(HF_TINY))
    weights = tmp_path / "weights"
    assert convert.main(["from-hf", str(src), "--name", preset_name, "--output",
                         str(weights)]) == 0
    capsys.readouterr()
    # the largest data file of the saved parameters, cut in half (a copy that stopped midway)
    data = max((p for p in (weights / "params").rglob("*") if p.is_file()),
               key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    assert convert.main(["to-hf", str(weights), "--config", preset_name, "--output",
                         str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot read the saved parameters" in err[0], err
    assert str(weights) in err[0] and not (tmp_path / "out").exists()
    code = run_trainer(tmp_path / "run", f"train.init_from={weights}", "model.seq_len=32",
                       "train.global_batch_size=8", config=preset_name)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "cannot read the saved parameters" in err[0], err


def test_bad_arguments_and_outputs_are_refused_before_anything_is_written(tmp_path, preset_name,
                                                                          capsys):
    src = write_hf(tmp_path / "hf", HF_TINY, hf_tensors(HF_TINY))
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    cases = [
        (["from-hf", str(tmp_path / "nope"), "--name", preset_name, "--output", "o"],
         "does not exist"),
        (["from-hf", str(src), "--name", "Bad Name", "--output", "o"], "--name 'Bad Name'"),
        (["from-hf", str(src), "--name", preset_name, "--output", str(busy)],
         f"--output {busy}: is not empty (holds keep.txt)"),
        (["from-hf", str(src), "--name", preset_name, "--output",
          str(busy / "keep.txt" / "weights")],
         f"{busy / 'keep.txt'} is a file, so no directory can be made under it"),
        (["to-hf", str(tmp_path / "nowhere"), "--config", "llama-tiny", "--output", "x"],
         "it is not a weights directory"),
    ]
    for argv, message in cases:
        assert convert.main(argv) == 2, argv
        assert message in capsys.readouterr().err
    assert (busy / "keep.txt").read_text() == "mine"
    for bad in (["to-hf", "x", "--config", "c", "--output", "y", "--max-shard-size", "lots"],
                ["to-hf", "x", "--config", "c", "--output", "y", "--step", "-1"]):
        with pytest.raises(SystemExit) as exit_:
            convert.main(bad)
        assert exit_.value.code == 2
    capsys.readouterr()


def run_trainer(run_dir: Path, *overrides: str, steps: int = 2, config: str = "tiny") -> int:
    sets = [x for o in ("data.worker_count=0", "checkpoint.save_interval_steps=2", *overrides)
            for x in ("--set", o)]
    return train_main(["--config", config, "--steps", str(steps), "--run-dir", str(run_dir),
                       *sets])


def test_a_run_starts_from_init_from_and_its_resume_ignores_it(tmp_path, preset_name, capsys):
    tensors = hf_tensors(HF_TINY)
    src = write_hf(tmp_path / "hf", HF_TINY, tensors)
    generation = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}
    (src / "generation_config.json").write_text(json.dumps(generation))
    weights = tmp_path / "weights"
    assert convert.main(["from-hf", str(src), "--name", preset_name, "--output",
                         str(weights)]) == 0
    preset = (CONFIG_DIR / f"{preset_name}.toml").read_text()
    assert str(tmp_path) not in preset  # meant to be committed: no path of this machine
    run_dir = tmp_path / "run"
    # A learning rate far below float32's resolution (0 is refused): the step-2 checkpoint holds
    # exactly the imported weights, so its export gives back Hugging Face's bits.
    sets = ("train.global_batch_size=8", "model.seq_len=32", "optim.learning_rate=1e-30",
            f"train.init_from={weights}")
    assert run_trainer(run_dir, *sets, config=preset_name) == 0, capsys.readouterr().err
    assert f"starting fresh at step 0 from the parameters in {weights}" in capsys.readouterr().out
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["event"] == "step"][0] == 1
    back = tmp_path / "back"
    assert convert.main(["to-hf", str(run_dir), "--config", preset_name, "--dtype", "bfloat16",
                         "--output", str(back)]) == 0
    got = read_hf(back)
    assert all(got[n].tobytes() == v.tobytes() for n, v in tensors.items())
    # The fine-tune gives back what it was given: token ids, generation config, and the dtype it
    # was imported with when --dtype is not said; every file readable as any other output.
    again = tmp_path / "again"
    capsys.readouterr()
    assert convert.main(["to-hf", str(run_dir), "--config", preset_name, "--output",
                         str(again)]) == 0
    assert f"started from {weights}: carrying its bos_token_id, eos_token_id and " \
        "tokenizer_config.json, generation_config.json" in capsys.readouterr().out
    exported = json.loads((again / "config.json").read_text())
    assert (exported["bos_token_id"], exported["eos_token_id"], exported["torch_dtype"]) == \
        (1, 2, "bfloat16")
    # the tensors are what config.json says they are (the run trained in float32)
    assert {str(t.dtype) for t in read_hf(again).values()} == {"bfloat16"}
    assert json.loads((again / "generation_config.json").read_text()) == generation
    modes = {f.name: f.stat().st_mode & 0o777 for f in again.iterdir()}
    assert len(set(modes.values())) == 1 and modes["model.safetensors"] & 0o044, modes
    # Imported again under the same preset: it matches; a float32 export is another dtype.
    float32 = tmp_path / "float32"
    assert convert.main(["to-hf", str(run_dir), "--config", preset_name, "--dtype", "float32",
                         "--output", str(float32)]) == 0
    capsys.readouterr()
    assert convert.main(["from-hf", str(float32), "--name", preset_name, "--output",
                         str(tmp_path / "w32")]) == 0
    out = capsys.readouterr().out
    assert f"configs/{preset_name}.toml matches the architecture" in out
    assert "computes in model.dtype = 'bfloat16'" in out and "makes it 'float32'" in out, out
    # A random start of the same model is another model entirely.
    assert run_trainer(tmp_path / "fresh", *sets[:-1], config=preset_name) == 0
    fresh = [json.loads(x) for x in (tmp_path / "fresh" / "metrics.jsonl").read_text()
             .splitlines()]
    first = next(r["loss"] for r in rows if r["event"] == "step")
    assert abs(next(r["loss"] for r in fresh if r["event"] == "step") - first) > 0.1
    # Resumed from its own checkpoint: init_from is not read again (here it no longer exists).
    shutil.rmtree(weights)
    capsys.readouterr()
    assert run_trainer(run_dir, *sets, steps=4, config=preset_name) == 0, capsys.readouterr().err
    assert "at checkpoint step 2 from " in capsys.readouterr().out


def test_init_from_of_another_shape_or_an_unfinished_conversion_is_one_line(tmp_path, preset_name,
                                                                          capsys):
    src = write_hf(tmp_path / "hf", HF_TINY, hf_tensors(HF_TINY))
    weights = tmp_path / "weights"
    assert convert.main(["from-hf", str(src), "--name", preset_name, "--output",
                         str(weights)]) == 0
    capsys.readouterr()
    # llama-tiny has 2 key/value heads of 16 too, but a d_ff of 192 and vocab 256: same shapes;
    # change the width to make them differ.
    code = run_trainer(tmp_path / "run", f"train.init_from={weights}", "model.d_ff=128",
                       config=preset_name)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"train.init_from={weights}: blocks/mlp/w_gate_DxF has shape (2, 64, 192) there and " \
           "(2, 64, 128) in this model" in err[0], err
    (weights / MARKER).unlink()  # a conversion that stopped before its marker
    code = run_trainer(tmp_path / "run2", f"train.init_from={weights}", config=preset_name)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "its conversion did not finish" in err[-1], err


def test_a_trained_run_exports_with_its_tokenizer_and_step(tmp_path, capsys):
    from trainer.dataset.prepare import main as prepare_main

    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 400)
    data = tmp_path / "data"
    assert prepare_main(["--output", str(data), "--input", str(text), "--tokenizer", "bpe",
                         "--vocab-size", "300", "--seq-len", "32"]) == 0
    run_dir = tmp_path / "run"
    assert run_trainer(run_dir, f"data.path={data}", "model.vocab_size=300", "model.seq_len=32",
                       "train.global_batch_size=8", "eval.num_batches=0", steps=4,
                       config="llama-tiny") == 0, capsys.readouterr().err
    capsys.readouterr()
    out = tmp_path / "hf-out"
    sets_preset = tmp_path / "preset.toml"
    sets_preset.write_text("[model]\nvocab_size = 300\nseq_len = 32\n")
    # --config takes a preset name or a .toml path: the run's own model section.
    merged = CONFIG_DIR / "llama-tiny.toml"
    sets_preset.write_text(merged.read_text().replace("seq_len = 64", "seq_len = 32")
                           .replace("[model]", "[model]\nvocab_size = 300", 1))
    assert convert.main(["to-hf", str(run_dir), "--step", "2", "--config", str(sets_preset),
                         "--output", str(out)]) == 0, capsys.readouterr().err
    assert (out / "tokenizer.json").exists()
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["source"] == f"run {run_dir} step 2" and result["dtype"] == "float32"
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 300 and config["rope_scaling"] is None
    assert convert.main(["to-hf", str(run_dir), "--step", "3", "--config", str(sets_preset),
                         "--output", str(tmp_path / "o2")]) == 2
    assert "--step 3: " in capsys.readouterr().err


def test_hugging_face_transformers_loads_the_export_and_agrees(tmp_path, preset_name):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    hf = {**HF_TINY, "torch_dtype": "float32", "tie_word_embeddings": False}
    tensors = hf_tensors(hf, seed=5)
    src = write_hf(tmp_path / "hf", hf, tensors)
    weights, back = tmp_path / "weights", tmp_path / "back"
    assert convert.main(["from-hf", str(src), "--name", preset_name, "--output",
                         str(weights)]) == 0
    assert convert.main(["to-hf", str(weights), "--config", preset_name, "--output",
                         str(back)]) == 0
    model = transformers.LlamaForCausalLM.from_pretrained(str(back), torch_dtype=torch.float32)
    tokens = np.random.default_rng(2).integers(0, 256, size=(2, 20))
    with torch.no_grad():
        theirs = model(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(our_logits(preset_name, weights, tokens), theirs,
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("argv", [
    ["to-hf", "gs://no-endpoint/runs/x", "--config", "tiny", "--output", "{tmp}/hf"],
    ["random-hf", "--config", "llama-tiny", "--output", "gs://no-endpoint/hf"],
], ids=["to-hf from gs", "random-hf to gs"])
def test_a_gs_path_without_a_reachable_storage_endpoint_is_one_line_exit_2(
        argv, tmp_path, monkeypatch, capsys):
    # Nothing listens on port 1 of loopback: the endpoint refuses every connection.
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:1")
    assert convert.main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "the storage endpoint http://127.0.0.1:1 is not reachable" in err[0], err


def test_to_hf_refuses_a_parameter_tree_it_cannot_map_in_one_line(monkeypatch):
    # A fork's model with a layer of its own (a router here) and one without the final norm:
    # neither may export silently without them, nor end in a KeyError traceback.
    from trainer.hf import weights

    model = load_config("llama-tiny").model
    convert.check_mappable(model)  # the dense model maps both ways
    real = weights.abstract_params

    def with_router(m):
        tree = real(m)
        return {**tree, "blocks": {**tree["blocks"], "router_DxE": tree["final_norm"]["scale"]}}

    monkeypatch.setattr(weights, "abstract_params", with_router)
    with pytest.raises(convert.ConvertError) as caught:
        convert.check_mappable(model)
    assert str(caught.value).startswith("1 parameter(s) of this model have no Hugging Face "
                                        "name: blocks/router_DxE; to-hf writes the dense Llama "
                                        "layout")
    assert "\n" not in str(caught.value)

    def without_norm(m):
        return {k: v for k, v in real(m).items() if k != "final_norm"}

    monkeypatch.setattr(weights, "abstract_params", without_norm)
    with pytest.raises(convert.ConvertError, match=r"^this model has no parameter "
                                                   r"'final_norm/scale', which the Hugging Face"):
        convert.check_mappable(model)
