"""The training loop: Grain data, Orbax checkpoints, preemption, timeline metrics, profiling.

`run(config, steps, run_dir)` trains until global step `steps` and resumes whatever an earlier
attempt on the same run directory left behind. In order:

1. Resolve the mesh against the devices. If the run directory holds a checkpoint, a topology the
   run cannot continue on (say the global batch does not divide over the new batch shards) fails
   here, naming the checkpoint and the numbers, before anything is compiled.
2. Find the prepared dataset, or prepare the built-in corpus (see `trainer.dataset.loader`).
3. Restore the newest complete checkpoint into this mesh's shardings (train state, this process's
   data iterator position, the loop's RNG key, the step), falling back from an unreadable newest
   one with a warning; or initialise from the seed and say so.
4. Compile the step (the persistent compilation cache lives in RUN_DIR/compile_cache), on a
   thread of its own that starts before step 3: compiling needs only the shapes, so a restart's
   storage reads and its compile overlap instead of adding up.
5. Step g consumes global batch g, so the data position always equals the step. Metrics are read
   back one step late so the host never stalls the device. A checkpoint is started (async) every
   `checkpoint.save_interval_steps` steps and at the end; after a preemption notice (SIGTERM) the
   loop saves at the next step boundary and raises `Preempted` (main.py exits with code 42).

The LR schedule reads the restored `state["step"]` and the horizon `train.total_steps`, so a
resumed run computes exactly what the uninterrupted run would have: same losses, same parameters.
The timeline rows written to metrics.jsonl are listed in `trainer.runtime.metrics`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax

from .config import BUILTIN_MESH_AXES, Config, ConfigError
from .dataset.input_pipeline import DataError
from .dataset.loader import TrainData, ensure_dataset
from .hf.weights import init_from
from .mesh import build_mesh, current_topology
from .model import aux
from .model.checks import resolve
from .model.registry import describe, flops_per_token, param_count
from .runtime import elastic
from .runtime.checkpoint import Checkpointer, CheckpointError
from .runtime.compilation_cache import (
    add_local_tier,
    enable_compilation_cache,
    write_from_every_process_on_cpu,
)
from .runtime.digest import params_digest, rng_digest
from .runtime.local_tier import LocalTier, default_directory, part_bytes
from .runtime.metrics import (
    MetricsWriter,
    format_status,
    last_reached_step,
    last_step_row,
    peak_tflops_per_device,
    read_metrics,
    throughput,
    write_json,
)
from .runtime.preemption import PreemptionGuard
from .runtime.progress import ProgressFile
from .runtime.storage import check_reachable, check_run_dir_layout
from .train_step import build_program

PROFILE_SUBDIR = "profile"


class Preempted(Exception):  # noqa: N818 - it is a signal to stop, not an error
    """A preemption notice was honoured: the checkpoint of `step` is committed; exit 42."""

    def __init__(self, step: int):
        super().__init__(f"preempted: checkpoint of step {step} saved")
        self.step = step


class TrainingDiverged(RuntimeError):
    """Step `step` produced a non-finite loss or gradient norm; nothing of it was saved (exit 3)."""

    def __init__(self, step: int, loss: float, grad_norm: float, last_saved: int | None,
                 checkpoint_dir: str):
        kept = (f"the newest checkpoint (step {last_saved}) in {checkpoint_dir} is from before it"
                if last_saved is not None else f"no checkpoint in {checkpoint_dir} was written")
        super().__init__(
            f"step {step}: loss = {loss}, gradient norm = {grad_norm} (not finite); stopped "
            f"before saving it, and {kept}. Lower optim.learning_rate or raise "
            "optim.warmup_steps, check the data, or use model.param_dtype = 'float32'")
        self.step = step


def resolve_for_run(config: Config, topology: Any, latest_checkpoint: int | None,
                    checkpoint_dir: str) -> Any:
    """`config.resolve`, with the checkpoint named when a resume cannot fit this topology."""
    try:
        return resolve(config, topology)
    except ConfigError as exc:
        if latest_checkpoint is None:
            raise
        raise ConfigError(
            f"cannot resume checkpoint step {latest_checkpoint} in {checkpoint_dir} on "
            f"{topology.num_slices} slice(s) x {topology.devices_per_slice} devices "
            f"({topology.num_processes} processes): {exc}"
        ) from exc


class _Profiler:
    """jax.profiler trace of steps [start, start + num) into RUN_DIR/profile; off when num = 0."""

    def __init__(self, config: Config, run_dir: str, writer: MetricsWriter):
        self.first = config.profile.start_step
        self.last = config.profile.start_step + config.profile.num_steps - 1
        self.enabled = config.profile.num_steps > 0
        self.path = f"{run_dir.rstrip('/')}/{PROFILE_SUBDIR}"
        self.writer = writer
        self.active = False

    def before(self, step: int) -> None:
        if self.enabled and step == self.first and not self.active:
            jax.profiler.start_trace(self.path)
            self.active = True
            self.writer.write("profile", step=step, action="start", path=self.path)

    def after(self, step: int, outputs: Any) -> None:
        if self.active and step >= self.last:
            jax.block_until_ready(outputs)
            jax.profiler.stop_trace()
            self.active = False
            self.writer.write("profile", step=step, action="stop", path=self.path)


STEP_MARKERS_ENV = "MULTISLICE_STEP_MARKERS"


def run(
    config: Config,
    steps: int,
    run_dir: str,
    *,
    guard: PreemptionGuard | None = None,
    timeline: Iterable[dict[str, Any]] = (),
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Train until global step `steps`; returns (and on process 0 writes) the summary.

    Raises Preempted after saving when `guard` reports a preemption notice; ConfigError or
    DataError (before compiling) when the config, the topology or the data cannot work.
    """
    run_started = time.time()
    is_main = jax.process_index() == 0
    check_reachable(run_dir)  # a wrong or inaccessible bucket fails here, before any compile
    check_reachable(config.data.path)  # "" (RUN_DIR/data) or local: nothing to check
    check_reachable(config.train.init_from)
    check_run_dir_layout(run_dir)  # a regular file where a directory goes: before anything runs
    previous_rows = read_metrics(run_dir) if is_main else []
    writer = MetricsWriter(run_dir, enabled=is_main, tensorboard=True)
    say = log if is_main else (lambda _: None)
    for event in timeline:
        writer.write(**event)

    ckpt = Checkpointer(run_dir, save_interval_steps=config.checkpoint.save_interval_steps,
                        max_to_keep=config.checkpoint.max_to_keep,
                        async_save=config.checkpoint.async_save)
    try:
        return _train(config, steps, run_dir, ckpt=ckpt, writer=writer, say=say,
                      previous_rows=previous_rows, guard=guard, run_started=run_started)
    finally:
        ckpt.close()
        writer.close()
        sys.stdout.flush()


