"""Fingerprints that prove two runs saw the same data and reached the same parameters.

Both are computed on the devices, under whatever sharding the arrays have, and reduced by XLA:
only a few bytes cross between hosts, nothing is gathered, and the value does not depend on the
mesh or the number of processes. Each element's bits are hashed together with its position and
the hashes are summed in wrapping uint32 arithmetic, which is order-independent.

    batch_digest(tokens)     uint32 of a token batch (logged per step as `batch_digest`)
    params_digest(params)    hex string: sha256 over each leaf's path, dtype, shape and two
                             independent 32-bit element hashes (the summary's `params_digest`)
"""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec


def _mix(x: jax.Array) -> jax.Array:
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def batch_digest(tokens: jax.Array) -> jax.Array:
    """uint32 fingerprint of a token batch; independent of how the batch is sharded."""
    flat = tokens.reshape(-1).astype(jnp.uint32)
    position = jnp.arange(flat.shape[0], dtype=jnp.uint32)
    return jnp.sum(_mix(_mix(position) ^ (flat + jnp.uint32(1))), dtype=jnp.uint32)


def _bits(x: jax.Array) -> jax.Array:
    """The raw bits of every element as uint32 (exact: bitcasts, never value conversions)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    width = x.dtype.itemsize
    if width == 8:
        halves = jax.lax.bitcast_convert_type(x, jnp.uint32)  # [..., 2]
        return halves[..., 0] ^ _mix(halves[..., 1])
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[width]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _leaf_hashes(x: jax.Array) -> jax.Array:
    flat = _bits(x).reshape(-1)
    position = jnp.arange(flat.shape[0], dtype=jnp.uint32)
    first = jnp.sum(_mix(_mix(position) ^ flat), dtype=jnp.uint32)
    second = jnp.sum(_mix(_mix(position ^ jnp.uint32(0x9E3779B9)) + _mix(flat ^ jnp.uint32(
        0x85EBCA6B))), dtype=jnp.uint32)
    return jnp.stack([first, second])


def params_digest(params: Any) -> str:
    """sha256 of the parameters' fingerprints; identical on every process, for any mesh."""
    leaves = sorted(jax.tree_util.tree_flatten_with_path(params)[0],
                    key=lambda item: jax.tree_util.keystr(item[0]))
    arrays = [leaf for _, leaf in leaves]
    out_sharding = None
    shardings = [a.sharding for a in arrays if isinstance(getattr(a, "sharding", None),
                                                          NamedSharding)]
    if shardings:
        out_sharding = NamedSharding(shardings[0].mesh, PartitionSpec())
    hashes = jax.jit(lambda xs: jnp.stack([_leaf_hashes(x) for x in xs]),
                     out_shardings=out_sharding)(arrays)
    local = np.asarray(hashes.addressable_data(0))  # replicated: every process has all of it
    digest = hashlib.sha256()
    for (path, leaf), pair in zip(leaves, local, strict=True):
        digest.update(jax.tree_util.keystr(path).encode())
        digest.update(f"{np.dtype(leaf.dtype).str}{tuple(leaf.shape)}".encode())
        digest.update(pair.astype("<u4").tobytes())
    return digest.hexdigest()


def rng_digest(key: jax.Array) -> str:
    return hashlib.sha256(np.asarray(jax.random.key_data(key)).tobytes()).hexdigest()[:16]
