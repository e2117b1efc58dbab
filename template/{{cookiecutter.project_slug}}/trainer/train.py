"""The training loop.

Plug-in points (for checkpointing and a real data pipeline):
  - `start(program)` returns (initial state, first step): fresh init by default, a checkpoint
    restore later (`program.abstract_state` is the sharded restore target).
  - `batches(step)` returns the global batch for that global step as a sharded jax.Array.
  - `after_step(step, state)` hooks run after step `step` is dispatched (e.g. async save).
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np

from . import data
from .config import Config, resolve
from .mesh import build_mesh, current_topology
from .metrics import MetricsWriter, format_status, peak_tflops_per_device, throughput, write_json
from .model import flops_per_token, param_count
from .train_step import TrainProgram, TrainState, build_program

StartFn = Callable[[TrainProgram], tuple[TrainState, int]]
BatchFn = Callable[[int], jax.Array]
StepHook = Callable[[int, TrainState], None]


def fresh_start(program: TrainProgram) -> tuple[TrainState, int]:
    return program.init(), 0


def params_digest(params: Any) -> str:
    """sha256 over every parameter's bytes, in sorted path order; identical on every process."""
    from jax.experimental import multihost_utils

    digest = hashlib.sha256()
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    for path, leaf in sorted(leaves, key=lambda item: jax.tree_util.keystr(item[0])):
        if not leaf.is_fully_addressable:
            leaf = multihost_utils.process_allgather(leaf, tiled=True)
        array = np.asarray(leaf)
        digest.update(jax.tree_util.keystr(path).encode())
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def run(
    config: Config,
    steps: int,
    run_dir: str,
    *,
    start: StartFn = fresh_start,
    batches: BatchFn | None = None,
    after_step: Sequence[StepHook] = (),
    timeline: Iterable[dict[str, Any]] = (),
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Train until global step `steps`; returns (and on process 0 writes) the summary."""
    is_main = jax.process_index() == 0
    writer = MetricsWriter(run_dir, enabled=is_main)
    say = log if is_main else (lambda _: None)
    for event in timeline:
        writer.write(**event)

    topology = current_topology()
    resolved = resolve(config, topology)
    mesh = build_mesh(resolved)
    program = build_program(config, mesh)
    say(f"mesh data={resolved.data} fsdp={resolved.fsdp} tensor={resolved.tensor} "
        f"(ici {resolved.ici}, dcn {resolved.dcn}) on {topology.num_slices} slice(s) x "
        f"{topology.devices_per_slice} devices; {param_count(config.model):,} params")

    t0 = time.perf_counter()
    compiled = program.compile_step()
    writer.write("compile", duration_s=time.perf_counter() - t0)

    t0 = time.perf_counter()
    state, start_step = start(program)
    writer.write("init", duration_s=time.perf_counter() - t0, start_step=start_step)
    if batches is None:
        def batches(step: int) -> jax.Array:
            return data.device_batch(step, config, program.batch_sharding)

    device_kind = jax.devices()[0].device_kind
    peak, peak_source = peak_tflops_per_device(device_kind)
    say(f"peak {peak:.3g} TFLOP/s per device ({device_kind}, {peak_source})")
    tokens_per_step = config.train.global_batch_size * config.model.seq_len
    fpt = flops_per_token(config.model)

    rows: list[dict[str, Any]] = []
    last_time = time.perf_counter()

    def record(step: int, metrics_future: dict[str, jax.Array]) -> None:
        nonlocal last_time
        values = jax.device_get(metrics_future)  # waits for this step only; the next is queued
        now = time.perf_counter()
        row = {"step": step, "loss": float(values["loss"]),
               "grad_norm": float(values["grad_norm"]),
               "learning_rate": float(values["learning_rate"]), "step_time_s": now - last_time}
        last_time = now
        row.update(throughput(tokens=tokens_per_step, step_time_s=row["step_time_s"],
                              flops_per_token=fpt, num_devices=mesh.size, peak_tflops=peak))
        rows.append(row)
        writer.write("step", **row)
        print(f"MULTISLICE_STEP {step}", flush=True)
        if step % config.metrics.log_every == 0 or step == steps:
            say(format_status(step, steps, row))

    pending: tuple[int, dict[str, jax.Array]] | None = None
    for step in range(start_step, steps):
        state, metrics = compiled(state, batches(step))
        for hook in after_step:
            hook(step + 1, state)
        if pending is not None:
            record(*pending)
        pending = (step + 1, metrics)
    if pending is not None:
        record(*pending)

    # Steady-state throughput: drop the first measured step (it waits for the pipeline to fill).
    timed = rows[1:] or rows
    if timed:
        overall = throughput(tokens=tokens_per_step * len(timed),
                             step_time_s=sum(r["step_time_s"] for r in timed),
                             flops_per_token=fpt, num_devices=mesh.size, peak_tflops=peak)
    else:
        overall = {"tokens_per_s": 0.0, "tflops_per_device": 0.0, "mfu": 0.0}
    summary = {
        "final_step": int(jax.device_get(state["step"])),
        "final_loss": rows[-1]["loss"] if rows else None,
        "params_digest": params_digest(state["params"]),
        **overall,
        "num_slices": topology.num_slices,
        "devices_per_slice": topology.devices_per_slice,
        "device_kind": device_kind,
        "mesh": {"data": resolved.data, "fsdp": resolved.fsdp, "tensor": resolved.tensor},
        "param_count": param_count(config.model),
        "flops_per_token": fpt,
        "peak_tflops_per_device": peak,
        "steps_run": len(rows),
    }
    print(f"params_digest {summary['params_digest']} at step {summary['final_step']}", flush=True)
    if is_main:
        write_json(run_dir, "summary.json", summary)
    writer.close()
    sys.stdout.flush()
    return summary
