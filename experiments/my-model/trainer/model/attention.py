"""Causal self-attention cores, selected by `model.attention`; all take and return BxLxHxK.

    dense        the reference: explicit L x L scores in float32, causal mask, softmax
    dot_product  `jax.nn.dot_product_attention` (cuDNN's fused kernel on GPU, XLA elsewhere)
    splash       the Pallas splash-attention kernel (TPU; skips fully masked blocks). Off TPU it
                 runs in Pallas interpret mode, which executes the same kernel code on CPU

Queries have H heads, keys and values G heads with H % G == 0 (grouped-query attention: query
head h reads key/value head h // (H / G)). Every implementation matches `dense` to float
tolerance (tests/test_attention.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..sharding import logical_to_spec
from .rope import Rope


def _repeat_kv(x_BxLxGxK: jax.Array, num_heads: int) -> jax.Array:
    groups = num_heads // x_BxLxGxK.shape[2]
    return x_BxLxGxK if groups == 1 else jnp.repeat(x_BxLxGxK, groups, axis=2)


def masked(q_BxLxHxK: jax.Array, k_BxMxGxK: jax.Array, v_BxMxGxK: jax.Array,
           visible_LxM: jax.Array) -> jax.Array:
    """Attention of L queries over M keys where `visible_LxM`, with float32 scores: the
    reference that `dense` (a causal mask) and the decode cache (decode.py) both use."""
    heads, head_dim = q_BxLxHxK.shape[2], q_BxLxHxK.shape[3]
    k_BxMxHxK = _repeat_kv(k_BxMxGxK, heads)
    v_BxMxHxK = _repeat_kv(v_BxMxGxK, heads)
    scores_BxHxLxM = jnp.einsum("blhk,bmhk->bhlm", q_BxLxHxK, k_BxMxHxK,
                                preferred_element_type=jnp.float32) * head_dim**-0.5
    scores_BxHxLxM = jnp.where(visible_LxM, scores_BxHxLxM, jnp.finfo(jnp.float32).min)
    probs_BxHxLxM = jax.nn.softmax(scores_BxHxLxM, axis=-1).astype(v_BxMxHxK.dtype)
    return jnp.einsum("bhlm,bmhk->blhk", probs_BxHxLxM, v_BxMxHxK)


def dense(q_BxLxHxK: jax.Array, k_BxLxGxK: jax.Array, v_BxLxGxK: jax.Array) -> jax.Array:
    length = q_BxLxHxK.shape[1]
    causal_LxL = jnp.tril(jnp.ones((length, length), dtype=bool))
    return masked(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, causal_LxL)


def dot_product(q_BxLxHxK: jax.Array, k_BxLxGxK: jax.Array, v_BxLxGxK: jax.Array) -> jax.Array:
    # implementation=None: cuDNN where it supports the shapes and dtype, XLA otherwise.
    return jax.nn.dot_product_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, is_causal=True)


def _splash_kernel(heads: int, length: int, interpret: bool):
    """The splash kernel for these shapes, built inside the trace that uses it.

    The kernel holds the mask's block tables as arrays. Cached across traces it would hold the
    first trace's tracers and leak them into the next jitted program (the eval step after the
    train step: UnexpectedTracerError); the mask is made once per trace instead.
    """
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    block = min(512, length)
    sizes = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                          block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                          block_q_dq=block, block_kv_dq=block)
    return sk.make_splash_mha(_causal_mask(heads, length), block_sizes=sizes, head_shards=1,
                              q_seq_shards=1, interpret=interpret)


@functools.lru_cache(maxsize=16)
def _causal_mask(heads: int, length: int):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    return sm.MultiHeadMask([sm.CausalMask((length, length)) for _ in range(heads)])


def _splash_local(q_BxLxHxK: jax.Array, k_BxLxHxK: jax.Array, v_BxLxHxK: jax.Array,
                  interpret: bool) -> jax.Array:
    _, length, heads, head_dim = q_BxLxHxK.shape
    kernel = _splash_kernel(heads, length, interpret)
    # The kernel does not scale: fold 1/sqrt(K) into the queries. It works on HxLxK per example.
    q_BxHxLxK = jnp.swapaxes(q_BxLxHxK * head_dim**-0.5, 1, 2)
    out_BxHxLxK = jax.vmap(kernel)(q_BxHxLxK, jnp.swapaxes(k_BxLxHxK, 1, 2),
                                   jnp.swapaxes(v_BxLxHxK, 1, 2))
    return jnp.swapaxes(out_BxHxLxK, 1, 2).astype(q_BxLxHxK.dtype)


def splash(q_BxLxHxK: jax.Array, k_BxLxGxK: jax.Array, v_BxLxGxK: jax.Array) -> jax.Array:
    heads = q_BxLxHxK.shape[2]
    k_BxLxHxK = _repeat_kv(k_BxLxGxK, heads)
    v_BxLxHxK = _repeat_kv(v_BxLxGxK, heads)
    interpret = jax.devices()[0].platform != "tpu"
    local = functools.partial(_splash_local, interpret=interpret)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return local(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK)
    # A Pallas kernel sees one device's block: map it over the batch and head shards.
    spec = logical_to_spec(("batch", "length", "heads", None))
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec,
                         check_vma=False)(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK)


IMPLEMENTATIONS = {"dense": dense, "dot_product": dot_product, "splash": splash}


def attend(kind: str, q_BxLxHxK: jax.Array, k_BxLxGxK: jax.Array,
           v_BxLxGxK: jax.Array) -> jax.Array:
    return IMPLEMENTATIONS[kind](q_BxLxHxK, k_BxLxGxK, v_BxLxGxK)


def attention_flops_per_token(seq_len: int, n_heads: int, head_dim: int) -> float:
    """Forward + backward FLOPs per token per layer of QK^T and PV under the causal mask.

    Counted for the causal half only (query i attends to i + 1 keys, mean (L + 1) / 2): an
    implementation that computes the masked half (dense, XLA) does not earn credit for it, and
    one that skips masked blocks (splash, cuDNN) is not over-credited.
    """
    mean_keys = (seq_len + 1) / 2
    return 3 * 2 * 2 * mean_keys * n_heads * head_dim  # (fwd + 2x bwd) x 2 matmuls x 2 FLOP/MAC


def rope_tables(positions_L: jax.Array | np.ndarray, rope: Rope) -> tuple[jax.Array, jax.Array]:
    """cos and sin, each [L, head_dim // 2], at these positions."""
    inv_freq = jnp.asarray(rope.inv_freq(), jnp.float32)
    angles_LxK2 = jnp.asarray(positions_L, jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles_LxK2), jnp.sin(angles_LxK2)


def apply_rope(x_BxLxHxK: jax.Array, rope: Rope,
               positions_L: jax.Array | np.ndarray | None = None) -> jax.Array:
    """Rotate channel pairs (i, i + K/2) by position-dependent angles (the Llama/NeoX layout,
    Hugging Face's `rotate_half`). Positions default to 0..L-1; a decode step passes its own."""
    length = x_BxLxHxK.shape[1]
    if positions_L is None:
        positions_L = np.arange(length)
    cos_LxK2, sin_LxK2 = rope_tables(positions_L, rope)
    cos = cos_LxK2[None, :, None, :]
    sin = sin_LxK2[None, :, None, :]
    x32 = x_BxLxHxK.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x_BxLxHxK.dtype)