def tokenizer_warning(init_from: str) -> str | None:
    """A line when converted weights meet a byte-level data set: the ids mean other things."""
    from .hf.weights import is_weights_dir, read_marker

    if not is_weights_dir(init_from):
        return None
    source = read_marker(init_from).get("source", {})
    if source.get("kind") != "huggingface":
        return None
    carried = "tokenizer.json" in source.get("companions", [])
    return (f"warning: train.init_from={init_from} was converted from {source.get('dir', '?')}, "
            + ("whose tokenizer.json" if carried else "which has no tokenizer.json; its")
            + " token ids are not the data's bytes: prepare the data with its tokenizer "
            "(python -m trainer.prepare --tokenizer PATH/tokenizer.json) for a real fine-tune")


def pipeline_line(config: Config, stages: int) -> str:
    """The run log's line for a pipeline: schedule, micro-batches, bubble."""
    from .pipeline import Schedule

    schedule = Schedule.of(config, stages)
    micro, repeats = schedule.microbatches, schedule.repeats
    layout = describe(config.model)  # a stage's block is of the variant's units of layers
    units = schedule.block_layers(layout.units)
    per_block = units * layout.layers_per_unit
    layers = f"{per_block} layer{'s' if per_block > 1 else ''}"
    kind = (f"circular, {repeats} blocks of {layers} a stage (train.pipeline_repeats)"
            if repeats > 1 else f"GPipe, {layers} a stage")
    if units > 1:
        kind += (", unrolled" if schedule.unrolled(layout.units)
                 else ", each block a loop (train.pipeline_unroll_layers)")
    return (f"pipeline: {stages} stages, {kind}, {micro} micro-batches per pass "
            f"(train.pipeline_microbatches): a bubble of {stages - 1}/{schedule.ticks} = "
            f"{schedule.bubble:.1%}")


