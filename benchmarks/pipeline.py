"""Pipeline parallelism on 4 CPU devices: the bubble, compile time in depth, what crosses stages.

    .venv/bin/python benchmarks/pipeline.py [--repeats 5] [--d-model 256] [--n-layers 4]
        [--unroll-layers 4 0]   # stage blocks unrolled against looped, side by side

1. Step time of the template's train step as a pipeline (2 stages x FSDP 2) over the step time
   of data parallelism on the same 4 devices (data 2 x FSDP 2), for M = S, 2S and 4S
   micro-batches and R = 1 (GPipe) and 2 (circular) repeats, side by side in every repeat
   (medians). The schedule computes R M + S - 1 ticks for R M micro-batch passes of 1/R of the
   layers, so the expected ratio is (R M + S - 1) / (R M); what remains once that is divided out
   is the pipeline's own overhead (the smaller matmuls of a micro-batch, the selects and
   hand-overs of every tick, the embedding and loss computed on every stage).
2. Compile time (lower + compile) of the pipelined step with 32 layers against 4, S = 2.
3. The collectives of each compiled pipelined step that cross the stage axis, by kind, and the
   bytes one device sends across it per step: a permute inside the tick loop runs once a tick
   (tests/collectives.py reads them from the optimized HLO).

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
from typing import Any  # noqa: E402

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
    parser.add_argument("--pipeline-repeats", type=int, nargs="+", default=(1, 2))
    parser.add_argument("--unroll-layers", type=int, nargs="+", default=(4,),
                        help="train.pipeline_unroll_layers values, each run side by side "
                             "(0: every stage block a loop)")
    return parser.parse_args(argv)


def stage_axis_traffic(hlo: str, mesh, ticks: int) -> dict:
    """Collectives across `pipeline` in a compiled step, and the bytes one device sends over
    that axis per step: a permute in the tick loop runs `ticks` times and only its sources send
    (a backward hand-over may be split into several permutes with a share of the pairs each);
    an all-reduce runs once (a ring sends about twice its bytes, counted once here)."""
    from collectives import collectives, crossing

    across = crossing(collectives(hlo, mesh), "pipeline")
    permutes = [c for c in across if c.kind == "collective-permute"]
    reduces = [c for c in across if c.kind == "all-reduce"]
    devices = mesh.devices.size
    sent = sum(c.bytes * ticks * len(c.groups) / devices for c in permutes)
    sent += sum(c.bytes for c in reduces)
    other = sorted({c.kind for c in across} - {"collective-permute", "all-reduce"})
    return {"permutes": len(permutes), "all_reduces": len(reduces), "other_collectives": other,
            "permute_bytes": sorted({c.bytes for c in permutes}),
            "bytes_sent_per_step": int(sent)}


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path[:0] = [str(TEMPLATE_PROJECT), str(TEMPLATE_PROJECT / "tests")]  # tests/collectives.py
    import jax
    from trainer.config import ResolvedMesh, load_config
    from trainer.dataset.loader import device_batch
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
    schedules = [(micro, repeats, unroll) for unroll in args.unroll_layers
                 for repeats in args.pipeline_repeats
                 for micro in (STAGES, 2 * STAGES, 4 * STAGES)]

    def with_unroll(name: Any, unroll: int) -> Any:
        """A run's or compile time's key, which names the unroll setting when several run."""
        return f"{name}_U{unroll}" if len(args.unroll_layers) > 1 else name

    def run_name(micro: int, repeats: int, unroll: int) -> str:
        return with_unroll(f"pipeline_M{micro}_R{repeats}", unroll)

    traffic = {}
    for micro, repeats, unroll in schedules:
        name = run_name(micro, repeats, unroll)
        runs[name] = prepared(
            [f"mesh.ici_pipeline={STAGES}", "mesh.ici_fsdp=2",
             f"train.pipeline_microbatches={micro}", f"train.pipeline_repeats={repeats}",
             f"train.pipeline_unroll_layers={unroll}"],
            pp_mesh)
        traffic[name] = stage_axis_traffic(runs[name]["step"].as_text(), pp_mesh,
                                           ticks=repeats * micro + STAGES - 1)

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
    for micro, repeats, unroll in schedules:
        name = run_name(micro, repeats, unroll)
        median = statistics.median(times[name])
        laps = repeats * micro
        expected = (laps + STAGES - 1) / laps
        bubble_table.append({
            "stages": STAGES, "microbatches": micro, "repeats": repeats,
            "unroll_layers": unroll,
            "bubble_fraction": round((STAGES - 1) / (laps + STAGES - 1), 4),
            "step_time_ratio": round(median / dp, 3),
            "expected_ratio": round(expected, 3),
            "remaining_overhead": round(median / dp / expected, 3),
            **traffic[name],
        })

    compile_s = {}
    for layers in args.compile_layers:
        for unroll in args.unroll_layers:
            config = load_config("tiny", common + [
                f"model.n_layers={layers}", f"mesh.ici_pipeline={STAGES}", "mesh.ici_fsdp=2",
                f"train.pipeline_unroll_layers={unroll}"])
            program = build_program(config, pp_mesh)
            start = time.perf_counter()
            compiled = program.compile_step()
            compile_s[with_unroll(layers, unroll)] = round(time.perf_counter() - start, 2)
            del compiled
    result = {
        "devices": DEVICES, "step_time_data_parallel_s": round(dp, 4),
        "bubble_table": bubble_table,
        "compile_s": compile_s,
        # deepest over shallowest, at the first unroll setting given
        "compile_ratio": round(compile_s[with_unroll(args.compile_layers[1], args.unroll_layers[0])]
                               / compile_s[with_unroll(args.compile_layers[0],
                                                       args.unroll_layers[0])], 2),
    }
    for row in bubble_table:
        print(f"M={row['microbatches']:>2} R={row['repeats']} unroll<={row['unroll_layers']}: "
              f"pipelined/data-parallel step time "
              f"{row['step_time_ratio']:.3f}, (RM+S-1)/(RM) {row['expected_ratio']:.3f}, "
              f"remaining {row['remaining_overhead']:.3f}; across the stage axis "
              f"{row['permutes']} permute(s) and {row['all_reduces']} all-reduce(s), "
              f"{row['bytes_sent_per_step'] / 2**20:.2f} MiB sent per device and step")
    print(f"compile: {compile_s}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
