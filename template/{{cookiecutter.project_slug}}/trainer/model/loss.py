"""The training objective: mean next-token cross-entropy of the model's logits, computed in
float32, plus the weighted auxiliary losses the model reports (aux.py).

The model owns its head (TransformerLM.head: the last layer's output -> logits, with whatever
transform or loss term a variant adds there); this module only applies it and does the
cross-entropy. With model.loss_chunk_size = C > 0 the head and the loss run over the sequence in
chunks of C tokens inside a rematerialised scan, so only B x C x V logits exist at a time
(forward and backward) instead of B x L x V: with a 128k vocabulary that is the difference
between fitting in HBM and not. The value and the gradient equal the unchunked ones to float
tolerance, and what the head reports is the mean over the chunks (each a mean over its tokens).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from ..sharding import constrain
from . import aux

# (head params, x_BxCxD) -> float32 logits_BxCxV: a model's `head` (transformer.py).
HeadFn = Callable[[Any, jax.Array], jax.Array]


def _chunk_loss_sum(head: HeadFn, params: Any, x_BxCxD: jax.Array, targets_BxC: jax.Array
                    ) -> tuple[jax.Array, aux.Aux]:
    with aux.collect() as reported:
        logits_BxCxV = head(params, x_BxCxD)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits_BxCxV, targets_BxC).sum()
    return loss, reported.values


def cross_entropy(head: HeadFn, params: Any, x_BxLxD: jax.Array, targets_BxL: jax.Array,
                  chunk_size: int = 0) -> jax.Array:
    """Mean cross-entropy of head(params, x) against targets, chunked along L if asked; what
    the head reports goes to the enclosing aux.collect(), meaned over the chunks."""
    batch, length, d_model = x_BxLxD.shape
    if not chunk_size or chunk_size >= length:
        total, reported = _chunk_loss_sum(head, params, x_BxLxD, targets_BxL)
        aux.report_all(reported)
        return total / (batch * length)
    chunks = length // chunk_size
    x_NxBxCxD = jnp.swapaxes(x_BxLxD.reshape(batch, chunks, chunk_size, d_model), 0, 1)
    targets_NxBxC = jnp.swapaxes(targets_BxL.reshape(batch, chunks, chunk_size), 0, 1)
    # The backward pass recomputes each chunk's logits.
    chunk_loss = jax.checkpoint(functools.partial(_chunk_loss_sum, head))

    def add_chunk(total: jax.Array, chunk: tuple[jax.Array, jax.Array]):
        x_BxCxD, targets_BxC = chunk
        x_BxCxD = constrain(x_BxCxD, ("batch", "length", None))
        loss, reported = chunk_loss(params, x_BxCxD, targets_BxC)
        return total + loss, reported

    total, per_chunk = jax.lax.scan(add_chunk, jnp.zeros((), jnp.float32),
                                    (x_NxBxCxD, targets_NxBxC))
    aux.report_all({name: values.sum() / chunks for name, values in per_chunk.items()})
    return total / (batch * length)


def next_token_loss(model, inputs_BxL: jax.Array, targets_BxL: jax.Array,
                    chunk_size: int = 0, schedule=None) -> tuple[jax.Array, aux.Aux]:
    """(the objective, the auxiliary values) of one batch (change the objective here).

    The objective is the mean next-token cross-entropy plus weight x value of every auxiliary
    loss the model reported (aux.py); the values are everything it reported, with the
    cross-entropy alone as `cross_entropy` when there were weighted losses. `schedule` is the
    pipeline's (pipeline.Schedule), None without stages.
    """
    def mean_loss(head_params: Any, x_BxLxD: jax.Array, targets: jax.Array) -> jax.Array:
        return cross_entropy(model.head, head_params, x_BxLxD, targets, chunk_size)

    with aux.collect() as reported:
        if schedule is not None and schedule.stages > 1:
            ce = model.pipelined_loss(inputs_BxL, targets_BxL, schedule, mean_loss)
        else:
            ce = mean_loss(model.head_params(), model.hidden(inputs_BxL), targets_BxL)
    values = dict(reported.values)
    if not reported.weights:
        return ce, values
    return ce + aux.weighted_sum(values, reported.weights), {**values, "cross_entropy": ce}
