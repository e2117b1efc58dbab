"""Pipeline parallelism on 4 CPU devices: the bubble, compile time in depth, what crosses stages.

    .venv/bin/python benchmarks/pipeline.py [--repeats 5] [--d-model 256] [--n-layers 4]

1. Step time of the template's train step as a GPipe pipeline (2 stages x FSDP 2) over the step
   time of data parallelism on the same 4 devices (data 2 x FSDP 2), for M = S, 2S and 4S
   micro-batches, side by side in every repeat (medians). The GPipe schedule computes M + S - 1
   ticks for M micro-batches, so the expected ratio is (M + S - 1) / M; what remains once that
   is divided out is the pipeline's own overhead (the conveyor, the smaller matmuls of a
   micro-batch, the select at every tick).
2. Compile time (lower + compile) of the pipelined step with 32 layers against 4, S = 2.
3. The collectives of the compiled pipelined step that cross the stage axis, by kind and bytes
   (trainer/collectives.py reads them from the optimized HLO).

The last line printed is one JSON object with all three.
"""

from __future__ import annotations

import os

DEVICES = 4
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split()
     if not f.startswith("--xla_force_host_platform_device_count")]
    + [f"--xla_force_host_platform_device_count={DEVICES}"]
)

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

TEMPLATE_PROJECT = Path(__file__).resolve().parents[1] / "template" / "{{cookiecutter.project_slug}}"
STAGES = 2


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--burst", type=int, default=2, help="steps timed together per repeat")
    parser.add_argument("--compile-layers", type=int, nargs=2, default=(4, 32))
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(TEMPLATE_PROJECT))
    import jax
    from trainer.collectives import collectives, crossing
    from trainer.config import ResolvedMesh, load_config
    from trainer.data import device_batch
    from trainer.mesh import build_mesh
    from trainer.train_step import build_program

    common = [f"model.d_model={args.d_model}", f"model.n_layers={args.n_layers}",
              f"model.seq_len={args.seq_len}", f"train.global_batch_size={args.batch}",
              "model.n_heads=4", f"model.d_ff={4 * args.d_model}", "model.dtype=float32",
              "mesh.dcn_data=1"]
    dp_mesh = build_mesh(ResolvedMesh(ici=(1, 2, 2, 1), dcn=(1, 1, 1, 1)), jax.devices())
    pp_mesh = build_mesh(ResolvedMesh(ici=(STAGES, 1, 2, 1), dcn=(1, 1, 1, 1)), jax.devices())

    def prepared(overrides, mesh):
        config = load_config("tiny", common + overrides)
        program = build_program(config, mesh)
        step = program.compile_step()
        state = program.init()
        batch = device_batch(0, config, program.batch_sharding)
        state, _ = step(state, batch)  # warm up
        jax.block_until_ready(state)
        return {"step": step, "state": state, "batch": batch}

    runs = {"data_parallel": prepared(["mesh.ici_data=2", "mesh.ici_fsdp=2"], dp_mesh)}
    micro_counts = [STAGES, 2 * STAGES, 4 * STAGES]
    for micro in micro_counts:
        runs[f"pipeline_M{micro}"] = prepared(
            [f"mesh.ici_pipeline={STAGES}", "mesh.ici_fsdp=2",
             f"train.pipeline_microbatches={micro}"], pp_mesh)

    times: dict[str, list[float]] = collections.defaultdict(list)
    for repeat in range(args.repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            for _ in range(args.burst):
                run["state"], metrics = run["step"](run["state"], run["batch"])
            jax.block_until_ready(metrics)
            times[name].append((time.perf_counter() - start) / args.burst)
        print(f"repeat {repeat + 1}/{args.repeats}: "
              + ", ".join(f"{n} {times[n][-1] * 1e3:.0f} ms" for n in runs), flush=True)
    dp = statistics.median(times["data_parallel"])
    bubble_table = []
    for micro in micro_counts:
        median = statistics.median(times[f"pipeline_M{micro}"])
        expected = (micro + STAGES - 1) / micro
        bubble_table.append({
            "stages": STAGES, "microbatches": micro,
            "bubble_fraction": round((STAGES - 1) / (micro + STAGES - 1), 4),
            "step_time_ratio": round(median / dp, 3),
            "expected_ratio": round(expected, 3),
            "remaining_overhead": round(median / dp / expected, 3),
        })

    compile_s = {}
    for layers in args.compile_layers:
        config = load_config("tiny", common + [f"model.n_layers={layers}",
                                               f"mesh.ici_pipeline={STAGES}", "mesh.ici_fsdp=2"])
        program = build_program(config, pp_mesh)
        start = time.perf_counter()
        compiled = program.compile_step()
        compile_s[layers] = round(time.perf_counter() - start, 2)
        if layers == args.compile_layers[0]:
            found = crossing(collectives(compiled.as_text(), pp_mesh), "pipeline")
    across = collections.Counter()
    across_bytes = collections.Counter()
    for c in found:
        across[c.kind] += 1
        across_bytes[c.kind] += c.bytes
    result = {
        "devices": DEVICES, "step_time_data_parallel_s": round(dp, 4),
        "bubble_table": bubble_table,
        "compile_s": compile_s,
        "compile_ratio": round(compile_s[args.compile_layers[1]] / compile_s[
            args.compile_layers[0]], 2),
        "across_stage_axis": {kind: {"count": across[kind], "bytes": across_bytes[kind]}
                              for kind in sorted(across)},
    }
    for row in bubble_table:
        print(f"M={row['microbatches']:>2}: pipelined/data-parallel step time "
              f"{row['step_time_ratio']:.3f}, (M+S-1)/M {row['expected_ratio']:.3f}, remaining "
              f"{row['remaining_overhead']:.3f}")
    print(f"compile: {compile_s}")
    print(f"across the stage axis: {result['across_stage_axis']}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
