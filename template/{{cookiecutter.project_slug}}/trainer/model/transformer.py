"""A decoder-only transformer language model in Flax NNX.

Pre-norm blocks (RMSNorm -> causal self-attention with RoPE, RMSNorm -> GELU or SwiGLU MLP),
grouped-query attention when model.n_kv_heads < n_heads, tied or separate output projection.
With model.scan_layers the blocks are one stacked module (`nnx.vmap` at init, `nnx.scan` in the
forward pass), so compile time does not grow with depth; model.remat picks what the backward pass
recomputes. Every parameter carries logical axis names (see sharding.py) in its `out_sharding`
metadata; nothing here knows about the mesh. The attention cores live in attention.py, the loss
in loss.py (which applies the model's `head`); what a block reports (aux.py: a variant's
auxiliary losses and metrics) is carried out of the layer scan, remat and the pipeline's stages
as their outputs. A variant replaces a part by subclassing (`Block.mlp_class`,
`TransformerLM.block_class`, `layers_per_unit`, `head`: the README's "The seams of a model").

Initialisation: every matrix is N(0, 1/fan_in), the output projections of attention and MLP are
further divided by sqrt(2 * n_layers) (the residual stream then stays O(1) in depth), and the
embedding has std EMBED_STD / sqrt(d_model). A fresh model's logits then have std about
EMBED_STD and do not favour any token (not even the input one under tied embeddings), so the
first loss is within a few tenths of ln(vocab_size) (tests/test_model.py checks every preset).

Shape suffixes: B batch, L length, D d_model, H query heads, G key/value heads, K head dim,
F d_ff, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .. import pipeline
from ..config import ConfigError, ModelConfig
from ..sharding import constrain
from . import aux
from .attention import apply_rope, attend, attention_flops_per_token
from .decode import KVCache, cached_attention
from .registry import DEFAULT_KIND, register

EMBED_STD = 0.25
REMAT_POLICIES: dict[str, Callable | None] = {
    "full": None,  # save nothing but the block's input; recompute the whole block
    "save_matmuls": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _param(rngs: nnx.Rngs, stddev: float, shape: Sequence[int], logical: Sequence[str | None],
           dtype) -> nnx.Param:
    # eager_sharding=False: shardings are applied by the jitted init (train_step.py), not here.
    init = nnx.initializers.normal(stddev=stddev)
    return nnx.Param(init(rngs.params(), tuple(shape), dtype), out_sharding=tuple(logical),
                     eager_sharding=False)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, eps: float, param_dtype):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), out_sharding=("embed",),
                               eager_sharding=False)
        self.eps = eps

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        return rms_norm(x_BxLxD, self.scale[...], self.eps)


def rms_norm(x_BxLxD: jax.Array, scale_D: jax.Array, eps: float) -> jax.Array:
    x32 = x_BxLxD.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * scale_D.astype(jnp.float32)).astype(x_BxLxD.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, h, g, k = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_size
        pdt = jnp.dtype(cfg.param_dtype)
        out_std = (h * k * 2 * cfg.n_layers) ** -0.5
        self.wq_DxHxK = _param(rngs, d**-0.5, (d, h, k), ("embed", "heads", "kv"), pdt)
        self.wk_DxGxK = _param(rngs, d**-0.5, (d, g, k), ("embed", "heads", "kv"), pdt)
        self.wv_DxGxK = _param(rngs, d**-0.5, (d, g, k), ("embed", "heads", "kv"), pdt)
        self.wo_HxKxD = _param(rngs, out_std, (h, k, d), ("heads", "kv", "embed"), pdt)
        self.dtype = jnp.dtype(cfg.dtype)
        self.kind = cfg.attention
        self.rope = cfg.rope()

    def _project(self, x_BxLxD: jax.Array, positions_L: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries, keys and values of x, RoPE applied at `positions_L` (default 0..L-1)."""
        dt = self.dtype
        q_BxLxHxK = jnp.einsum("bld,dhk->blhk", x_BxLxD, self.wq_DxHxK[...].astype(dt))
        k_BxLxGxK = jnp.einsum("bld,dgk->blgk", x_BxLxD, self.wk_DxGxK[...].astype(dt))
        v_BxLxGxK = jnp.einsum("bld,dgk->blgk", x_BxLxD, self.wv_DxGxK[...].astype(dt))
        q_BxLxHxK = constrain(apply_rope(q_BxLxHxK, self.rope, positions_L),
                              ("batch", "length", "heads", None))
        k_BxLxGxK = constrain(apply_rope(k_BxLxGxK, self.rope, positions_L),
                              ("batch", "length", "heads", None))
        return q_BxLxHxK, k_BxLxGxK, v_BxLxGxK

    def _output(self, out_BxLxHxK: jax.Array) -> jax.Array:
        return jnp.einsum("blhk,hkd->bld", out_BxLxHxK, self.wo_HxKxD[...].astype(self.dtype))

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        q_BxLxHxK, k_BxLxGxK, v_BxLxGxK = self._project(x_BxLxD)
        return self._output(attend(self.kind, q_BxLxHxK, k_BxLxGxK, v_BxLxGxK))

    def decode(self, x_BxSxD: jax.Array, start: jax.Array, cache: KVCache
               ) -> tuple[jax.Array, KVCache]:
        """S new positions start..start+S-1 against the cache of the earlier ones; their keys
        and values are written into the cache (decode.py)."""
        positions_S = start + jnp.arange(x_BxSxD.shape[1])
        q_BxSxHxK, k_BxSxGxK, v_BxSxGxK = self._project(x_BxSxD, positions_S)
        cache = cache.write(start, k_BxSxGxK, v_BxSxGxK)
        return self._output(cached_attention(q_BxSxHxK, cache, positions_S)), cache