def compile_or_explain(program: Any, config: Config) -> Any:
    """The compiled step; an out-of-memory at compile time (the step does not fit the device)
    becomes a ConfigError (exit 2: a restart cannot make it fit) that says what to change."""
    try:
        return program.compile_step()
    except Exception as exc:  # XlaRuntimeError: RESOURCE_EXHAUSTED / out of memory
        raise out_of_memory(exc, config, "when compiled") from None


def _compile_timed(program: Any, config: Config) -> tuple[Any, float, float]:
    """(compiled step, seconds it took, the instant it finished)."""
    t0 = time.perf_counter()
    compiled = compile_or_explain(program, config)
    return compiled, time.perf_counter() - t0, time.time()


def out_of_memory(exc: Exception, config: Config, when: str) -> Exception:
    """A ConfigError naming the knobs for an out-of-memory error (exit 2: a restart cannot make
    the step fit); any other exception is returned as it is, to be re-raised."""
    text = str(exc)
    if "RESOURCE_EXHAUSTED" not in text and "out of memory" not in text.lower():
        return exc
    first = (text.splitlines() or [""])[0][:300]
    return ConfigError(
        f"the train step of {config.model.n_layers} layers x d_model {config.model.d_model}"
        f" with global batch {config.train.global_batch_size} does not fit in device memory "
        f"{when} ({first}); run --check for the per-device estimate, then shard more "
        "(mesh.ici_fsdp), recompute more (model.remat), split the batch "
        "(train.grad_accum_steps) or chunk the loss (model.loss_chunk_size)")


