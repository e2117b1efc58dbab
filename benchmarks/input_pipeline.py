"""Data pipeline tokens/s over what the train step consumes (headroom), tiny and default configs.

    .venv/bin/python benchmarks/input_pipeline.py [--configs tiny default] [--repeats 5]
                                                 [--batches 20] [--cpu-step tiny] [--mfu 1.0]
                                                 [--worker-count N]

For each config: the synthetic corpus is prepared at the config's seq_len, and the template's
Grain pipeline (`input_pipeline.make_iterator`, the config's data.worker_count and prefetch, unless
--worker-count is given) reads whole global batches in this one process; tokens/s counts
global_batch_size x seq_len per batch, as the trainer does. The first two batches (worker
start-up) are not timed; each measurement runs for --batches batches and at least three seconds.

What the step consumes:
  - configs named in --cpu-step (default: tiny, the CPU demo config) are measured here: the
    template's compiled train step on 4 CPU devices, timed in the same repeat as the pipeline
    (alternating), so machine noise hits both alike;
  - for every config, what one TPU host would consume at --mfu of peak: 4 chips per host x the
    generation's bf16 peak x mfu / the model's training FLOPs per token (infra.stack_config.topology's v4, v5e,
    v5p, v6e). With the default --mfu 1.0 this is an upper bound: a pipeline above it can never
    be the bottleneck on that host.
Headroom = pipeline tokens/s / step tokens/s (> 1: the pipeline keeps up). Medians over the
repeats. Note that this machine's CPUs are not a TPU host's. The last line printed is one JSON
object.
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
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
CHIPS_PER_HOST = 4
WARMUP_BATCHES = 2
MIN_TIMED_S = 3.0  # per pipeline measurement, so a fast pipeline is not timed on a blip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["tiny", "default"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, default=20, help="timed batches per repeat")
    parser.add_argument("--cpu-step", nargs="*", default=["tiny"],
                        help="configs whose train step is measured on this CPU")
    parser.add_argument("--mfu", type=float, default=1.0,
                        help="fraction of TPU peak for the per-host consumption (default 1.0)")
    parser.add_argument("--worker-count", type=int, default=None,
                        help="override data.worker_count (default: each config's own)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.batches < 1 or not 0 < args.mfu <= 1:
        parser.error(f"--repeats {args.repeats} and --batches {args.batches} must be >= 1 and "
                     f"--mfu {args.mfu} in (0, 1]")
    return args


def tpu_host_tokens_per_s(flops_per_token: int, mfu: float) -> dict[str, float]:
    from infra.stack_config.topology import V4, V5E, V5P, V6E

    return {g.family: CHIPS_PER_HOST * g.peak_bf16_tflops_per_chip * 1e12 * mfu / flops_per_token
            for g in (V4, V5E, V5P, V6E)}


class PipelineTimer:
    def __init__(self, info: Any, config: Any, worker_count: int):
        self.info, self.config, self.worker_count = info, config, worker_count

    def tokens_per_s(self, batches: int) -> float:
        from trainer.dataset.input_pipeline import make_iterator

        cfg = self.config
        rows = cfg.train.global_batch_size
        it = make_iterator(self.info, global_batch_size=rows, seed=cfg.train.seed, row_start=0,
                           row_stop=rows, worker_count=self.worker_count,
                           prefetch=cfg.data.prefetch)
        try:
            for _ in range(WARMUP_BATCHES):
                next(it)
            start = time.perf_counter()
            count, elapsed = 0, 0.0
            while count < batches or elapsed < MIN_TIMED_S:
                batch = next(it)
                count += 1
                elapsed = time.perf_counter() - start
        finally:
            it.close()
        assert batch.shape == (rows, cfg.model.seq_len + 1), batch.shape
        return count * rows * cfg.model.seq_len / elapsed


class StepTimer:
    """The template's compiled train step on this process's CPU devices."""

    def __init__(self, config: Any):
        import jax
        from trainer.config import resolve
        from trainer.dataset.loader import device_batch
        from trainer.mesh import build_mesh, current_topology
        from trainer.train_step import build_program

        self.config = config
        program = build_program(config, build_mesh(resolve(config, current_topology())))
        self.step = program.compile_step()
        self.state = program.init()
        self.batch = device_batch(0, config, program.batch_sharding)
        self.state, metrics = self.step(self.state, self.batch)  # warm-up
        jax.block_until_ready(metrics)

    def tokens_per_s(self, steps: int) -> float:
        import jax

        start = time.perf_counter()
        metrics = None
        for _ in range(steps):
            self.state, metrics = self.step(self.state, self.batch)
        jax.block_until_ready(metrics)
        elapsed = time.perf_counter() - start
        cfg = self.config
        return steps * cfg.train.global_batch_size * cfg.model.seq_len / elapsed


def bench_config(name: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    from trainer.config import load_config
    from trainer.dataset.input_pipeline import open_dataset
    from trainer.dataset.prepare import prepare
    from trainer.model.transformer import flops_per_token

    config = load_config(name)
    workers = config.data.worker_count if args.worker_count is None else args.worker_count
    data_dir = root / f"data-{name}"
    prepare(data_dir, seq_len=config.model.seq_len)
    pipeline = PipelineTimer(open_dataset(data_dir, seq_len=config.model.seq_len), config, workers)
    step = StepTimer(config) if name in args.cpu_step else None
    pipe_rates, step_rates = [], []
    for i in range(args.repeats):
        pipe_rates.append(pipeline.tokens_per_s(args.batches))
        if step is not None:
            step_rates.append(step.tokens_per_s(max(3, args.batches // 4)))
        shown = f", step {step_rates[-1]:,.0f}" if step_rates else ""
        print(f"{name} repeat {i + 1}/{args.repeats}: pipeline {pipe_rates[-1]:,.0f} tokens/s"
              f"{shown}", file=sys.stderr, flush=True)
    pipe = statistics.median(pipe_rates)
    fpt = flops_per_token(config.model)
    tpu = tpu_host_tokens_per_s(fpt, args.mfu)
    result: dict[str, Any] = {
        "worker_count": workers,
        "prefetch": config.data.prefetch,
        "global_batch_size": config.train.global_batch_size,
        "seq_len": config.model.seq_len,
        "flops_per_token": fpt,
        "pipeline_tokens_per_s": pipe,
        "pipeline_tokens_per_s_per_repeat": pipe_rates,
        "tpu_host_tokens_per_s": tpu,
        "tpu_host_headroom": {family: pipe / need for family, need in tpu.items()},
    }
    if step_rates:
        result["cpu_step_tokens_per_s"] = statistics.median(step_rates)
        result["cpu_step_headroom"] = statistics.median(
            [p / s for p, s in zip(pipe_rates, step_rates, strict=True)])
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from scripts.new import render_template

    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        root = Path(tmp)
        experiment = render_template("bench", root)
        sys.path.insert(0, str(experiment))
        # Grain worker processes rebuild the pipeline from `trainer.dataset.input_pipeline`.
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(experiment), *filter(None, [os.environ.get("PYTHONPATH")])])
        for name in args.configs:
            results[name] = bench_config(name, root, args)
    for name, r in results.items():
        if "cpu_step_headroom" in r:
            versus = (f"{r['cpu_step_headroom']:.1f}x the CPU train step "
                      f"({r['cpu_step_tokens_per_s']:,.0f} tokens/s)")
        else:
            family, worst = min(r["tpu_host_headroom"].items(), key=lambda kv: kv[1])
            versus = (f"{worst:.2f}x a {family} host at {100 * args.mfu:.0f}% MFU "
                      f"({r['tpu_host_tokens_per_s'][family]:,.0f} tokens/s)")
        print(f"{name}: pipeline {r['pipeline_tokens_per_s']:,.0f} tokens/s with "
              f"{r['worker_count']} workers = {versus}")
    print(json.dumps({"configs": results, "mfu": args.mfu, "repeats": args.repeats,
                      "batches": args.batches, "cpu_devices": DEVICES}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
