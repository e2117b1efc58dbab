"""The template's `trainer.bench` against MaxText's `pedagogical_examples/shardings.py`.

    .venv/bin/python benchmarks/bench_vs_maxtext.py --maxtext-script PATH/shardings.py \
        [--repeats 5] [--batch-size 256] [--embedding-dimension 512]

Both train the Multislice guide's stack of MLP layers on 4 emulated CPU devices with the same
flags (per-device batch, embedding dimension, 4 layers, bf16), for each mesh of the guide's
table: FSDP 4, tensor 4, data 4, FSDP 2 x tensor 2. Runs alternate (ours, theirs, ours, ...)
so that both see the same load; each reports its own step time (MaxText: the mean of 5 timed
steps after a warm-up; ours: the median of --steps 5 after a warm-up). The result per mesh is
the median over repeats of MaxText's time over ours (> 1: ours is faster), and our compile time.

MaxText's script is not shipped here (give its path). It was written for an older JAX and NumPy;
a copy made in a temporary directory gets four compatibility edits: `np.product` -> `np.prod`,
`jax.tree_map` -> `jax.tree.map`, `with_sharding_constraint` from `jax.lax` instead of
`jax.experimental.pjit`, and no persistent compilation cache in the home directory (neither
side uses one). The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = {
    "fsdp": {"ici_fsdp_parallelism": 4},
    "tensor": {"ici_fsdp_parallelism": 1, "ici_tensor_parallelism": 4},
    "data": {"ici_fsdp_parallelism": 1, "ici_data_parallelism": 4},
    "fsdp2-tensor2": {"ici_fsdp_parallelism": 2, "ici_tensor_parallelism": 2},
}
EDITS = [
    ("np.product(", "np.prod("),
    ("jax.tree_map(", "jax.tree.map("),
    ("from jax.experimental.pjit import with_sharding_constraint",
     "from jax.lax import with_sharding_constraint"),
]


def compatible_copy(script: Path, into: Path) -> Path:
    text = script.read_text()
    for old, new in EDITS:
        text = text.replace(old, new)
    text = re.sub(r"^cc\.initialize_cache\(.*\)$", "", text, flags=re.M)
    copy = into / "shardings.py"
    copy.write_text(text)
    return copy


def flags(case: dict[str, int], args: argparse.Namespace) -> list[str]:
    out = ["--batch_size", str(args.batch_size), "--embedding_dimension",
           str(args.embedding_dimension), "--num_layers", str(args.num_layers)]
    for key, value in case.items():
        out += [f"--{key}", str(value)]
    return out


def run(argv: list[str], cwd: Path) -> str:
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--maxtext-script", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=256, help="per device")
    parser.add_argument("--embedding-dimension", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=4)
    args = parser.parse_args(argv)
    if not args.maxtext_script.is_file():
        parser.error(f"--maxtext-script {args.maxtext_script}: no such file")
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        theirs = compatible_copy(args.maxtext_script.resolve(), work)
        subprocess.run([sys.executable, "-m", "scripts.cli", "new", "bench", "--output-dir",
                        str(work)], cwd=ROOT, check=True, capture_output=True)
        project = work / "bench"
        results = {}
        for name, case in CASES.items():
            ratios, compiles = [], []
            for repeat in range(args.repeats):
                ours = json.loads(run([sys.executable, "-m", "trainer.bench", *flags(case, args),
                                       "--steps", "5", "--dtype", "bfloat16"],
                                      project).strip().splitlines()[-1])
                out = run([sys.executable, str(theirs), *flags(case, args)], work)
                their_time = float(re.search(r"average time: ([\d.eE+-]+)", out).group(1))
                ratios.append(their_time / ours["step_time_s"])
                compiles.append(ours["compile_s"])
                print(f"{name} {repeat + 1}/{args.repeats}: ours {ours['step_time_s'] * 1e3:.1f} "
                      f"ms, MaxText {their_time * 1e3:.1f} ms, ratio {ratios[-1]:.2f}",
                      flush=True)
            results[name] = {"maxtext_over_ours": round(statistics.median(ratios), 3),
                             "ratios": [round(r, 3) for r in ratios],
                             "our_compile_s": round(statistics.median(compiles), 2)}
    for name, row in results.items():
        print(f"{name}: MaxText / ours {row['maxtext_over_ours']:.2f} (median of "
              f"{args.repeats}); our compile {row['our_compile_s']:.2f} s")
    print(json.dumps({"batch_size_per_device": args.batch_size,
                      "embedding_dimension": args.embedding_dimension,
                      "num_layers": args.num_layers, "cases": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
