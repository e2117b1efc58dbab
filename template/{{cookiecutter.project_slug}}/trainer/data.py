"""Interim data source: random windows of the synthetic corpus (to be replaced by Grain).

Global batch g is defined by (seed, g) alone, whatever the number of processes; each process
builds only the rows its devices hold and the global jax.Array is assembled from those.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import NamedSharding

from .config import Config
from .corpus import generate_corpus


@functools.lru_cache(maxsize=4)
def corpus_array(seed: int) -> np.ndarray:
    return np.frombuffer(generate_corpus(seed), dtype=np.uint8)


def global_batch(step: int, config: Config) -> np.ndarray:
    """int32[global_batch_size, seq_len + 1] for global batch index `step`."""
    corpus = corpus_array(config.train.seed)
    width = config.model.seq_len + 1
    rng = np.random.default_rng([config.train.seed, step])
    starts = rng.integers(0, len(corpus) - width, size=config.train.global_batch_size)
    return corpus[starts[:, None] + np.arange(width)].astype(np.int32)


def local_rows(sharding: NamedSharding, global_shape: tuple[int, ...]) -> slice:
    """The contiguous block of batch rows held by this process's devices."""
    indices = sharding.addressable_devices_indices_map(global_shape).values()
    starts = [idx[0].start or 0 for idx in indices]
    stops = [global_shape[0] if idx[0].stop is None else idx[0].stop for idx in indices]
    lo, hi = min(starts), max(stops)
    covered = sum(stop - start for start, stop in {(a, b) for a, b in zip(starts, stops,
                                                                            strict=True)})
    if covered != hi - lo:
        raise RuntimeError(f"this process's batch rows are not contiguous: {sorted(starts)}")
    return slice(lo, hi)


def device_batch(step: int, config: Config, sharding: NamedSharding) -> jax.Array:
    """The global batch `step` as a sharded jax.Array, built from this process's rows only."""
    batch = global_batch(step, config)
    rows = local_rows(sharding, batch.shape)
    return jax.make_array_from_process_local_data(sharding, batch[rows], batch.shape)