class Mlp(nnx.Module):
    """GELU: w_out(gelu(x w_in)). SwiGLU: w_out(silu(x w_gate) * (x w_in))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.d_ff
        pdt = jnp.dtype(cfg.param_dtype)
        self.gated = cfg.mlp == "swiglu"
        if self.gated:
            self.w_gate_DxF = _param(rngs, d**-0.5, (d, f), ("embed", "mlp"), pdt)
        self.w_in_DxF = _param(rngs, d**-0.5, (d, f), ("embed", "mlp"), pdt)
        self.w_out_FxD = _param(rngs, (f * 2 * cfg.n_layers) ** -0.5, (f, d), ("mlp", "embed"),
                                pdt)
        self.dtype = jnp.dtype(cfg.dtype)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        dt = self.dtype
        h_BxLxF = jnp.einsum("bld,df->blf", x_BxLxD, self.w_in_DxF[...].astype(dt))
        if self.gated:
            gate_BxLxF = jnp.einsum("bld,df->blf", x_BxLxD, self.w_gate_DxF[...].astype(dt))
            h_BxLxF = jax.nn.silu(gate_BxLxF) * h_BxLxF
        else:
            h_BxLxF = jax.nn.gelu(h_BxLxF)
        h_BxLxF = constrain(h_BxLxF, ("batch", "length", "mlp"))
        return jnp.einsum("blf,fd->bld", h_BxLxF, self.w_out_FxD[...].astype(dt))


class Block(nnx.Module):
    """One pre-norm layer. `position` is its place in the variant's repeating unit of layers
    (0 when a unit is one layer: TransformerLM.layers_per_unit), a Python int a block may build
    differently by; `layer`, the argument of every call, is its index in the whole stack (an
    int32 scalar, traced under the layer scan), for what differs by depth without new
    parameters."""

    # A variant replaces a part by subclassing: `mlp_class = MoeMlp` (model/registry.py).
    attention_class: type[nnx.Module] = Attention
    mlp_class: type[nnx.Module] = Mlp

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, position: int = 0):
        pdt = jnp.dtype(cfg.param_dtype)
        self.position = position
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=pdt)
        self.attn = self.attention_class(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=pdt)
        self.mlp = self.mlp_class(cfg, rngs=rngs)

    def __call__(self, x_BxLxD: jax.Array, layer: jax.Array) -> jax.Array:
        x_BxLxD = x_BxLxD + self.attn(self.attn_norm(x_BxLxD))
        x_BxLxD = constrain(x_BxLxD, ("batch", "length", None))
        x_BxLxD = x_BxLxD + self.mlp(self.mlp_norm(x_BxLxD))
        return constrain(x_BxLxD, ("batch", "length", None))

    def decode(self, x_BxSxD: jax.Array, start: jax.Array, cache: KVCache, layer: jax.Array
               ) -> tuple[jax.Array, KVCache]:
        attended, cache = self.attn.decode(self.attn_norm(x_BxSxD), start, cache)
        x_BxSxD = x_BxSxD + attended
        return x_BxSxD + self.mlp(self.mlp_norm(x_BxSxD)), cache


class Unit(nnx.Module):
    """`size` consecutive blocks, built with positions 0..size-1: the repeating piece of a
    variant whose layers follow a pattern (TransformerLM.layers_per_unit > 1). The layer scan,
    remat and the pipeline's stages treat a unit as one layer."""

    def __init__(self, block_class: type[Block], cfg: ModelConfig, size: int, *,
                 rngs: nnx.Rngs):
        self.layers = nnx.List([block_class(cfg, rngs=rngs, position=i) for i in range(size)])

    def __call__(self, x_BxLxD: jax.Array, unit: jax.Array) -> jax.Array:
        size = len(self.layers)
        for position, block in enumerate(self.layers):
            x_BxLxD = block(x_BxLxD, unit * size + position)
        return x_BxLxD

    def decode(self, x_BxSxD: jax.Array, start: jax.Array, caches: KVCache, unit: jax.Array
               ) -> tuple[jax.Array, KVCache]:
        size, written = len(self.layers), []
        for position, block in enumerate(self.layers):
            x_BxSxD, cache = block.decode(x_BxSxD, start, caches.layer(position),
                                          unit * size + position)
            written.append(cache)
        return x_BxSxD, KVCache.stack(written)


