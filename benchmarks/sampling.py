"""Greedy decoding tokens/s with the key/value cache against without it, side by side on CPU.

    .venv/bin/python benchmarks/sampling.py [--repeats 3] [--new-tokens 64] [--prompt 64]
        [--set model.d_model=256 ...]

A rendered experiment's own `trainer.model.decode` on a randomly initialised llama-tiny (by default
widened to d_model 256, 4 layers, seq_len 512, one device, float32): each repeat runs the cached
decode and the uncached reference (the full forward pass over the padded prefix for every token)
one after the other, after a warm-up of both that pays the compilations. Reports the median
tokens/s after the first token of each, their ratio, and whether both produced the same tokens.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.new import render_template  # noqa: E402

CHILD = r"""
import json, statistics, sys
import jax
from flax import nnx
from trainer.config import load_config
from trainer.model.decode import greedy_cached, greedy_uncached
from trainer.model.transformer import TransformerLM

repeats, new, prompt_len, overrides = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
config = load_config("llama-tiny", overrides)
model = TransformerLM(config.model, rngs=nnx.Rngs(params=0))
prompt = [(7 * i + 3) % config.model.vocab_size for i in range(prompt_len)]
length = config.model.seq_len
greedy_cached(model, prompt, 4, length)      # compile both programs of each
greedy_uncached(model, prompt, 4, length)
cached, uncached = [], []
for _ in range(repeats):
    a = greedy_cached(model, prompt, new, length)
    b = greedy_uncached(model, prompt, new, length)
    cached.append(a.tokens_per_s)
    uncached.append(b.tokens_per_s)
print(json.dumps({"cached_tokens_per_s": statistics.median(cached),
                  "uncached_tokens_per_s": statistics.median(uncached),
                  "same_tokens": a.ids == b.ids, "seq_len": length,
                  "params": sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))),
                  "device": jax.devices()[0].device_kind}))
"""

DEFAULTS = ["model.d_model=256", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=2",
            "model.d_ff=768", "model.seq_len=512", "model.dtype=float32"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=64, help="prompt length in tokens")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sampling-") as tmp:
        exp = render_template("samplebench", Path(tmp))
        done = subprocess.run(
            [sys.executable, "-c", CHILD, str(args.repeats), str(args.new_tokens),
             str(args.prompt), *DEFAULTS, *args.overrides],
            cwd=exp, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        if done.returncode:
            raise SystemExit(done.stderr[-3000:])
        result = json.loads(done.stdout.strip().splitlines()[-1])
    result["cache_speedup"] = round(result["cached_tokens_per_s"]
                                    / result["uncached_tokens_per_s"], 2)
    result.update(new_tokens=args.new_tokens, prompt=args.prompt, repeats=args.repeats)
    print(f"KV cache {result['cached_tokens_per_s']:.1f} tokens/s, full forward pass "
          f"{result['uncached_tokens_per_s']:.1f} tokens/s: {result['cache_speedup']}x "
          f"({result['params']:,} params, seq_len {result['seq_len']}, same tokens: "
          f"{result['same_tokens']})", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
