"""Throughput arithmetic (tokens/s, TFLOP/s per device, MFU), the metrics.jsonl timeline writer
and its TensorBoard mirror.

MFU = achieved model FLOP/s over the chip's dense bf16 peak. Model FLOPs are
`model.flops_per_token` x tokens: 6 per matmul weight per token plus attention counted for the
causal half only, whatever the attention implementation computes (see trainer.model.attention).

Every row of RUN_DIR/metrics.jsonl has `event` and `time` (unix seconds). The rows the train loop
writes, in order of a run's life:

    process_start        (time = when main() began) and the supervisor's instants, when it
                         passed them: boot_at, setup_at, setup_done_at, launched_at
                         (trainer.runtime.launch_times)
    imports              duration_s (from launched_at, else process_start, to the trainer's
                         libraries imported)
    distributed_init     duration_s, mode, spec_generation (TPU VMs: the launch spec all run)
    data_ready           duration_s, path, prepared (true if this run wrote it), num_records
    restore              duration_s, restored_step, skipped_steps (unreadable newer steps),
                         tier (local: every process its own local part; peer: some received a
                         surviving slice's; bucket), processes_TIER and bytes_TIER for local,
                         peer and bucket, local_phases_s (process 0's seconds in the local tier)
      or fresh_start     duration_s (no checkpoint: initialised from the seed)
    restart              last_step (how far the attempt before got: its last step row or a
                         later checkpoint row), restored_step,
                         steps_recomputed (= last_step - restored_step: work lost to the restart)
    compile              duration_s, overlapped_restore (it ran while the restore or fresh
                         start above read or built the state: their intervals overlap)
    step                 step, loss, grad_norm, learning_rate, batch_digest, step_time_s,
                         tokens_per_s, tflops_per_device, mfu (null when the peak is unknown),
                         and every auxiliary value the model reported, by its name
                         (model/aux.py; cross_entropy too when it reported a weighted loss)
    eval                 step, loss (mean cross-entropy over the held-out batches), num_batches,
                         duration_s
    checkpoint           step, blocking_s (= duration_s: how long the loop waited for the save)
    local_checkpoint     step, blocking_s (= duration_s: the copy of this process's part to host
                         memory, and any wait for the previous part's write)
    profile              step, action (start/stop), path
    preempted            step, tier (local or bucket: where the stop step went), duration_s
                         (a SIGTERM was honoured: saved, exiting with code 42)
    checkpoint_wait      duration_s (waiting for the last async save to commit)
    end                  final_step, duration_s (the whole of train.run, first row to last)

With `tensorboard=True` every numeric field is also written as a TensorBoard scalar tagged
`EVENT/FIELD` (step rows as `train/FIELD`, eval rows as `eval/loss`) at the row's `step` (or the
last step seen), into event files in the run directory, so `tensorboard --logdir RUN_DIR` shows
the same numbers.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any, TextIO

# Dense (no sparsity) bf16 peak TFLOP/s per JAX device from the vendors' data sheets, matched as
# substrings of jax's lower-cased device_kind; the first match wins, so specific names come first.
# A device is a chip (v4 and v5p run a chip's two TensorCores as one megacore device), except on
# TPU7x, whose chip shows two devices (Cloud TPU's TPU7x page, "Dual-chiplet architecture"):
# 2307 TFLOP/s a chip is 1153.5 a device.
# H100 comes in three parts with different clocks: SXM5 ("NVIDIA H100 80GB HBM3"), PCIe and NVL.
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("tpu7x", 1153.5),  # Ironwood
    ("tpu v7", 1153.5),
    ("v6 lite", 918.0),  # Trillium (v6e)
    ("v6e", 918.0),
    ("v5 lite", 197.0),  # v5e
    ("v5e", 197.0),
    ("v5p", 459.0),
    ("tpu v5", 459.0),
    ("tpu v4", 275.0),
    ("gb200", 2500.0),
    ("b200", 2250.0),
    ("h200", 989.0),
    ("h100 pcie", 756.0),
    ("h100 nvl", 835.0),
    ("h100", 989.0),  # SXM5
    ("h800", 989.0),
    ("a100", 312.0),
    ("l40s", 362.0),
    ("l4", 121.0),
)


def peak_tflops_for_kind(device_kind: str) -> float | None:
    kind = device_kind.lower()
    for needle, peak in PEAK_TFLOPS:
        if needle in kind:
            return peak
    return None


def matmul_probe(devices=None, size: int = 1024, burst: int = 4):
    """A callable that times `burst` back-to-back f32 matmuls on every local device at once and
    returns the TFLOP/s per device reached (the CPU stand-in for a chip's peak). A burst, since
    a single short call on CPU mostly measures thread wake-up."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = list(devices if devices is not None else jax.local_devices())
    mesh = Mesh(np.asarray(devices), ("d",))
    rows = NamedSharding(mesh, PartitionSpec("d"))
    a = jax.device_put(jnp.ones((len(devices) * size, size), jnp.float32), rows)
    b = jax.device_put(jnp.ones((size, size), jnp.float32), NamedSharding(mesh, PartitionSpec()))
    matmul = jax.jit(lambda x, y: x @ y, out_shardings=rows)
    matmul(a, b).block_until_ready()

    def probe() -> float:
        start = time.perf_counter()
        jax.block_until_ready([matmul(a, b) for _ in range(burst)])
        return burst * 2 * size**3 / (time.perf_counter() - start) / 1e12

    return probe


def measure_matmul_tflops(devices=None, size: int = 1024, repeats: int = 3) -> float:
    """Best of `repeats` matmul probes: measured f32 TFLOP/s per device (CPU peak).

    1024-wide matmuls: at 512 the probe is dominated by dispatch and reads low, which made
    MFU exceed 100%. Two per burst keep the start-up cost to a fraction of a second."""
    probe = matmul_probe(devices, size, burst=2)
    return max(probe() for _ in range(repeats))


def peak_tflops_per_device(device_kind: str, platform: str = "cpu",
                           measure=measure_matmul_tflops,
                           remember_in: str | None = None) -> tuple[float | None, str]:
    """(peak TFLOP/s per device or None, where it came from).

    The table for known accelerators; on CPU a measured f32 matmul (a CPU has no data-sheet
    peak that XLA reaches); on an accelerator the table does not know, None: a CPU-sized matmul
    says nothing about its peak, so MFU is left out rather than made up.

    `remember_in` (the compilation cache directory): a CPU measurement is kept there, keyed by
    the CPU model, its core count and the number of local devices, and read back by the next
    start on the same machine instead of measured again (about 1 CPU-second a process at every
    start and restart of an emulated slice).
    """
    peak = peak_tflops_for_kind(device_kind)
    if peak is not None:
        return peak, "table"
    if platform != "cpu":
        return None, "not in trainer.runtime.metrics.PEAK_TFLOPS; add its dense bf16 peak there"
    if remember_in is None:
        return measure(), "measured f32 matmul"
    path = _cpu_peak_path(remember_in)
    try:
        return float(json.loads(path.read_text())["tflops_per_device"]), \
            "measured f32 matmul, remembered from an earlier start"
    except Exception:  # none yet, or unreadable (gs:// errors are not OSErrors): measure
        pass
    peak = measure()
    with contextlib.suppress(Exception):  # a memo that cannot be written is measured next time
        if str(path).startswith("gs://"):
            # one object upload is atomic on GCS; a rename there is a copy and a delete
            path.write_text(json.dumps({"tflops_per_device": peak}))
        else:
            tmp = path.parent / f"{path.name}.tmp-{os.getpid()}"
            tmp.write_text(json.dumps({"tflops_per_device": peak}))
            tmp.rename(path)
    return peak, "measured f32 matmul"


def _cpu_peak_path(directory: str):
    import jax
    from etils import epath

    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        model = next((line.split(":", 1)[1].strip() for line in cpuinfo
                      if line.startswith("model name")), "")
    key = hashlib.sha256(f"{model}|{os.cpu_count()}|{jax.local_device_count()}".encode())
    return epath.Path(directory) / f"cpu-peak-{key.hexdigest()[:16]}.json"


def throughput(*, tokens: int, step_time_s: float, flops_per_token: int, num_devices: int,
               peak_tflops: float | None) -> dict[str, float | None]:
    tokens_per_s = tokens / step_time_s
    tflops_per_device = tokens_per_s * flops_per_token / num_devices / 1e12
    return {
        "tokens_per_s": tokens_per_s,
        "tflops_per_device": tflops_per_device,
        "mfu": tflops_per_device / peak_tflops if peak_tflops else None,
    }


def format_status(step: int, total: int, row: dict[str, Any],
                  reported: dict[str, float] | None = None) -> str:
    """The periodic status line; `reported`: the model's auxiliary values, appended by name."""
    tok = row["tokens_per_s"]
    tok_text = f"{tok / 1e6:.2f}M" if tok >= 1e6 else f"{tok / 1e3:.1f}k"
    mfu = "n/a" if row.get("mfu") is None else f"{100 * row['mfu']:.1f}%"
    extra = "".join(f" {name} {value:.4g}" for name, value in (reported or {}).items())
    return (
        f"step {step}/{total} loss {row['loss']:.3f} tok/s {tok_text} "
        f"TFLOP/s/dev {row['tflops_per_device']:.3g} MFU {mfu}{extra}"
    )


TRAIN_TAG = "train"
REMOTE_FLUSH_S = 10.0


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    """The rows of RUN_DIR/metrics.jsonl (empty if there is none); a line cut short is skipped."""
    if run_dir.startswith("gs://"):
        from etils import epath

        path = epath.Path(run_dir) / "metrics.jsonl"
        text = path.read_text() if path.exists() else ""
    else:
        path = Path(run_dir) / "metrics.jsonl"
        text = path.read_text(encoding="utf-8") if path.is_file() else ""
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # the last line of a process killed mid-write
        if isinstance(row, dict):
            rows.append(row)
    return rows


def last_step_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The last `step` row, i.e. how far an earlier attempt of this run got."""
    return next((r for r in reversed(rows) if r.get("event") == "step"), None)


def last_reached_step(rows: list[dict[str, Any]]) -> int | None:
    """How far the latest attempt got: the highest step of its step rows and of its checkpoint
    rows (local and bucket). On gs:// step rows are flushed every REMOTE_FLUSH_S seconds, so a
    killed attempt's last ones may be missing; checkpoint rows are written at once."""
    start = max((i for i, r in enumerate(rows) if r.get("event") == "process_start"), default=0)
    steps = [r["step"] for r in rows[start:] if isinstance(r.get("step"), int)
             and r.get("event") in ("step", "checkpoint", "local_checkpoint", "preempted")]
    if steps:
        return max(steps)
    row = last_step_row(rows)
    return int(row["step"]) if row is not None else None


class MetricsWriter:
    """Appends one JSON object per line to RUN_DIR/metrics.jsonl; a no-op when disabled.

    Local run dirs are appended to and flushed per row. On gs:// step rows are buffered and
    appended every REMOTE_FLUSH_S seconds, other rows at once, and all on close, by composing a
    small object onto the end of the file (`storage.append_text`): a flush costs the same however
    long the file is.
    """

    def __init__(self, run_dir: str, enabled: bool = True, tensorboard: bool = False):
        self.enabled = enabled
        self.remote = run_dir.startswith("gs://")
        self.path = f"{run_dir.rstrip('/')}/metrics.jsonl"
        self._rows: list[str] = []
        self._file: TextIO | None = None
        self._last_remote_flush = time.monotonic()
        self._tb: Any = None
        self._tb_step = 0
        if enabled and not self.remote:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            # A process killed mid-row leaves a line without its newline; end it, or the next
            # row would be glued onto it and lost too.
            torn = _ends_without_newline(Path(self.path))
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
            if torn:
                self._file.write("\n")
        if enabled and tensorboard:
            self._tb = open_tensorboard(run_dir)

    def write(self, event: str, **fields: Any) -> None:
        if not self.enabled:
            return
        line = json.dumps({"event": event, "time": time.time(), **fields})
        if self._file is not None:
            self._file.write(line + "\n")
            self._file.flush()
        else:
            self._rows.append(line)
            # Step rows are batched; the rare rows (restore, checkpoint, eval, end...) that
            # explain a run are appended at once, so a SIGKILL loses at most a few step rows.
            if event != "step" or time.monotonic() - self._last_remote_flush > REMOTE_FLUSH_S:
                self.flush()
        if self._tb is not None:
            self._scalars(event, fields)

    def _scalars(self, event: str, fields: dict[str, Any]) -> None:
        step = fields.get("step")
        if isinstance(step, int):
            self._tb_step = step
        tag = TRAIN_TAG if event == "step" else event
        for key, value in fields.items():
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                self._tb.add_scalar(f"{tag}/{key}", value, global_step=self._tb_step)

    def flush(self) -> None:
        if self._tb is not None:
            self._tb.flush()
        self._last_remote_flush = time.monotonic()
        if self.enabled and self.remote and self._rows:
            from .storage import append_text

            append_text(self.path, "".join(r + "\n" for r in self._rows))
            self._rows.clear()

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _ends_without_newline(path: Path) -> bool:
    if not path.is_file() or path.stat().st_size == 0:
        return False
    with open(path, "rb") as f:
        f.seek(-1, 2)
        return f.read(1) != b"\n"


def open_tensorboard(run_dir: str) -> Any:
    """A tensorboardX SummaryWriter on RUN_DIR, or None (with a warning) if it cannot be made."""
    try:
        from tensorboardX import SummaryWriter

        return SummaryWriter(run_dir, flush_secs=10)
    except Exception as exc:  # noqa: BLE001 - TensorBoard is a mirror; never stop training for it
        warnings.warn(f"TensorBoard event files disabled: cannot write them to {run_dir} "
                      f"({type(exc).__name__}: {exc})", stacklevel=2)
        return None


def write_json(run_dir: str, name: str, payload: dict[str, Any]) -> None:
    text = json.dumps(payload, indent=2, sort_keys=True) + "\n"
    if run_dir.startswith("gs://"):
        from etils import epath

        (epath.Path(run_dir) / name).write_text(text)
    else:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        (Path(run_dir) / name).write_text(text)
