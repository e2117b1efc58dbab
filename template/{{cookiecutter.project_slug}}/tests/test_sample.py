"""Greedy decoding: with the key/value cache it must produce what the full forward pass produces,
token for token, and the command checks its inputs before loading anything."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trainer.config import load_config
from trainer.model.decode import KVCache, greedy_cached, greedy_uncached
from trainer.model.transformer import TransformerLM
from trainer.sample import main as sample_main


def random_model(*overrides: str) -> TransformerLM:
    # A larger init than training's: random logits sharp enough that greedy choices are stable.
    config = load_config("llama-tiny", ["model.dtype=float32", *overrides])
    model = TransformerLM(config.model, rngs=nnx.Rngs(params=3))
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p: p * 3.0, state))
    return model


@pytest.mark.parametrize("overrides", [
    [],
    ["model.scan_layers=false", "model.n_kv_heads=4"],
    ["model.rope_scaling=llama3", "model.rope_original_max_len=16", "model.tie_embeddings=false"],
], ids=["scanned-gqa", "layer-list-mha", "llama3-rope-untied"])
def test_cached_decoding_matches_the_full_forward_pass_token_for_token(overrides):
    model = random_model(*overrides)
    prompt = [5, 17, 99, 3, 250, 42, 7]
    cached = greedy_cached(model, prompt, 20, 64)
    uncached = greedy_uncached(model, prompt, 20, 64)
    assert cached.ids == uncached.ids
    assert len(set(cached.ids)) > 3  # a real continuation, not one token repeated


def test_one_decode_step_gives_the_logits_of_the_full_forward_pass():
    model = random_model()
    tokens = jnp.asarray([[9, 8, 7, 6, 5, 4, 3, 2]], jnp.int32)
    full = model(tokens)
    # The two paths sum in different orders, so float32 rounding differs by an amount that grows
    # with the logits (up to about 8.5 with this init). Measured: up to 2.1e-5 apart at XLA:CPU
    # optimization level 0 on one CPU model, 1e-5 or less on another; a wrong cache position or
    # mask is off by the logits' own size.
    atol = 1e-5 * float(jnp.abs(full).max())
    attn = model.blocks.attn
    caches = KVCache.zeros(attn.wq_DxHxK.shape[0], 1, 16, attn.wk_DxGxK.shape[-2],
                           attn.wk_DxGxK.shape[-1], jnp.float32)
    prefill, caches = model.decode(tokens[:, :5], jnp.int32(0), caches)
    np.testing.assert_allclose(prefill[0], full[0, :5], rtol=1e-5, atol=atol)
    for position in range(5, 8):
        step, caches = model.decode(tokens[:, position:position + 1], jnp.int32(position),
                                    caches)
        np.testing.assert_allclose(step[0, 0], full[0, position], rtol=1e-5, atol=atol)


def test_decoding_past_the_cache_is_refused_with_the_numbers():
    model = random_model()
    with pytest.raises(ValueError, match=r"prompt \(60 tokens\) \+ max_new_tokens \(10\) = 70 "
                                         r"exceeds the 64 positions"):
        greedy_cached(model, list(range(60)), 10, 64)


def test_the_command_samples_a_trained_run_and_ends_with_the_ids(tmp_path, capsys):
    from trainer.main import main as train_main

    run_dir = tmp_path / "run"
    assert train_main(["--config", "llama-tiny", "--steps", "20", "--run-dir", str(run_dir),
                       "--set", "data.worker_count=0", "--set", "model.seq_len=32",
                       "--set", "train.global_batch_size=8"]) == 0
    capsys.readouterr()
    base = ["--config", "llama-tiny", "--run-dir", str(run_dir), "--set", "model.seq_len=32",
            "--prompt", "the ", "--max-new-tokens", "8"]
    assert sample_main(base) == 0
    out, err = capsys.readouterr()
    lines = out.strip().splitlines()
    ids = json.loads(lines[-1])["ids"]
    assert len(ids) == 8 and lines[0].startswith("the ")  # byte tokenizer: the text is shown
    assert "tokens/s after the first (KV cache" in err
    assert sample_main([*base, "--no-cache", "--one-device"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ids"] == ids


@pytest.mark.parametrize("argv,message", [
    (["--prompt-ids", "1,999"], "--prompt-ids: 999 is not a token of this model "
                                "(model.vocab_size = 256)"),
    (["--prompt-ids", "1,2", "--max-new-tokens", "64"],
     "the prompt (2 tokens) + --max-new-tokens (64) exceed model.seq_len = 64"),
    (["--prompt-ids", "1", "--config", "nope"], "config 'nope' not found"),
    (["--prompt", ""], "--prompt '': the prompt is empty (0 tokens); give at least one token"),
])
def test_bad_inputs_are_one_line_before_any_parameter_is_read(tmp_path, capsys, argv, message):
    base = {"--config": "llama-tiny", "--max-new-tokens": "4"}
    for flag, value in zip(argv[::2], argv[1::2], strict=True):
        base[flag] = value
    args = [x for pair in base.items() for x in pair]
    assert sample_main([*args, "--init-from", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_argument_errors_are_usage_errors(capsys):
    for argv in (["--config", "tiny", "--prompt-ids", "a,b", "--max-new-tokens", "2",
                  "--init-from", "w"],
                 ["--config", "tiny", "--prompt-ids", "1", "--max-new-tokens", "0",
                  "--init-from", "w"],
                 ["--config", "tiny", "--prompt-ids", "1", "--max-new-tokens", "2"]):
        with pytest.raises(SystemExit) as exit_:
            sample_main(argv)
        assert exit_.value.code == 2
    assert "python -m trainer.sample: error:" in capsys.readouterr().err