# (head params, hidden states x_BxCxD) -> float32 logits_BxCxV: the model's head (head()).
HeadFn = Callable[[Any, jax.Array], jax.Array]
# (head params, hidden states x_BxLxD, targets_BxL) -> the mean loss: what the loss hands the
# model's pipelined_loss to run on the last stage.
LossFn = Callable[[Any, jax.Array, jax.Array], jax.Array]


def _embed(embed_VxD: jax.Array, tokens_BxL: jax.Array, dtype) -> jax.Array:
    # The table is gathered whole along d_model first (what FSDP does for every weight): a
    # lookup in the fsdp-sharded table would come out sharded by d_model, and the backward
    # scatter would need the batch-sharded cotangent resharded that way, which XLA can only do
    # by replicating it ("involuntary full rematerialization").
    embed_VxD = constrain(embed_VxD, ("vocab", None))
    x_BxLxD = jnp.take(embed_VxD, tokens_BxL, axis=0).astype(dtype)
    return constrain(x_BxLxD, ("batch", "length", None))


UnitFn = Callable[[nnx.Module, jax.Array, jax.Array], tuple[jax.Array, aux.Aux]]


def _apply_unit(unit: nnx.Module, x_BxLxD: jax.Array, index: jax.Array
                ) -> tuple[jax.Array, aux.Aux]:
    """The unit (a Block, or a Unit of blocks) at stack index `index` and what it reported
    (aux.py): both leave the traced function (remat's, the scan body's) as its outputs."""
    with aux.collect() as reported:
        x_BxLxD = unit(x_BxLxD, index)
    return x_BxLxD, reported.values