def _train(config: Config, steps: int, run_dir: str, *, ckpt: Checkpointer,
           writer: MetricsWriter, say: Callable[[str], None],
           previous_rows: list[dict[str, Any]], guard: PreemptionGuard | None,
           run_started: float) -> dict[str, Any]:
    topology = current_topology()
    full = elastic.full_slices(topology)
    elastic.check_every_size(config, full, topology, resolve)
    config = elastic.at_size(config, full, topology.num_slices)
    resolved = resolve_for_run(config, topology, ckpt.latest_step(), str(ckpt.directory))
    if config.elastic.min_slices:
        if os.environ.get(STEP_MARKERS_ENV) == "1":  # the launcher learns the job's floor
            sys.stdout.write(elastic.marker(config, full, topology.num_slices) + "\n")
            sys.stdout.flush()
        say(f"elastic: {topology.num_slices} of {full} slices (elastic.min_slices = "
            f"{config.elastic.min_slices}), {config.train.grad_accum_steps} micro-batch(es) a "
            "step" + (", gradients summed in the canonical order"
                      if config.elastic.canonical_reduction else ""))

    t0 = time.perf_counter()
    info, prepared = ensure_dataset(config, run_dir)
    writer.write("data_ready", duration_s=time.perf_counter() - t0, path=info.data_dir,
                 prepared=prepared, num_records=info.num_records)
    say(f"data: {info.num_records:,} records of {info.seq_len} tokens in {info.data_dir}"
        + (" (did not exist: the built-in synthetic corpus was generated there)"
           if prepared else ""))

    cache_dir = enable_compilation_cache(run_dir)
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()  # picks up this run's directory even if jax compiled before
    local_cache = add_local_tier()  # the host's or node's own disk first, when it has one
    write_from_every_process_on_cpu()

    mesh = build_mesh(resolved)
    program = build_program(config, mesh)
    data = TrainData(info, config, program.batch_sharding)
    local = local_tier(config, run_dir, data.data_digest, say)
    forks = "".join(f" {axis}={resolved.size(axis)}" for axis in resolved.axes
                    if axis not in BUILTIN_MESH_AXES)
    say(f"mesh data={resolved.data} fsdp={resolved.fsdp}{forks} tensor={resolved.tensor} "
        f"(ici {resolved.ici}, dcn {resolved.dcn}) on {topology.num_slices} slice(s) x "
        f"{topology.devices_per_slice} devices; {param_count(config.model):,} params")
    if resolved.pipeline > 1:
        say(pipeline_line(config, resolved.pipeline))

    # The step compiles from shapes alone, so it runs on a thread of its own while the state is
    # restored (storage reads) or initialised: XLA compiles with the GIL released. A thread
    # cannot be cancelled: a restore that fails waits for the compile before the error surfaces.
    compile_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compile-step")
    compiling = compile_pool.submit(_compile_timed, program, config)
    try:
        t0 = time.perf_counter()
        from_local = None if local is None else local.restore(
            program.abstract_state, data.iterator, ckpt.latest_step())
        restored = ckpt.restore_latest(program.abstract_state, data.iterator) \
            if from_local is None else from_local
        if restored is None:
            state, rng, start_step = program.init(), jax.random.key(config.train.seed), 0
            if config.train.init_from:
                # Step 0 with these parameters; the optimizer state is the fresh one (Adam's
                # moments and count start at zero whatever the parameters are).
                saved = program.to_saved(state)
                saved["params"] = init_from(config, program.abstract_state["params"])
                state = program.from_saved(saved)
            writer.write("fresh_start", duration_s=time.perf_counter() - t0,
                         init_from=config.train.init_from)
            say(f"no checkpoint in {ckpt.directory}: starting fresh at step 0"
                + (f" from the parameters in {config.train.init_from}"
                   if config.train.init_from else ""))
            if config.train.init_from and info.tokenizer == "bytes":
                warning = tokenizer_warning(config.train.init_from)
                if warning:
                    say(warning)
        else:
            state = program.from_saved(restored.state)  # a circular pipeline's layer order
            rng, start_step = restored.rng, restored.step
            if restored.data_digest and info.digest and restored.data_digest != info.digest:
                raise DataError(
                    f"checkpoint step {start_step} in {ckpt.directory} was trained on another "
                    f"data set (metadata.json sha256 {restored.data_digest[:12]}) than the one "
                    f"in {info.data_dir} now ({info.digest[:12]}): resuming would continue on "
                    "different data. Point data.path at the data it was trained on, or start a "
                    "new run (another --run-dir, or a new multislice:run_name on a stack)")
            if data.iterator.next_global_batch != start_step:
                raise CheckpointError(
                    f"checkpoint step {start_step} in {ckpt.directory} holds data position "
                    f"{data.iterator.next_global_batch}; they must be equal (global batch g is "
                    "read at step g)")
            sources = restore_sources(from_local, program.abstract_state)
            skipped_steps = list(getattr(restored, "skipped_steps", ()))
            phases = getattr(restored, "phases", None)
            writer.write("restore", duration_s=time.perf_counter() - t0,
                         restored_step=start_step, skipped_steps=skipped_steps, **sources,
                         **({"local_phases_s": phases} if phases else {}))
            skipped = (f" (skipped unreadable newer step(s) {skipped_steps})"
                       if skipped_steps else "")
            say(f"resuming run {run_dir} at checkpoint step {start_step} from "
                f"{describe_sources(sources, run_dir)}"
                f" in {time.perf_counter() - t0:.1f}s{skipped}; to start fresh, give another "
                "--run-dir")
        if local is not None:
            local.drop_newer_than(start_step)
        last = last_reached_step(previous_rows)
        finished = bool(previous_rows) and previous_rows[-1].get("event") == "end"
        if last is not None and not finished:  # a new invocation of a finished run: none
            writer.write("restart", last_step=last, restored_step=start_step,
                         steps_recomputed=max(0, last - start_step))
            say(f"restart: an earlier attempt reached step {last}; resuming at step "
                f"{start_step} recomputes {max(0, last - start_step)} step(s)")

        compiled, compile_s, compiled_at = compiling.result()
        writer.write("compile", time=compiled_at, duration_s=compile_s, cache_dir=cache_dir,
                     local_cache_dir=local_cache, overlapped_restore=True)
        device_kind = jax.devices()[0].device_kind
        peak, peak_source = peak_tflops_per_device(device_kind, jax.devices()[0].platform,
                                                   remember_in=cache_dir)
        if peak is None:
            say(f"peak TFLOP/s of {device_kind!r} unknown ({peak_source}); MFU is not reported")
        else:
            say(f"peak {peak:.3g} TFLOP/s per device ({device_kind}, {peak_source})")
        try:
            rows, final_state, rng, evals = _loop(
                config, steps, run_dir, program=program, compiled=compiled, data=data,
                ckpt=ckpt, local=local, writer=writer, say=say, guard=guard, state=state,
                rng=rng, start_step=start_step, peak=peak,
                shrunk=topology.num_slices < full)
        except Exception as exc:  # an allocation that fails while running, not compiling
            mapped = out_of_memory(exc, config, "while running")
            if mapped is exc:
                raise
            raise mapped from None
    finally:
        compile_pool.shutdown(wait=True)
        data.close()
        if local is not None:
            local.close()

    t0 = time.perf_counter()
    waited = ckpt.wait_until_finished()
    writer.write("checkpoint_wait", duration_s=max(waited, time.perf_counter() - t0))
    return _summarize(config, steps, run_dir, rows=rows, evals=evals, state=final_state, rng=rng,
                      start_step=start_step, previous=last_step_row(previous_rows),
                      program=program, topology=topology, resolved=resolved, writer=writer,
                      run_started=run_started, peak=peak)


