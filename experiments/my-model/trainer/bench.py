"""Sharding benchmark: a stack of MLP layers trained with SGD on random data.

The same experiment as the Multislice guide's `shardings.py` (same flag names), using this
project's mesh and peak tables, so it runs on one slice, on several, and under CPU emulation:

    python -m trainer.bench --ici_fsdp_parallelism 4 --batch_size 131072 --embedding_dimension 2048

As in the guide's script, `--batch_size` is the batch per device: the global batch is
batch_size x the number of devices (of every slice). Each layer is x -> relu(x @ WI) @ WO with
WI: E x 4E and WO: 4E x E. The FLOPs per step are 6 * global batch * parameters (2 forward,
4 backward per weight per example). MFU is against the chip's dense bf16 peak, on CPU against an
f32 matmul timed between steps, and left out for an accelerator the peak table does not know.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trainer.bench", description=__doc__,
                                     allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch_size", type=int, default=131072,
                        help="examples per device (global batch = this x devices)")
    parser.add_argument("--embedding_dimension", type=int, default=2048)
    parser.add_argument("--num_layers", type=int, default=4)
    # -1 fills in the rest: FSDP inside a slice, data parallel across slices by default.
    for group, fill in (("ici", "fsdp"), ("dcn", "data")):
        for axis in ("data", "fsdp", "tensor", "pipeline"):
            parser.add_argument(f"--{group}_{axis}_parallelism", type=int,
                                default=-1 if axis == fill else 1)
    parser.add_argument("--pipeline_microbatches", type=int, default=0,
                        help="pipeline micro-batches per step (0 = the number of stages)")
    parser.add_argument("--pipeline_repeats", type=int, default=1,
                        help="laps of the stage ring (1 = GPipe, R > 1 = circular schedule)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16",
                        help="parameter and activation dtype (use float32 on CPU)")
    return parser


def run_bench(*, batch_size: int, embedding_dimension: int, num_layers: int,
              ici: Sequence[int], dcn: Sequence[int], steps: int, dtype: str,
              pipeline_microbatches: int = 0, pipeline_repeats: int = 1,
              log=print) -> dict[str, Any]:
    """Train the MLP stack for `steps` steps; returns per-device TFLOP/s and MFU.

    `batch_size` is per device, as in the Multislice guide's shardings.py. `ici` and `dcn` are
    (data, fsdp, tensor) or (pipeline, data, fsdp, tensor); with pipeline stages the layers run
    as trainer.pipeline's schedule over `pipeline_microbatches` micro-batches and
    `pipeline_repeats` laps (the random layers are taken to be in stage order). Without stages
    the layers are separate arrays run one after another, as in the guide's script.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from . import pipeline
    from .config import ConfigError, MeshConfig, resolve_mesh
    from .mesh import build_mesh, current_topology
    from .runtime.metrics import matmul_probe, peak_tflops_for_kind

    topology = current_topology()
    ici4 = tuple(ici) if len(ici) == 4 else (1, *ici)
    dcn4 = tuple(dcn) if len(dcn) == 4 else (1, *dcn)
    resolved = resolve_mesh(MeshConfig(*ici4[1:], *dcn4[1:], ici_pipeline=ici4[0],
                                       dcn_pipeline=dcn4[0]), topology)
    emb, hidden = embedding_dimension, 4 * embedding_dimension
    if batch_size < 1:
        raise ConfigError(f"--batch_size {batch_size}: must be >= 1 (examples per device)")
    per_device = batch_size
    batch_size = per_device * topology.num_slices * topology.devices_per_slice
    for name, dim in (("embedding_dimension", emb), ("4*embedding_dimension", hidden)):
        if dim % resolved.fsdp or dim % resolved.tensor:
            raise ConfigError(f"{name} = {dim} must divide by fsdp {resolved.fsdp} and tensor "
                              f"{resolved.tensor}")
    stages = resolved.pipeline
    micro = pipeline_microbatches or stages
    if pipeline_microbatches < 0 or pipeline_repeats < 1 or (stages > 1 and (
            num_layers % (stages * pipeline_repeats) or micro % stages
            or batch_size % (micro * resolved.stage_batch_shards))):
        raise ConfigError(
            f"--pipeline_microbatches {pipeline_microbatches} and --pipeline_repeats "
            f"{pipeline_repeats} with {stages} stage(s), --num_layers {num_layers} and a global "
            f"batch of {batch_size}: repeats must be >= 1, stages x repeats must divide the "
            "layers, the micro-batches (0 = stages) must be a multiple of the stages, and each "
            f"micro-batch must split over the {resolved.stage_batch_shards} data x fsdp shards "
            "of a stage")
    if stages == 1 and (pipeline_microbatches > 1 or pipeline_repeats > 1):
        raise ConfigError(f"--pipeline_microbatches {pipeline_microbatches} / "
                          f"--pipeline_repeats {pipeline_repeats} need "
                          "--ici_pipeline_parallelism or --dcn_pipeline_parallelism > 1")
    schedule = pipeline.Schedule(stages, micro, pipeline_repeats) if stages > 1 else None
    mesh = build_mesh(resolved)
    dt = jnp.dtype(dtype)
    # The rows are split over data and fsdp; every pipeline stage holds its shard's.
    act = NamedSharding(mesh, P(("data", "fsdp"), None))
    rows_hid, rows_act = P(("data", "fsdp"), "tensor"), P(("data", "fsdp"), None)
    # With stages the layers are one stacked array per weight, sharded over `pipeline` and
    # scanned; without, a tuple of separate layers run one after the other (the guide's script
    # does the same): no slicing of a stack, a faster step for a compile time that grows with
    # the layers.
    if schedule is None:
        layers_sharding = tuple({"WI": NamedSharding(mesh, P("fsdp", "tensor")),
                                 "WO": NamedSharding(mesh, P("tensor", "fsdp"))}
                                for _ in range(num_layers))
    else:
        layers_sharding = {"WI": NamedSharding(mesh, P("pipeline", "fsdp", "tensor")),
                           "WO": NamedSharding(mesh, P("pipeline", "tensor", "fsdp"))}

    def init_layers(key):
        k1, k2 = jax.random.split(key)
        stacked = {"WI": 1e-3 * jax.random.normal(k1, (num_layers, emb, hidden), dt),
                   "WO": 1e-3 * jax.random.normal(k2, (num_layers, hidden, emb), dt)}
        if schedule is None:
            return tuple(jax.tree.map(lambda w, i=i: w[i], stacked) for i in range(num_layers))
        return stacked

    def one_layer(x, layer):
        h = jax.lax.with_sharding_constraint(jax.nn.relu(x @ layer["WI"]), rows_hid)
        return jax.lax.with_sharding_constraint(h @ layer["WO"], rows_act), None

    def through_layers(layers, x):
        if isinstance(layers, tuple):
            for layer in layers:
                x = one_layer(x, layer)[0]
            return x
        return jax.lax.scan(one_layer, x, layers)[0]

    def squared(out):
        return jnp.mean(jnp.square(out.astype(jnp.float32)))

    def train_step(x, layers):
        # A squared loss: with a plain sum the output gradient is all ones and XLA folds the
        # last weight gradient into a reduction, doing fewer FLOPs than the count below.
        def loss(params):
            if schedule is None:
                return squared(through_layers(params, x))
            return pipeline.loss(through_layers, params, first=(lambda _, rows: rows, None),
                                 last=(lambda _, out, __: squared(out), None), inputs_BxF=x,
                                 targets_BxF=None, schedule=schedule)

        grads = jax.grad(loss)(layers)
        return jax.tree.map(lambda p, g: p - 1e-4 * g.astype(p.dtype), layers, grads)

    layers = jax.jit(init_layers, out_shardings=layers_sharding)(jax.random.key(0))
    x = jax.jit(lambda k: jax.random.normal(k, (batch_size, emb), dt), out_shardings=act)(
        jax.random.key(1))
    step = jax.jit(train_step, in_shardings=(act, layers_sharding),
                   out_shardings=layers_sharding, donate_argnums=(1,))
    compile_start = time.perf_counter()
    with jax.set_mesh(mesh):
        step = step.lower(x, layers).compile()
    compile_s = time.perf_counter() - compile_start
    device_kind = jax.devices()[0].device_kind
    peak = peak_tflops_for_kind(device_kind)
    on_cpu = jax.devices()[0].platform == "cpu"
    # Off the peak table on CPU, time a matmul after every step: on a shared machine the load
    # changes from second to second, and MFU must compare like with like. An accelerator the
    # table does not know gets no MFU: a CPU-sized matmul says nothing about its peak.
    probe = matmul_probe() if peak is None and on_cpu else None
    layers = step(x, layers)  # compile and warm up
    jax.block_until_ready(layers)
    times, probes = [], []
    for _ in range(steps):
        start = time.perf_counter()
        layers = step(x, layers)
        jax.block_until_ready(layers)
        times.append(time.perf_counter() - start)
        if probe is not None:
            probes.append(probe())
    source = "table"
    if peak is None and probes:
        peak, source = max(probes), "best f32 matmul timed between steps"
    elif peak is None:
        source = "unknown device: not in trainer.runtime.metrics.PEAK_TFLOPS"
    flops = 6 * batch_size * num_layers * 2 * emb * hidden
    step_time = statistics.median(times)
    tflops = flops / step_time / mesh.size / 1e12
    result = {
        "mesh": {"pipeline": resolved.pipeline, "data": resolved.data, "fsdp": resolved.fsdp,
                 "tensor": resolved.tensor},
        "pipeline_microbatches": micro if schedule else None,
        "pipeline_repeats": pipeline_repeats if schedule else None,
        "bubble_fraction": schedule.bubble if schedule else 0.0,
        "num_slices": topology.num_slices,
        "devices": mesh.size,
        "step_time_s": step_time,
        "compile_s": compile_s,
        "batch_size_per_device": per_device,
        "global_batch_size": batch_size,
        "tflops_per_device": tflops,
        "mfu": tflops / peak if peak else None,
        "peak_tflops_per_device": peak,
        "peak_source": source,
        "device_kind": device_kind,
    }
    mfu = f"MFU {100 * tflops / peak:.1f}% (peak {peak:.3g}, {source})" if peak else (
        f"MFU n/a ({device_kind}: {source})")
    stage_text = f"pipeline={stages} (M={micro}, R={pipeline_repeats}) " if schedule else ""
    log(f"mesh {stage_text}data={resolved.data} fsdp={resolved.fsdp} tensor={resolved.tensor} on "
        f"{topology.num_slices} slice(s), batch {per_device} per device ({batch_size} global): "
        f"median step {step_time * 1e3:.1f} ms, {tflops:.4g} TFLOP/s per device, {mfu}; "
        f"compiled in {compile_s:.2f} s")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import json

    from .config import ConfigError
    from .runtime.distributed import DistributedError, initialize

    try:
        initialize()
        import jax

        result = run_bench(
            batch_size=args.batch_size, embedding_dimension=args.embedding_dimension,
            num_layers=args.num_layers,
            ici=(args.ici_pipeline_parallelism, args.ici_data_parallelism,
                 args.ici_fsdp_parallelism, args.ici_tensor_parallelism),
            dcn=(args.dcn_pipeline_parallelism, args.dcn_data_parallelism,
                 args.dcn_fsdp_parallelism, args.dcn_tensor_parallelism),
            steps=args.steps, dtype=args.dtype,
            pipeline_microbatches=args.pipeline_microbatches,
            pipeline_repeats=args.pipeline_repeats,
            log=print if jax.process_index() == 0 else (lambda _: None),
        )
    except (ConfigError, DistributedError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if jax.process_index() == 0:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
