"""How the template's model scales in depth and sequence length: compile time and memory.

    .venv/bin/python benchmarks/model_scale.py [--repeats 3] [--part depth|remat|attention|all]

depth:      compile time of the train step at 4 and 32 layers (tiny width), scanned and as a
            Python loop; the medians of --repeats fresh compilations each, measured alternately
            so machine noise hits both alike. Reported as the ratio 32-layer / 4-layer.
remat:      compiled temporary memory (XLA's memory analysis, per device) of the train step for
            each model.remat policy, at a size where activations dominate.
attention:  compiled temporary memory of the train step per attention implementation as the
            sequence doubles (the growth factor per doubling: 4 means L x L scores are held).

Nothing here is timed against a threshold; the last line is one JSON object with every number.
"""

from __future__ import annotations

import os

os.environ["JAX_PLATFORMS"] = "cpu"

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

TEMPLATE_PROJECT = Path(__file__).resolve().parents[1] / "template" / "{{cookiecutter.project_slug}}"


def _program(overrides: list[str]):
    import jax
    import jax.numpy as jnp
    from trainer.config import ResolvedMesh, load_config
    from trainer.mesh import build_mesh
    from trainer.train_step import build_program

    config = load_config("tiny", overrides)
    mesh = build_mesh(ResolvedMesh(ici=(1, 1, 1), dcn=(1, 1, 1)), jax.devices()[:1])
    program = build_program(config, mesh)
    batch = jax.ShapeDtypeStruct(program.batch_shape, jnp.int32, sharding=program.batch_sharding)
    return program, batch, mesh


def compile_seconds(overrides: list[str]) -> float:
    import jax

    program, batch, mesh = _program(overrides)
    jax.clear_caches()
    start = time.perf_counter()
    with jax.set_mesh(mesh):
        program.step.lower(program.abstract_state, batch).compile()
    return time.perf_counter() - start


def temp_mib(overrides: list[str]) -> float:
    import jax

    program, batch, mesh = _program(overrides)
    with jax.set_mesh(mesh):
        compiled = program.step.lower(program.abstract_state, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes / 2**20


def depth(repeats: int) -> dict:
    out = {}
    for scan in ("true", "false"):
        times: dict[int, list[float]] = {4: [], 32: []}
        for _ in range(repeats):
            for layers in (4, 32):
                times[layers].append(compile_seconds([f"model.n_layers={layers}",
                                                      f"model.scan_layers={scan}"]))
        medians = {layers: statistics.median(t) for layers, t in times.items()}
        key = "scanned" if scan == "true" else "python_loop"
        out[key] = {"compile_s_4_layers": medians[4], "compile_s_32_layers": medians[32],
                    "ratio_32_over_4": medians[32] / medians[4]}
        print(f"depth ({key}): compile {medians[4]:.2f} s at 4 layers, {medians[32]:.2f} s at 32 "
              f"layers: ratio {medians[32] / medians[4]:.2f}", flush=True)
    return out


def remat() -> dict:
    size = ["model.d_model=256", "model.n_heads=4", "model.d_ff=1024", "model.n_layers=8",
            "model.seq_len=256", "train.global_batch_size=16"]
    out = {}
    for policy in ("none", "save_matmuls", "full"):
        out[policy] = temp_mib([*size, f"model.remat={policy}"])
        print(f"remat={policy}: compiled temp {out[policy]:.1f} MiB", flush=True)
    return out


def attention() -> dict:
    out: dict[str, dict[int, float]] = {}
    for kind in ("dense", "dot_product"):
        out[kind] = {}
        for length in (256, 512, 1024):
            out[kind][length] = temp_mib([f"model.seq_len={length}", f"model.attention={kind}",
                                          "train.global_batch_size=4", "model.n_layers=2",
                                          "model.remat=full"])
        growth = out[kind][1024] / out[kind][512]
        print(f"attention={kind}: compiled temp {out[kind]} MiB by seq_len; x{growth:.2f} from "
              "512 to 1024", flush=True)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--part", choices=("depth", "remat", "attention", "all"), default="all")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(TEMPLATE_PROJECT))
    result = {}
    if args.part in ("depth", "all"):
        result["depth"] = depth(args.repeats)
    if args.part in ("remat", "all"):
        result["remat_temp_mib"] = remat()
    if args.part in ("attention", "all"):
        result["attention_temp_mib"] = attention()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