TERM_GRACE_ENV = "MULTISLICE_TERM_GRACE_S"
DEFAULT_TERM_GRACE_S = 30.0  # a TPU VM's preemption notice; GKE pods: terminationGracePeriod


def say_on_every_process(line: str) -> None:
    """What one host finds on its own storage: every host says it, prefixed with its number."""
    print(f"[process {jax.process_index()}] {line}", file=sys.stderr, flush=True)


def local_tier(config: Config, run_dir: str, data_digest: str,
               say: Callable[[str], None]) -> LocalTier | None:
    """The local tier when checkpoint.local_every > 0 (on every process: its restore is a
    collective), off with a warning where this host has no place for it."""
    c = config.checkpoint
    if c.local_every == 0:
        return None
    directory = default_directory(run_dir)
    return LocalTier(directory or "", run_dir=run_dir, every=c.local_every,
                     max_to_keep=c.local_max_to_keep, model=dataclasses.asdict(config.model),
                     data_digest=data_digest, say=say_on_every_process,
                     off_because=None if directory else (
                         f"no host-local directory for a run in {run_dir} (set "
                         "MULTISLICE_LOCAL_CHECKPOINT_DIR; the launchers do)"))


def preemption_tier(local: LocalTier | None, ckpt: Checkpointer, *, shrunk: bool = False
                    ) -> tuple[str, str]:
    """("local" or "bucket", why): the bucket when it fits half the grace, by the newest save's
    start-to-commit time; the local tier when it does not or is not known, or when an elastic
    job on fewer slices than it has is stopped (`shrunk`: to grow back, and the returning
    slice restores from a survivor's part). Every process decides the same (the bucket save is
    collective)."""
    from .runtime.checkpoint import gather_ints

    grace = float(os.environ.get(TERM_GRACE_ENV) or DEFAULT_TERM_GRACE_S)
    took = ckpt.last_save_s
    if local is None or not local.enabled:
        choice, why = "bucket", "no local tier"
    elif shrunk:
        choice, why = "local", ("the job runs on fewer slices than it has: a slice that returns "
                                "restores from a survivor's part")
    elif took is None:
        choice, why = "local", ("no bucket save has finished in this attempt to time; "
                                f"grace {grace:g}s")
    elif took > grace / 2:
        choice, why = "local", f"a bucket save took {took:.1f}s, over half the {grace:g}s grace"
    else:
        choice, why = "bucket", f"a bucket save took {took:.1f}s, within half the {grace:g}s grace"
    votes = gather_ints([choice == "local"])
    if choice == "local" and not all(v[0] for v in votes):
        choice, why = "bucket", "a host has no local tier"
    elif choice == "bucket" and any(v[0] for v in votes):
        choice, why = "local", "another host's bucket save would not fit the grace"
    return choice, why