def _scan_units(units: nnx.Module, indices_N: jax.Array, x_BxLxD: jax.Array, unit_fn: UnitFn,
                unroll: bool = False) -> jax.Array:
    """x through stacked units (a leading axis on every parameter, `indices_N` their places in
    the stack), one scan step each; `unroll`: as straight-line code, without a loop. What the
    blocks report is summed over the layers and reported on."""
    @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0), unroll=unroll,
              transform_metadata={nnx.PARTITION_NAME: "layers"})
    def through_layers(x_BxLxD: jax.Array, unit: nnx.Module, index: jax.Array
                       ) -> tuple[jax.Array, aux.Aux]:
        return unit_fn(unit, x_BxLxD, index)

    x_BxLxD, per_layer = through_layers(x_BxLxD, units, indices_N)
    aux.report_all({name: values.sum() for name, values in per_layer.items()})
    return x_BxLxD


class TransformerLM(nnx.Module):
    """The model as parts every path calls: `embed_tokens(embed_params(), tokens)`, the units of
    `blocks` (each called with its place in the stack), and `head(head_params(), x)`. The plain
    step, the pipeline (pipelined_loss), decoding and the logits (__call__) are built from these
    parts only, so a variant that replaces one (its own head, say) has it on every path."""

    block_class: type[Block] = Block  # a variant's own block: `block_class = MoeBlock`
    # Layers of the repeating unit: model.n_layers / this units are stacked, scanned,
    # rematerialised and split into pipeline stages as one (the checks count units).
    layers_per_unit: int = 1

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        pdt = jnp.dtype(cfg.param_dtype)
        d, size = cfg.d_model, self.layers_per_unit
        if size < 1 or cfg.n_layers % size:
            raise ConfigError(
                f"model.n_layers = {cfg.n_layers} is not a whole number of units of {size} "
                f"layers (model.kind = {cfg.kind!r} repeats its layers in units of {size}); use "
                f"a multiple of {size}")
        self.embed_VxD = _param(rngs, EMBED_STD * d**-0.5, (cfg.vocab_size, d),
                                ("vocab", "embed"), pdt)
        self.scan_layers = cfg.scan_layers
        self.units = cfg.n_layers // size

        def new_unit(rngs: nnx.Rngs) -> nnx.Module:
            return (self.block_class(cfg, rngs=rngs) if size == 1
                    else Unit(self.block_class, cfg, size, rngs=rngs))

        if cfg.scan_layers:
            @nnx.split_rngs(splits=self.units)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def stacked_units(rngs: nnx.Rngs) -> nnx.Module:
                return new_unit(rngs)

            self.blocks = stacked_units(rngs)
        else:
            self.blocks = nnx.List([new_unit(rngs) for _ in range(self.units)])
        self.final_norm = RMSNorm(d, eps=cfg.norm_eps, param_dtype=pdt)
        self.tied = cfg.tie_embeddings
        if not cfg.tie_embeddings:
            self.unembed_DxV = _param(rngs, EMBED_STD * d**-0.5, (d, cfg.vocab_size),
                                      ("embed", "vocab"), pdt)
        self.remat = cfg.remat
        self.dtype = jnp.dtype(cfg.dtype)
        self.cache_heads = (cfg.kv_heads, cfg.head_size)

    def _unit_fn(self, in_loop: bool | None = None) -> UnitFn:
        """`in_loop` (default: model.scan_layers): the units run as a loop's body, where the
        loop already keeps XLA from merging the backward pass's recomputation into the forward
        pass; unrolled or unscanned units need remat's own barrier (prevent_cse)."""
        if self.remat == "none":
            return _apply_unit
        in_loop = self.scan_layers if in_loop is None else in_loop
        return nnx.remat(_apply_unit, policy=REMAT_POLICIES[self.remat], prevent_cse=not in_loop)

    # -- the parts ------------------------------------------------------------------------

    def embed_params(self) -> Any:
        """What embed_tokens reads: the embedding table."""
        return self.embed_VxD[...]

    def embed_tokens(self, params: Any, tokens_BxL: jax.Array) -> jax.Array:
        """Token ids -> the residual stream x_BxLxD (compute dtype), from `params` only."""
        return _embed(params, tokens_BxL, self.dtype)

    def head_params(self) -> Any:
        """What head reads: (the final norm's scale, the output projection)."""
        return self.final_norm.scale[...], self.unembedding()

    def head(self, params: Any, x_BxCxD: jax.Array) -> jax.Array:
        """The last layer's output x_BxCxD (C: the whole sequence, or a chunk of it under
        model.loss_chunk_size) -> float32 logits_BxCxV, from `params` only (the pipeline runs it
        on the last stage with its own copy). A transform of the logits goes here; what it
        reports (aux.py) is a mean over the tokens it saw, averaged over chunks."""
        scale_D, unembed_DxV = params
        logits_BxCxV = jnp.einsum("bcd,dv->bcv", rms_norm(x_BxCxD, scale_D, self.final_norm.eps),
                                  unembed_DxV, preferred_element_type=jnp.float32)
        return constrain(logits_BxCxV, ("batch", "length", "vocab"))

    def unembedding(self) -> jax.Array:
        """The output projection unembed_DxV in the compute dtype."""
        unembed_DxV = self.embed_VxD[...].T if self.tied else self.unembed_DxV[...]
        return unembed_DxV.astype(self.dtype)

    def init_cache(self, batch: int, length: int) -> KVCache:
        """Empty key/value caches of every layer for `length` positions (decode)."""
        kv_heads, head_dim = self.cache_heads
        size = self.layers_per_unit
        caches = KVCache.zeros(self.units * size, batch, length, kv_heads, head_dim, self.dtype)
        if size == 1:
            return caches
        return jax.tree.map(lambda leaf: leaf.reshape(self.units, size, *leaf.shape[1:]), caches)

    # -- the paths, built from the parts --------------------------------------------------

    def embed(self, tokens_BxL: jax.Array) -> jax.Array:
        return self.embed_tokens(self.embed_params(), tokens_BxL)

    def hidden(self, tokens_BxL: jax.Array) -> jax.Array:
        """Token ids -> the last layer's output x_BxLxD (the head's input), no stages; what the
        blocks report (aux.py) goes to the enclosing aux.collect()."""
        x_BxLxD = self.embed(tokens_BxL)
        unit_fn = self._unit_fn()
        if self.scan_layers:
            return _scan_units(self.blocks, jnp.arange(self.units, dtype=jnp.int32), x_BxLxD,
                               unit_fn)
        for index, unit in enumerate(self.blocks):
            x_BxLxD, reported = unit_fn(unit, x_BxLxD, jnp.int32(index))
            aux.report_all(reported)
        return x_BxLxD

    def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
        """Token ids -> float32 logits_BxLxV (materialised; the train loss uses loss.py)."""
        return self.head(self.head_params(), self.hidden(tokens_BxL))

    def decode(self, tokens_BxS: jax.Array, start: jax.Array, caches: KVCache
               ) -> tuple[jax.Array, KVCache]:
        """Float32 logits of S new tokens at positions start..start+S-1, given the key/value
        caches of every layer (init_cache) for the positions before; the caches come back with
        these positions written. No pipeline, no remat: inference."""
        with aux.muted():
            return self._decode(tokens_BxS, start, caches)

    def _decode(self, tokens_BxS: jax.Array, start: jax.Array, caches: KVCache
                ) -> tuple[jax.Array, KVCache]:
        x_BxSxD = self.embed(tokens_BxS)
        if self.scan_layers:
            @nnx.scan(in_axes=(nnx.Carry, 0, 0, 0), out_axes=(nnx.Carry, 0),
                      transform_metadata={nnx.PARTITION_NAME: "layers"})
            def through_layers(x_BxSxD: jax.Array, unit: nnx.Module, cache: KVCache,
                               index: jax.Array):
                return unit.decode(x_BxSxD, start, cache, index)

            x_BxSxD, caches = through_layers(x_BxSxD, self.blocks, caches,
                                             jnp.arange(self.units, dtype=jnp.int32))
        else:
            written = []
            for index, unit in enumerate(self.blocks):
                x_BxSxD, cache = unit.decode(x_BxSxD, start, caches.layer(index),
                                             jnp.int32(index))
                written.append(cache)
            caches = KVCache.stack(written)
        return self.head(self.head_params(), x_BxSxD), caches

    def pipelined_loss(self, tokens_BxL: jax.Array, targets_BxL: jax.Array,
                       schedule: pipeline.Schedule, loss_fn: LossFn) -> jax.Array:
        """`loss_fn(head_params(), the last layer's output, targets)` with the units run as
        `schedule`'s pipeline (pipeline.py): stage 0 runs embed_tokens, the last stage
        `loss_fn` (which calls head). The stacked units are in stage order
        (pipeline.to_stage_order), and so are the places in the stack they are called with."""
        if not self.scan_layers:
            raise ValueError("a pipeline needs model.scan_layers = true")
        graphdef, stacked = nnx.split(self.blocks)
        indices_N = pipeline.to_stage_order(jnp.arange(self.units, dtype=jnp.int32),
                                            schedule.stages, schedule.repeats)
        unroll = schedule.unrolled(self.units)
        unit_fn = self._unit_fn(in_loop=not unroll)

        def stage(layers: tuple[Any, jax.Array], x_BxLxD: jax.Array) -> jax.Array:
            state, indices = layers
            return _scan_units(nnx.merge(graphdef, state), indices, x_BxLxD, unit_fn,
                               unroll=unroll)

        return pipeline.loss(
            stage, (stacked, indices_N),
            first=(self.embed_tokens, self.embed_params()),
            last=(loss_fn, self.head_params()),
            inputs_BxF=tokens_BxL, targets_BxF=targets_BxL, schedule=schedule)


