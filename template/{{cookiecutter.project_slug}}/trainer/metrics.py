"""Throughput arithmetic (tokens/s, TFLOP/s per device, MFU) and the metrics.jsonl writer."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, TextIO

# Dense bf16 peak TFLOP/s per chip, matched against jax's device_kind (first match wins, so
# the more specific names come first).
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("v6 lite", 918.0),
    ("v6e", 918.0),
    ("v5 lite", 197.0),
    ("v5e", 197.0),
    ("v5p", 459.0),
    ("tpu v5", 459.0),
    ("tpu v4", 275.0),
    ("h200", 989.0),
    ("h100", 989.0),
    ("a100", 312.0),
    ("l4", 121.0),
)


def peak_tflops_for_kind(device_kind: str) -> float | None:
    kind = device_kind.lower()
    for needle, peak in PEAK_TFLOPS:
        if needle in kind:
            return peak
    return None


def measure_matmul_tflops(devices=None, size: int = 512, repeats: int = 5) -> float:
    """Measured f32 matmul TFLOP/s per device, with all local devices busy at once (CPU peak)."""
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
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e12


def peak_tflops_per_device(device_kind: str, measure=measure_matmul_tflops) -> tuple[float, str]:
    """(peak TFLOP/s per device, where it came from): the table, or a measurement on CPU."""
    peak = peak_tflops_for_kind(device_kind)
    if peak is not None:
        return peak, "table"
    return measure(), "measured f32 matmul"


def throughput(*, tokens: int, step_time_s: float, flops_per_token: int, num_devices: int,
               peak_tflops: float) -> dict[str, float]:
    tokens_per_s = tokens / step_time_s
    tflops_per_device = tokens_per_s * flops_per_token / num_devices / 1e12
    return {
        "tokens_per_s": tokens_per_s,
        "tflops_per_device": tflops_per_device,
        "mfu": tflops_per_device / peak_tflops if peak_tflops > 0 else 0.0,
    }


def format_status(step: int, total: int, row: dict[str, Any]) -> str:
    tok = row["tokens_per_s"]
    tok_text = f"{tok / 1e6:.2f}M" if tok >= 1e6 else f"{tok / 1e3:.1f}k"
    return (
        f"step {step}/{total} loss {row['loss']:.3f} tok/s {tok_text} "
        f"TFLOP/s/dev {row['tflops_per_device']:.3g} MFU {100 * row['mfu']:.1f}%"
    )


class MetricsWriter:
    """Appends one JSON object per line to RUN_DIR/metrics.jsonl; a no-op when disabled.

    Local run dirs are appended to and flushed per row; gs:// run dirs are rewritten whole on
    each flush (objects cannot be appended to).
    """

    def __init__(self, run_dir: str, enabled: bool = True):
        self.enabled = enabled
        self.remote = run_dir.startswith("gs://")
        self.path = f"{run_dir.rstrip('/')}/metrics.jsonl"
        self._rows: list[str] = []
        self._file: TextIO | None = None
        if enabled and not self.remote:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def write(self, event: str, **fields: Any) -> None:
        if not self.enabled:
            return
        line = json.dumps({"event": event, "time": time.time(), **fields})
        if self._file is not None:
            self._file.write(line + "\n")
            self._file.flush()
        else:
            self._rows.append(line)

    def flush(self) -> None:
        if self.enabled and self.remote and self._rows:
            from etils import epath

            existing = epath.Path(self.path)
            previous = existing.read_text() if existing.exists() else ""
            existing.write_text(previous + "".join(r + "\n" for r in self._rows))
            self._rows.clear()

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None


def write_json(run_dir: str, name: str, payload: dict[str, Any]) -> None:
    text = json.dumps(payload, indent=2, sort_keys=True) + "\n"
    if run_dir.startswith("gs://"):
        from etils import epath

        (epath.Path(run_dir) / name).write_text(text)
    else:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        (Path(run_dir) / name).write_text(text)
