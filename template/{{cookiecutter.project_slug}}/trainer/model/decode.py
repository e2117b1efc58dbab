"""Greedy decoding with a key/value cache, and the same without one (its reference).

`TransformerLM.decode(tokens_BxS, start, caches)` (caches from its `init_cache`) runs S new
positions against the cached keys and values of the earlier ones and writes theirs: the prompt in
one call (prefill), then one token per call. Every shape is fixed by the cache length T, so
each of the two programs compiles once. `greedy_uncached` recomputes the whole prefix for each
new token through the training forward pass (`TransformerLM.__call__`), padded to T so it too
compiles once; tests require the two to agree token for token. A sanity check after training,
not a serving engine: one sequence at a time, no sampling temperature, no batching of requests.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .attention import masked


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values after RoPE, k_BxTxGxK and v_BxTxGxK (a leading layer axis when stacked)."""

    k: jax.Array
    v: jax.Array

    @classmethod
    def zeros(cls, layers: int, batch: int, length: int, kv_heads: int, head_dim: int,
              dtype: Any) -> KVCache:
        shape = (layers, batch, length, kv_heads, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    def write(self, start: jax.Array, k_BxSxGxK: jax.Array, v_BxSxGxK: jax.Array) -> KVCache:
        at = (0, start, 0, 0)
        return KVCache(jax.lax.dynamic_update_slice(self.k, k_BxSxGxK.astype(self.k.dtype), at),
                       jax.lax.dynamic_update_slice(self.v, v_BxSxGxK.astype(self.v.dtype), at))

    def layer(self, index: int) -> KVCache:
        return KVCache(self.k[index], self.v[index])

    @classmethod
    def stack(cls, caches: Sequence[KVCache]) -> KVCache:
        return cls(jnp.stack([c.k for c in caches]), jnp.stack([c.v for c in caches]))


def cached_attention(q_BxSxHxK: jax.Array, cache: KVCache, positions_S: jax.Array) -> jax.Array:
    """Causal attention of S queries at `positions_S` over the whole cache: key position j is
    seen by a query at position p when j <= p (later slots are not written yet)."""
    visible_SxT = jnp.arange(cache.k.shape[1])[None, :] <= positions_S[:, None]
    return masked(q_BxSxHxK, cache.k, cache.v, visible_SxT)


@dataclasses.dataclass(frozen=True)
class Decoded:
    ids: list[int]  # the new tokens only
    prefill_s: float  # the prompt's pass (compilation included on the first call)
    decode_s: float  # the new tokens after the first
    tokens_per_s: float  # new tokens after the first, per second of decode_s


def _check_length(prompt: Sequence[int], new_tokens: int, length: int) -> None:
    if not prompt:
        raise ValueError("the prompt is empty; give at least one token")
    if new_tokens < 1:
        raise ValueError(f"max_new_tokens = {new_tokens}: must be >= 1")
    if len(prompt) + new_tokens > length:
        raise ValueError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({new_tokens}) = "
                         f"{len(prompt) + new_tokens} exceeds the {length} positions decoded "
                         "(model.seq_len); shorten one")


def greedy_cached(model: Any, prompt: Sequence[int], new_tokens: int, length: int) -> Decoded:
    """Greedy continuation of `prompt` by `new_tokens` tokens with a cache of `length` slots."""
    from flax import nnx

    _check_length(prompt, new_tokens, length)
    caches = model.init_cache(1, length)
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state: Any, tokens_1xS: jax.Array, start: jax.Array, caches: KVCache):
        logits_1xSxV, caches = nnx.merge(graphdef, state).decode(tokens_1xS, start, caches)
        return jnp.argmax(logits_1xSxV[0, -1]).astype(jnp.int32), caches

    t0 = time.perf_counter()
    token, caches = step(state, jnp.asarray([list(prompt)], jnp.int32), jnp.int32(0), caches)
    ids = [int(token)]
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for position in range(len(prompt), len(prompt) + new_tokens - 1):
        token, caches = step(state, token.reshape(1, 1), jnp.int32(position), caches)
        ids.append(int(token))
    decode_s = time.perf_counter() - t0
    return Decoded(ids, prefill_s, decode_s, (new_tokens - 1) / decode_s if decode_s else 0.0)


def greedy_uncached(model: Any, prompt: Sequence[int], new_tokens: int, length: int) -> Decoded:
    """The same continuation by the full forward pass over the whole prefix for every token."""
    from flax import nnx

    _check_length(prompt, new_tokens, length)
    graphdef, state = nnx.split(model)

    @jax.jit
    def next_token(state: Any, tokens_1xT: jax.Array, last: jax.Array) -> jax.Array:
        logits_1xTxV = nnx.merge(graphdef, state)(tokens_1xT)  # causal: padding is not seen
        return jnp.argmax(logits_1xTxV[0, last]).astype(jnp.int32)

    tokens = jnp.zeros((1, length), jnp.int32).at[0, :len(prompt)].set(jnp.asarray(prompt))
    t0 = time.perf_counter()
    ids = [int(next_token(state, tokens, jnp.int32(len(prompt) - 1)))]
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for position in range(len(prompt), len(prompt) + new_tokens - 1):
        tokens = tokens.at[0, position].set(ids[-1])
        ids.append(int(next_token(state, tokens, jnp.int32(position))))
    decode_s = time.perf_counter() - t0
    return Decoded(ids, prefill_s, decode_s, (new_tokens - 1) / decode_s if decode_s else 0.0)