def param_count(cfg: ModelConfig) -> int:
    """Exact number of parameters (matches the initialised model)."""
    d, f, v, n = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.n_layers
    h, g, k = cfg.n_heads, cfg.kv_heads, cfg.head_size
    attention = d * h * k + 2 * d * g * k + h * k * d
    mlp = (3 if cfg.mlp == "swiglu" else 2) * d * f
    per_block = attention + mlp + 2 * d
    return v * d + n * per_block + d + (0 if cfg.tie_embeddings else d * v)


def flops_per_token(cfg: ModelConfig) -> int:
    """Training FLOPs per token: 6 * N_matmul + n_layers * causal attention FLOPs.

    N_matmul counts every weight used in a matmul: the attention projections, the MLP and the
    d_model x vocab output projection (it runs even when tied; the embedding lookup is free).
    Each such weight costs 2 FLOPs per token forward and 4 backward. Attention scores and the
    weighted sum are counted for the causal half only, whatever model.attention computes
    (`attention.attention_flops_per_token`), so MFU compares implementations fairly.
    """
    d, f, v, n = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.n_layers
    h, g, k = cfg.n_heads, cfg.kv_heads, cfg.head_size
    per_layer = d * h * k + 2 * d * g * k + h * k * d + (3 if cfg.mlp == "swiglu" else 2) * d * f
    n_matmul = n * per_layer + d * v
    return int(6 * n_matmul + n * attention_flops_per_token(cfg.seq_len, h, k))


register(DEFAULT_KIND, param_count=param_count, flops_per_token=flops_per_token)(TransformerLM)
