"""A decoder-only transformer language model in Flax NNX.

Pre-norm blocks (RMSNorm -> causal self-attention, RMSNorm -> GELU MLP), byte vocabulary by
default. Every parameter carries logical axis names (see sharding.py) in its `out_sharding`
metadata; nothing here knows about the mesh.

Shape suffixes: B batch, L length, D d_model, H heads, K head dim, F d_ff, V vocab.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from .config import ModelConfig
from .sharding import constrain


def _param(rngs: nnx.Rngs, init, shape: Sequence[int], logical: Sequence[str | None],
           dtype) -> nnx.Param:
    # eager_sharding=False: shardings are applied by the jitted init (train_step.py), not here.
    return nnx.Param(init(rngs.params(), tuple(shape), dtype), out_sharding=tuple(logical),
                     eager_sharding=False)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, param_dtype, eps: float = 1e-6):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), out_sharding=("embed",),
                               eager_sharding=False)
        self.eps = eps

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        x32 = x_BxLxD.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...].astype(jnp.float32)).astype(x_BxLxD.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, h = cfg.d_model, cfg.n_heads
        k = d // h
        pdt = jnp.dtype(cfg.param_dtype)
        init = nnx.initializers.normal(stddev=d**-0.5)
        out_init = nnx.initializers.normal(stddev=(d * 2 * cfg.n_layers) ** -0.5)
        self.wq_DxHxK = _param(rngs, init, (d, h, k), ("embed", "heads", "kv"), pdt)
        self.wk_DxHxK = _param(rngs, init, (d, h, k), ("embed", "heads", "kv"), pdt)
        self.wv_DxHxK = _param(rngs, init, (d, h, k), ("embed", "heads", "kv"), pdt)
        self.wo_HxKxD = _param(rngs, out_init, (h, k, d), ("heads", "kv", "embed"), pdt)
        self.dtype = jnp.dtype(cfg.dtype)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        dt = self.dtype
        q_BxLxHxK = jnp.einsum("bld,dhk->blhk", x_BxLxD, self.wq_DxHxK[...].astype(dt))
        k_BxLxHxK = jnp.einsum("bld,dhk->blhk", x_BxLxD, self.wk_DxHxK[...].astype(dt))
        v_BxLxHxK = jnp.einsum("bld,dhk->blhk", x_BxLxD, self.wv_DxHxK[...].astype(dt))
        q_BxLxHxK = constrain(q_BxLxHxK, ("batch", "length", "heads", None))
        head_dim = q_BxLxHxK.shape[-1]
        scores_BxHxLxL = jnp.einsum("blhk,bmhk->bhlm", q_BxLxHxK, k_BxLxHxK).astype(jnp.float32)
        scores_BxHxLxL = scores_BxHxLxL * head_dim**-0.5
        length = x_BxLxD.shape[1]
        causal_LxL = jnp.tril(jnp.ones((length, length), dtype=bool))
        scores_BxHxLxL = jnp.where(causal_LxL, scores_BxHxLxL, jnp.finfo(jnp.float32).min)
        probs_BxHxLxL = jax.nn.softmax(scores_BxHxLxL, axis=-1).astype(dt)
        out_BxLxHxK = jnp.einsum("bhlm,bmhk->blhk", probs_BxHxLxL, v_BxLxHxK)
        return jnp.einsum("blhk,hkd->bld", out_BxLxHxK, self.wo_HxKxD[...].astype(dt))


class Mlp(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.d_ff
        pdt = jnp.dtype(cfg.param_dtype)
        self.w_in_DxF = _param(rngs, nnx.initializers.normal(stddev=d**-0.5), (d, f),
                               ("embed", "mlp"), pdt)
        self.w_out_FxD = _param(rngs, nnx.initializers.normal(stddev=(f * 2 * cfg.n_layers)**-0.5),
                                (f, d), ("mlp", "embed"), pdt)
        self.dtype = jnp.dtype(cfg.dtype)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        h_BxLxF = jnp.einsum("bld,df->blf", x_BxLxD, self.w_in_DxF[...].astype(self.dtype))
        h_BxLxF = constrain(jax.nn.gelu(h_BxLxF), ("batch", "length", "mlp"))
        return jnp.einsum("blf,fd->bld", h_BxLxF, self.w_out_FxD[...].astype(self.dtype))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        pdt = jnp.dtype(cfg.param_dtype)
        self.attn_norm = RMSNorm(cfg.d_model, param_dtype=pdt)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, param_dtype=pdt)
        self.mlp = Mlp(cfg, rngs=rngs)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        x_BxLxD = x_BxLxD + self.attn(self.attn_norm(x_BxLxD))
        x_BxLxD = constrain(x_BxLxD, ("batch", "length", None))
        x_BxLxD = x_BxLxD + self.mlp(self.mlp_norm(x_BxLxD))
        return constrain(x_BxLxD, ("batch", "length", None))


class TransformerLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        pdt = jnp.dtype(cfg.param_dtype)
        self.embed_VxD = _param(rngs, nnx.initializers.normal(stddev=1.0),
                                (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), pdt)
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.final_norm = RMSNorm(cfg.d_model, param_dtype=pdt)
        self.unembed_DxV = None
        if not cfg.tie_embeddings:
            self.unembed_DxV = _param(rngs, nnx.initializers.normal(stddev=cfg.d_model**-0.5),
                                      (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), pdt)
        self.dtype = jnp.dtype(cfg.dtype)
        self.d_model = cfg.d_model

    def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
        """Token ids -> float32 logits_BxLxV."""
        x_BxLxD = jnp.take(self.embed_VxD[...], tokens_BxL, axis=0).astype(self.dtype)
        x_BxLxD = constrain(x_BxLxD, ("batch", "length", None))
        for block in self.blocks:
            x_BxLxD = block(x_BxLxD)
        x_BxLxD = self.final_norm(x_BxLxD)
        if self.unembed_DxV is None:
            # Tied: reuse the embedding, scaled so initial logits are O(1).
            unembed_DxV = self.embed_VxD[...].T * self.d_model**-0.5
        else:
            unembed_DxV = self.unembed_DxV[...]
        logits_BxLxV = jnp.einsum("bld,dv->blv", x_BxLxD, unembed_DxV.astype(self.dtype))
        return constrain(logits_BxLxV.astype(jnp.float32), ("batch", "length", "vocab"))


def param_count(cfg: ModelConfig) -> int:
    """Exact number of parameters (matches the initialised model)."""
    d, f, v, n = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.n_layers
    per_block = 4 * d * d + 2 * d * f + 2 * d
    return v * d + n * per_block + d + (0 if cfg.tie_embeddings else d * v)


def flops_per_token(cfg: ModelConfig) -> int:
    """Training FLOPs per token: 6 * N_matmul + 12 * n_layers * seq_len * d_model.

    N_matmul counts every weight used in a matmul: n_layers * (4 d^2 + 2 d d_ff) plus the
    d * vocab output projection (which runs even when tied; the embedding lookup is free).
    Each such weight costs 2 FLOPs per token forward and 4 backward. Attention scores and the
    weighted sum (QK^T and PV) cost 2 * 2 * seq_len * d_model forward per token per layer, so
    12 * seq_len * d_model for forward + backward; the causal mask is not discounted because
    the dense implementation computes the full L x L product.
    """
    d, f, v, n, length = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.n_layers, cfg.seq_len
    n_matmul = n * (4 * d * d + 2 * d * f) + d * v
    return 6 * n_matmul + 12 * n * length * d