def all_saved_locally(local: LocalTier, step: int) -> bool:
    """Whether every process committed its part of `step` (a collective)."""
    from .runtime.checkpoint import gather_ints

    mine = local.enabled and bool(local.steps()) and local.steps()[0] == step
    return all(row[0] for row in gather_ints([mine]))


def restore_sources(from_local: Any, abstract_state: Any) -> dict[str, Any]:
    """The restore row's account, over every process: how many restored from their own local
    part, a peer's, or the bucket, and the bytes each tier gave (a bucket restore reads this
    process's shards: their bytes are counted)."""
    from .runtime.checkpoint import gather_ints

    codes = {"local": 0, "peer": 1, "bucket": 2}
    if from_local is not None:
        code, nbytes = codes[from_local.source], from_local.bytes_read
    else:
        code, nbytes = codes["bucket"], part_bytes(abstract_state)
    rows = gather_ints([code, nbytes >> 31, nbytes & 0x7FFFFFFF])
    out: dict[str, Any] = {"tier": "bucket"}
    for name, c in codes.items():
        mine = [r for r in rows if r[0] == c]
        out[f"processes_{name}"] = len(mine)
        out[f"bytes_{name}"] = sum((r[1] << 31) + r[2] for r in mine)
    if out["processes_bucket"] == 0:
        out["tier"] = "peer" if out["processes_peer"] else "local"
    return out


def describe_sources(sources: dict[str, Any], run_dir: str) -> str:
    """Where a restore row's state came from, per tier, in words."""
    run_tier = "the bucket" if run_dir.startswith("gs://") else "the run directory"
    parts = []
    for name, label in (("local", "its own local copy"), ("peer", "a peer slice's local copy"),
                        ("bucket", run_tier)):
        if sources.get(f"processes_{name}"):
            parts.append(f"{label} on {sources[f'processes_{name}']} process(es), "
                         f"{sources[f'bytes_{name}'] / 2**20:.1f} MiB")
    return "; ".join(parts)


