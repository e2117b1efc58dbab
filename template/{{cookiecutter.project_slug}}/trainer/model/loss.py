"""The training objective: mean next-token cross-entropy, computed in float32, plus the weighted
auxiliary losses a model reports (aux.py).

With model.loss_chunk_size = C > 0 the output projection and the loss run over the sequence in
chunks of C tokens inside a rematerialised scan, so only B x C x V logits exist at a time (forward
and backward) instead of B x L x V: with a 128k vocabulary that is the difference between
fitting in HBM and not. The value and the gradient equal the unchunked ones to float tolerance.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from ..sharding import constrain
from . import aux


def _chunk_loss_sum(x_BxCxD: jax.Array, unembed_DxV: jax.Array, targets_BxC: jax.Array
                    ) -> jax.Array:
    logits_BxCxV = jnp.einsum("bcd,dv->bcv", x_BxCxD, unembed_DxV,
                              preferred_element_type=jnp.float32)
    logits_BxCxV = constrain(logits_BxCxV, ("batch", "length", "vocab"))
    return optax.softmax_cross_entropy_with_integer_labels(logits_BxCxV, targets_BxC).sum()


def cross_entropy(x_BxLxD: jax.Array, unembed_DxV: jax.Array, targets_BxL: jax.Array,
                  chunk_size: int = 0) -> jax.Array:
    """Mean cross-entropy of logits x @ unembed against targets, chunked along L if asked."""
    batch, length, d_model = x_BxLxD.shape
    if not chunk_size or chunk_size >= length:
        return _chunk_loss_sum(x_BxLxD, unembed_DxV, targets_BxL) / (batch * length)
    chunks = length // chunk_size
    x_NxBxCxD = jnp.swapaxes(x_BxLxD.reshape(batch, chunks, chunk_size, d_model), 0, 1)
    targets_NxBxC = jnp.swapaxes(targets_BxL.reshape(batch, chunks, chunk_size), 0, 1)
    chunk_loss = jax.checkpoint(_chunk_loss_sum)  # the backward pass recomputes each chunk

    def add_chunk(total: jax.Array, chunk: tuple[jax.Array, jax.Array]):
        x_BxCxD, targets_BxC = chunk
        x_BxCxD = constrain(x_BxCxD, ("batch", "length", None))
        return total + chunk_loss(x_BxCxD, unembed_DxV, targets_BxC), None

    total, _ = jax.lax.scan(add_chunk, jnp.zeros((), jnp.float32), (x_NxBxCxD, targets_NxBxC))
    return total / (batch * length)


def next_token_loss(model, inputs_BxL: jax.Array, targets_BxL: jax.Array,
                    chunk_size: int = 0, schedule=None) -> tuple[jax.Array, aux.Aux]:
    """(the objective, the auxiliary values) of one batch (change the objective here).

    The objective is the mean next-token cross-entropy plus weight x value of every auxiliary
    loss the model reported (aux.py); the values are everything it reported, with the
    cross-entropy alone as `cross_entropy` when there were weighted losses. `schedule` is the
    pipeline's (pipeline.Schedule), None without stages.
    """
    def mean_loss(x_BxLxD: jax.Array, unembed_DxV: jax.Array, targets: jax.Array) -> jax.Array:
        return cross_entropy(x_BxLxD, unembed_DxV, targets, chunk_size)

    with aux.collect() as reported:
        if schedule is not None and schedule.stages > 1:
            ce = model.pipelined_loss(inputs_BxL, targets_BxL, schedule, mean_loss)
        else:
            ce = mean_loss(model.hidden(inputs_BxL), model.unembedding(), targets_BxL)
    values = dict(reported.values)
    if not reported.weights:
        return ce, values
    return ce + aux.weighted_sum(values, reported.weights), {**values, "cross_entropy": ce}
