"""Template train step FLOP/s against a plain sharded matmul, side by side on 4 CPU devices.

    .venv/bin/python benchmarks/train_step.py [--mesh fsdp|data|tensor] [--repeats 5]
                                              [--remat none|full|save_matmuls|all]

The model is the template's default architecture (RoPE, GELU MLP, scanned layers, tied
embeddings) at a CPU size. `--remat all` measures each remat policy in turn and reports its
ratio and compiled temporary memory next to `none`. Both workloads use the same 4 devices and float32. Each repeat times a burst of train steps and
then a burst of matmuls, so machine noise hits both alike; the medians are compared. Train step
FLOPs come from the template's analytic count (model.flops_per_token). The last line printed
is one JSON object with step_flops_per_s, matmul_flops_per_s and ratio.
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
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

TEMPLATE_PROJECT = Path(__file__).resolve().parents[1] / "template" / "{{cookiecutter.project_slug}}"
MESHES = {"data": (DEVICES, 1, 1), "fsdp": (1, DEVICES, 1), "tensor": (1, 1, DEVICES)}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mesh", choices=sorted(MESHES), default="data")
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--d-ff", type=int, default=2048)
    parser.add_argument("--n-layers", type=int, default=2)
    parser.add_argument("--n-heads", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--matmul-size", type=int, default=1024,
                        help="per-device matmul is (size x size) @ (size x size)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--burst", type=int, default=2, help="calls timed together per repeat")
    parser.add_argument("--remat", choices=("none", "full", "save_matmuls", "all"), default="none")
    parser.add_argument("--mlp", choices=("gelu", "swiglu"), default="gelu")
    parser.add_argument("--attention", choices=("dense", "dot_product"), default="dense")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="any other config override")
    return parser.parse_args(argv)


def timed_burst(fn: Callable[[], object], burst: int) -> float:
    import jax

    start = time.perf_counter()
    out = None
    for _ in range(burst):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / burst


def measure(args: argparse.Namespace, remat: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from trainer.config import ResolvedMesh, load_config
    from trainer.dataset.loader import device_batch
    from trainer.mesh import build_mesh
    from trainer.model.transformer import flops_per_token, param_count
    from trainer.train_step import build_program

    assert len(jax.devices()) == DEVICES, jax.devices()
    config = load_config("tiny", [
        f"model.d_model={args.d_model}", f"model.d_ff={args.d_ff}",
        f"model.n_layers={args.n_layers}", f"model.n_heads={args.n_heads}",
        f"model.seq_len={args.seq_len}", f"train.global_batch_size={args.batch}",
        f"model.remat={remat}", f"model.mlp={args.mlp}", f"model.attention={args.attention}",
        *args.overrides,
    ])
    mesh = build_mesh(ResolvedMesh(ici=MESHES[args.mesh], dcn=(1, 1, 1)))
    program = build_program(config, mesh)
    step = program.compile_step()
    state = program.init()
    batch = device_batch(0, config, program.batch_sharding)
    step_flops = flops_per_token(config.model) * args.batch * args.seq_len
    cost = step.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    xla_flops_per_device = float((cost or {}).get("flops", float("nan")))
    temp_bytes = step.memory_analysis().temp_size_in_bytes

    def run_step():
        nonlocal state
        state, metrics = step(state, batch)
        return metrics["loss"]

    n = args.matmul_size
    flat = Mesh(np.asarray(jax.devices()), ("d",))
    rows = NamedSharding(flat, PartitionSpec("d"))
    a = jax.device_put(jnp.ones((DEVICES * n, n), jnp.float32), rows)
    b = jax.device_put(jnp.ones((n, n), jnp.float32), NamedSharding(flat, PartitionSpec()))
    matmul = jax.jit(lambda x, y: x @ y, out_shardings=rows)
    matmul_flops = 2 * DEVICES * n**3

    run_step()
    jax.block_until_ready(matmul(a, b))  # warm up both
    step_times, matmul_times = [], []
    for _ in range(args.repeats):
        step_times.append(timed_burst(run_step, args.burst))
        matmul_times.append(timed_burst(lambda: matmul(a, b), args.burst))
    step_rate = step_flops / statistics.median(step_times)
    matmul_rate = matmul_flops / statistics.median(matmul_times)
    return {
        "mesh": args.mesh,
        "devices": DEVICES,
        "params": param_count(config.model),
        "model": {"d_model": args.d_model, "d_ff": args.d_ff, "n_layers": args.n_layers,
                  "n_heads": args.n_heads, "seq_len": args.seq_len, "batch": args.batch,
                  "mlp": args.mlp, "attention": args.attention, "remat": remat},
        "step_time_s": statistics.median(step_times),
        "step_flops": step_flops,
        "step_flops_per_s": step_rate,
        # Cross-check of the analytic count: XLA's own count for one device's partition. It
        # includes recomputation under remat and the masked half of dense attention, and counts
        # the body of a while loop once: with scanned layers it sees one layer, not n_layers.
        "analytic_flops_per_device": step_flops / DEVICES,
        "xla_flops_per_device": xla_flops_per_device,
        "temp_bytes_per_device": temp_bytes,
        "matmul_size": n,
        "matmul_flops_per_s": matmul_rate,
        "ratio": step_rate / matmul_rate,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(TEMPLATE_PROJECT))
    policies = ("none", "save_matmuls", "full") if args.remat == "all" else (args.remat,)
    results = []
    for remat in policies:
        result = measure(args, remat)
        results.append(result)
        print(f"remat={remat}: train step {result['step_flops_per_s'] / 1e9:.2f} GFLOP/s vs "
              f"sharded matmul {result['matmul_flops_per_s'] / 1e9:.2f} GFLOP/s on {DEVICES} "
              f"CPU devices ({args.mesh} mesh): ratio {result['ratio']:.2f}, compiled temp "
              f"{result['temp_bytes_per_device'] / 2**20:.1f} MiB per device", flush=True)
    print(json.dumps(results[0] if len(results) == 1 else results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