def _loop(config: Config, steps: int, run_dir: str, *, program: Any, compiled: Any,
          data: TrainData, ckpt: Checkpointer, local: LocalTier | None, writer: MetricsWriter,
          say: Callable[[str], None], guard: PreemptionGuard | None, state: Any, rng: jax.Array,
          start_step: int, peak: float | None, shrunk: bool = False
          ) -> tuple[list[dict[str, Any]], Any, jax.Array, list[dict[str, Any]]]:
    mesh = program.mesh
    tokens_per_step = config.train.global_batch_size * config.model.seq_len
    fpt = flops_per_token(config.model)
    profiler = _Profiler(config, run_dir, writer)
    progress = ProgressFile()

    rows: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    last_time = time.perf_counter()
    last_saved = ckpt.latest_step()

    def check_finite(step: int, values: dict[str, Any]) -> None:
        if not bool(values["finite"]):
            raise TrainingDiverged(step, float(values["loss"]), float(values["grad_norm"]),
                                   last_saved, str(ckpt.directory))

    def record(step: int, futures: dict[str, jax.Array]) -> None:
        nonlocal last_time
        values = jax.device_get(futures)  # waits for this step only; the next is queued
        now = time.perf_counter()
        check_finite(step, values)
        # what the model reported (model/aux.py), by the names it gave
        reported = {name: float(value) for name, value in sorted(values.items())
                    if name not in aux.STEP_METRICS}
        row = {"step": step, "loss": float(values["loss"]),
               "grad_norm": float(values["grad_norm"]),
               "learning_rate": float(values["learning_rate"]),
               "batch_digest": f"{int(values['batch_digest']):08x}",
               "step_time_s": now - last_time, **reported}
        last_time = now
        row.update(throughput(tokens=tokens_per_step, step_time_s=row["step_time_s"],
                              flops_per_token=fpt, num_devices=mesh.size, peak_tflops=peak))
        rows.append(row)
        writer.write("step", **row)
        # For a launcher that reads this process's stdout (multislice local, the VM's startup
        # script) and asks for them: a hand-run trainer prints none. One write of the whole line:
        # under PYTHONUNBUFFERED, print() writes the text and its newline in two syscalls, and a
        # C++ log line on the shared stderr can land between them.
        if os.environ.get(STEP_MARKERS_ENV) == "1":
            sys.stdout.write(f"MULTISLICE_STEP {step}\n")
            sys.stdout.flush()
        progress.step(step, row["step_time_s"])
        if step % config.metrics.log_every == 0 or step == steps:
            say(format_status(step, steps, row, reported))

    def evaluate(step: int) -> None:
        nonlocal last_time
        t0 = time.perf_counter()
        with jax.set_mesh(mesh):  # the sharding constraints (and splash's shard_map) need it
            losses = [program.eval_loss(state["params"], data.eval_batch(i))
                      for i in range(data.num_eval_batches)]
        loss = float(sum(jax.device_get(losses)) / len(losses))
        duration = time.perf_counter() - t0
        last_time += duration  # evaluation time is not the next step's time
        progress.paused(duration)
        evals.append({"step": step, "eval_loss": loss})
        writer.write("eval", step=step, loss=loss, num_batches=data.num_eval_batches,
                     duration_s=duration)
        say(f"eval at step {step}: loss {loss:.4f} over {data.num_eval_batches} held-out "
            f"batch(es) of {data.eval_batch_size}")

    interval = config.checkpoint.save_interval_steps
    eval_every = config.eval.every_steps if data.num_eval_batches else 0

    def save(step: int, force: bool, metrics: dict[str, jax.Array]) -> None:
        nonlocal last_saved
        # Gated here because Orbax's own policy would also save the first step it is shown.
        if not force and step % interval:
            return
        check_finite(step, jax.device_get(metrics))  # never save a state a NaN produced
        info = ckpt.save(step, program.to_saved(state), data.iterator, rng, force=True,
                         data_digest=data.data_digest, model=dataclasses.asdict(config.model))
        if info.saved:
            last_saved = step
            progress.paused(info.blocking_s)
            writer.write("checkpoint", step=step, blocking_s=info.blocking_s,
                         duration_s=info.blocking_s)

    def save_local(step: int, metrics: dict[str, jax.Array]) -> float:
        assert local is not None
        check_finite(step, jax.device_get(metrics))
        blocked = local.save(step, program.to_saved(state), rng, data.iterator.get_state())
        if local.enabled:
            writer.write("local_checkpoint", step=step, blocking_s=blocked, duration_s=blocked)
            progress.paused(blocked)
        return blocked

    if start_step >= steps:
        say(f"already at step {start_step} >= --steps {steps}: nothing to train")
    pending: tuple[int, dict[str, jax.Array]] | None = None
    for step in range(start_step, steps):
        done = step + 1
        batch = data.next_batch()
        profiler.before(done)
        state, metrics = compiled(state, batch)
        rng, _step_key = jax.random.split(rng)  # the per-step key for a model that needs one
        profiler.after(done, metrics)
        if pending is not None:
            record(*pending)
        pending = (done, {**metrics, "batch_digest": data.digest(batch)})
        # should_stop runs at every step on every process (JAX's sync point needs that); a notice
        # at the last step needs no emergency exit, the final save below covers it.
        ckpt.poll()
        if guard is not None and guard.should_stop(done) and done < steps:
            record(*pending)
            tier, why = preemption_tier(local, ckpt, shrunk=shrunk)
            t0 = time.perf_counter()
            if tier == "local":
                save_local(done, metrics)
                local.wait()
                if not all_saved_locally(local, done):
                    tier, why = "bucket", "the local save failed on a host"
            if tier == "bucket":
                save(done, True, metrics)
                ckpt.wait_until_finished()
            waited = time.perf_counter() - t0
            writer.write("preempted", step=done, duration_s=waited, tier=tier)
            say(f"preemption notice: saved step {done} to the {tier} tier in {waited:.1f}s "
                f"({why}); exiting with code 42 so the job is restarted")
            raise Preempted(done)
        save(done, done == steps, metrics)
        if local is not None and local.due(done) and done < steps:
            save_local(done, metrics)
        if eval_every and done % eval_every == 0 and done < steps:
            record(*pending)
            pending = None
            evaluate(done)
    if pending is not None:
        record(*pending)
    if data.num_eval_batches and steps > start_step:
        evaluate(steps)
    return rows, state, rng, evals


