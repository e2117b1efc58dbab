"""Hugging Face conversion at full size: time and peak host memory of `trainer.convert from-hf`
and `to-hf` for the llama-3.2-1b layout (random weights, bfloat16 like Meta's release), and the
round trip checked bit for bit.

    .venv/bin/python benchmarks/hf_convert.py [--preset llama-3.2-1b] [--workdir DIR]

A rendered experiment runs each conversion as its own process; the peak resident memory is that
child's own (the rusage wait4 returns for it), reported against the model's size in its
parameter dtype (float32: what the import holds) and in the checkpoint's dtype (bfloat16). The
input is written first with the safetensors library (one model.safetensors, as published). Needs
about 15 GB of disk in WORKDIR. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.new import render_template  # noqa: E402

MAKE_INPUT = r"""
import json, sys
import ml_dtypes, numpy as np
from safetensors.numpy import save_file
from trainer.config import load_config
from trainer.hf.llama import hf_config

preset, out = sys.argv[1], sys.argv[2]
m = load_config(preset).model
d, f, v, h, g, k = m.d_model, m.d_ff, m.vocab_size, m.n_heads, m.kv_heads, m.head_size
shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
for i in range(m.n_layers):
    p = f"model.layers.{i}."
    shapes |= {p + "self_attn.q_proj.weight": (h * k, d), p + "self_attn.k_proj.weight": (g * k, d),
               p + "self_attn.v_proj.weight": (g * k, d), p + "self_attn.o_proj.weight": (d, h * k),
               p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
               p + "mlp.down_proj.weight": (d, f), p + "input_layernorm.weight": (d,),
               p + "post_attention_layernorm.weight": (d,)}
if not m.tie_embeddings:
    shapes["lm_head.weight"] = (v, d)
rng = np.random.default_rng(0)
tensors = {n: (rng.standard_normal(s, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
           for n, s in shapes.items()}
save_file(tensors, f"{out}/model.safetensors", metadata={"format": "pt"})
json.dump(hf_config(m, "bfloat16", {"bos_token_id": 128000, "eos_token_id": 128001}),
          open(f"{out}/config.json", "w"))
print(sum(t.size for t in tensors.values()))
"""

COMPARE = r"""
import sys
import ml_dtypes  # bfloat16 for numpy
from safetensors import safe_open
a, b = sys.argv[1], sys.argv[2]
with safe_open(a, framework="numpy") as x, safe_open(b, framework="numpy") as y:
    missing = sorted(set(x.keys()) ^ set(y.keys()))
    bad = [n for n in x.keys() if n in y.keys()
           and x.get_tensor(n).tobytes() != y.get_tensor(n).tobytes()]
print(len(bad) + len(missing), missing[:5], bad[:5], file=sys.stderr)
print(len(bad) + len(missing))
"""


def run_child(argv: list[str], cwd: Path) -> tuple[float, float, str]:
    """(seconds, peak RSS GiB of exactly this child, its stdout), via wait4's rusage."""
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(argv, cwd=cwd, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        if proc.returncode:
            raise SystemExit(f"{' '.join(argv)} failed: {err.read()[-2000:]}")
        return seconds, usage.ru_maxrss / 2**20, out.read()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--preset", default="llama-3.2-1b")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="hf-convert-") as tmp:
        tmp = Path(tmp)
        exp = render_template("convertbench", tmp)
        src = tmp / "hf"
        src.mkdir()
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", MAKE_INPUT, args.preset, str(src)], cwd=exp,
                             capture_output=True, text=True, check=True).stdout
        params = int(out.strip().splitlines()[-1])
        print(f"wrote {params:,} random bf16 parameters in {time.perf_counter() - t0:.0f}s",
              file=sys.stderr)
        into_s, into_gib, _ = run_child(
            [sys.executable, "-m", "trainer.convert", "from-hf", str(src), "--name",
             f"{args.preset}-bench", "--output", str(tmp / "weights")], exp)
        back_s, back_gib, _ = run_child(
            [sys.executable, "-m", "trainer.convert", "to-hf", str(tmp / "weights"), "--config",
             f"{args.preset}-bench", "--output", str(tmp / "back"),
             "--max-shard-size", "5GB"], exp)
        compared = subprocess.run([sys.executable, "-c", COMPARE, str(src / "model.safetensors"),
                                   str(tmp / "back" / "model.safetensors")], cwd=exp,
                                  capture_output=True, text=True)
        if compared.returncode:
            raise SystemExit(f"comparing the round trip failed: {compared.stderr[-2000:]}")
        bad = compared.stdout.strip()
        f32_gib, bf16_gib = params * 4 / 2**30, params * 2 / 2**30
        result = {
            "preset": args.preset, "params": params,
            "from_hf_s": round(into_s, 1), "from_hf_peak_rss_gib": round(into_gib, 2),
            "to_hf_s": round(back_s, 1), "to_hf_peak_rss_gib": round(back_gib, 2),
            "model_gib_float32": round(f32_gib, 2), "model_gib_bfloat16": round(bf16_gib, 2),
            "from_hf_peak_over_float32_model": round(into_gib / f32_gib, 2),
            "to_hf_peak_over_float32_model": round(back_gib / f32_gib, 2),
            "tensors_differing_after_round_trip": int(bad),
        }
        print(f"from-hf {into_s:.1f}s, peak {into_gib:.2f} GiB; to-hf {back_s:.1f}s, peak "
              f"{back_gib:.2f} GiB; the model is {f32_gib:.2f} GiB in float32, {bf16_gib:.2f} "
              f"GiB in bfloat16; {bad} tensors differ after the round trip", file=sys.stderr)
        print(json.dumps(result))


if __name__ == "__main__":
    main()
