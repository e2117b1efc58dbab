"""Checkpoint save blocking, commit and restore time: GCS (an emulator) vs local disk, side by side.

    .venv/bin/python benchmarks/checkpoint_storage.py [--repeats 5] [--mib 64]

One process, the template's own `trainer.runtime.checkpoint.Checkpointer` (async Orbax save of a train
state of MIB mebibytes of float32 plus the data-iterator state and RNG; restore of the newest
step), alternating local disk and `gs://` on fake-gcs-server (started here, reached only through
STORAGE_EMULATOR_HOST / TENSORSTORE_GCS_HTTP_URL) in each repeat, so machine noise hits both alike.
Per storage: the median `blocking_s` (how long `save` held the train loop), commit (the wait for
the async write to be committed) and restore. The ratios are GCS over local. The emulator is a
local process, so its numbers measure the client path (TensorStore's HTTP requests, commit
markers instead of renames), not network bandwidth to real GCS. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.emulators.gcs_emulator import GcsEmulator  # noqa: E402
from scripts.new import render_template  # noqa: E402

CHILD = r"""
import json, sys, time
import jax, jax.numpy as jnp
from trainer.runtime.checkpoint import Checkpointer

run_dir, mib, step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

class Iterator:
    state = {"next_batch": 0}
    def get_state(self): return dict(self.state)
    def set_state(self, state): self.state = dict(state)

n = mib * 2**20 // 4 // 8
state = {f"w{i}": jnp.full((n,), float(i), jnp.float32) for i in range(8)}
ckpt = Checkpointer(run_dir, save_interval_steps=1, max_to_keep=2)
info = ckpt.save(step, state, Iterator(), jax.random.key(0), force=True)
commit = ckpt.wait_until_finished()
abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                        state)
restored = ckpt.restore_latest(abstract, Iterator())
assert restored.step == step and float(restored.state["w3"][0]) == 3.0
ckpt.close()
print(json.dumps({"blocking_s": info.blocking_s, "commit_s": commit,
                  "restore_s": restored.restore_s}))
"""


def run_child(experiment: Path, run_dir: str, mib: int, step: int, env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, run_dir, str(mib), str(step)],
                         cwd=experiment, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"checkpoint child failed on {run_dir}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mib", type=int, default=64, help="size of the saved state")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.mib < 1:
        parser.error(f"--repeats {args.repeats} and --mib {args.mib} must be >= 1")
    results: dict[str, list[dict]] = {"local": [], "gcs": []}
    with tempfile.TemporaryDirectory() as tmp, GcsEmulator() as gcs:
        gcs.create_bucket("bench")
        experiment = render_template("ckptbench", tmp)
        env = {**os.environ, **gcs.env, "JAX_PLATFORMS": "cpu"}
        for repeat in range(args.repeats):
            for kind in ("local", "gcs"):
                run_dir = (f"{tmp}/local-{repeat}" if kind == "local"
                           else f"gs://bench/runs/r{repeat}")
                row = run_child(experiment, run_dir, args.mib, repeat + 1, env)
                results[kind].append(row)
                print(f"repeat {repeat} {kind:5s} " + " ".join(
                    f"{k} {v:.3f}" for k, v in row.items()), flush=True)
    medians = {kind: {k: statistics.median(r[k] for r in rows) for k in rows[0]}
               for kind, rows in results.items()}
    ratios = {k: medians["gcs"][k] / medians["local"][k] for k in medians["local"]}
    for k in ratios:
        print(f"{k}: local {medians['local'][k]:.3f} s, gcs {medians['gcs'][k]:.3f} s, "
              f"gcs/local {ratios[k]:.2f}x")
    print(json.dumps({"mib": args.mib, "repeats": args.repeats, "median_s": medians,
                      "gcs_over_local": ratios}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