def _summarize(config: Config, steps: int, run_dir: str, *, rows: list[dict[str, Any]],
               evals: list[dict[str, Any]], state: Any, rng: jax.Array, start_step: int,
               previous: dict[str, Any] | None,
               program: Any, topology: Any, resolved: Any, writer: MetricsWriter,
               run_started: float, peak: float | None) -> dict[str, Any]:
    is_main = jax.process_index() == 0
    device_kind = jax.devices()[0].device_kind
    tokens_per_step = config.train.global_batch_size * config.model.seq_len
    fpt = flops_per_token(config.model)
    # Steady-state throughput: drop the first measured step (it waits for the pipeline to fill).
    timed = rows[1:] or rows
    if timed:
        overall = throughput(tokens=tokens_per_step * len(timed),
                             step_time_s=sum(r["step_time_s"] for r in timed),
                             flops_per_token=fpt, num_devices=program.mesh.size, peak_tflops=peak)
    else:
        overall = {"tokens_per_s": 0.0, "tflops_per_device": 0.0, "mfu": None}
    final_loss = rows[-1]["loss"] if rows else (previous or {}).get("loss")
    summary = {
        "final_step": int(jax.device_get(state["step"])),
        "final_loss": final_loss,
        "eval_loss": evals[-1]["eval_loss"] if evals else None,
        "eval_step": evals[-1]["step"] if evals else None,
        "params_digest": params_digest(program.to_saved(state)["params"]),
        "rng_digest": rng_digest(rng),
        **overall,
        "num_slices": topology.num_slices,
        "devices_per_slice": topology.devices_per_slice,
        "device_kind": device_kind,
        "mesh": {axis: resolved.size(axis) for axis in resolved.axes if axis != "pipeline"},
        "param_count": param_count(config.model),
        "flops_per_token": fpt,
        "peak_tflops_per_device": peak,
        "start_step": start_step,
        "steps_run": len(rows),
    }
    print(f"params_digest {summary['params_digest']} at step {summary['final_step']}", flush=True)
    writer.write("end", final_step=summary["final_step"], duration_s=time.time() - run_started)
    if is_main:
        write_json(run_dir, "summary.json", summary)
    return summary

