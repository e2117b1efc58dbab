"""Pipeline parallelism over the mesh's `pipeline` axis: GPipe, or a circular schedule.

S stages, R repeats (train.pipeline_repeats), M micro-batches per pass. The n_layers layers are
cut into S R blocks of n_layers / (S R) consecutive layers; stage s holds blocks s, S + s,
2S + s, ... (with R = 1, GPipe: stage s holds layers [s L/S, (s + 1) L/S)). A micro-batch passes
stage 0, 1, ..., S - 1 and then, while repeats remain, stage 0 again: R laps of the ring.

Tick t: stage s works on item u = t - s (repeat u // M of micro-batch u % M) when 0 <= u < R M,
so a pass takes R M + S - 1 ticks and every stage idles S - 1 of them: a bubble of
(S - 1) / (R M + S - 1). A micro-batch's next lap starts at stage 0 M ticks after its last one;
it left the last stage M - S + 1 ticks before, so stage 0 keeps it in a delay line of M - S
slots (none when M = S), which is why M must be a multiple (at least one) of S.

Only what must cross the stage axis does: at every tick each stage hands its output to the
next (stage S - 1 to stage 0 between laps), one micro-batch activation forward and, in the
backward pass, its gradient back; XLA lowers each hand-over to a collective permute. Stage 0
embeds its micro-batches from the token ids (which every stage holds: the batch is split over
data and fsdp only, a few bytes a token), and the last stage keeps its final outputs and
computes the loss on them; the other stages compute the same functions on rows they ignore (one
SPMD program), so neither the embedding nor the loss moves an activation. Their parameters (the
embedding, the final norm, the head) are used on every stage: their gradients are summed over
the stages once a step, the one reduction across the stage axis.

Layer order in memory: with R > 1 a stage's blocks are not adjacent in the model's order, so the
train state keeps the stacked layers stage-major (`to_stage_order`): stage s's R blocks are its
contiguous shard. Checkpoints keep the model's order (train_step.py converts at the edges), so a
run resumes across R and from a run without stages. The loop is a `lax.scan` over ticks and
each stage scans its layers, or runs them unrolled when its block has at most
train.pipeline_unroll_layers of them (a loop nested in the tick loop costs every tick): compile
time does not grow with n_layers, M or R beyond that constant.

What a model reports from its blocks (model/aux.py) leaves every tick as an output of the stage
that computed it, zero on bubble ticks, and is summed over ticks and stages once after the loop:
each micro-batch's sum over layers, meaned over the M micro-batches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .config import PIPELINE_UNROLL_LAYERS, Config, pipeline_microbatches
from .model import aux
from .sharding import RULES, constrain, within_stage

StageFn = Callable[[Any, jax.Array], jax.Array]  # (one block's stacked layers, x) -> x
FirstFn = Callable[[Any, jax.Array], jax.Array]  # (params, inputs of N rows) -> x of N rows
LastFn = Callable[[Any, jax.Array, jax.Array], jax.Array]  # (params, x, targets) -> mean loss


@dataclasses.dataclass(frozen=True)
class Schedule:
    stages: int  # S
    microbatches: int  # M, a multiple of S
    repeats: int = 1  # R: laps of the ring (1 = GPipe)
    unroll_layers: int = PIPELINE_UNROLL_LAYERS  # blocks of at most this many layers unroll

    @classmethod
    def of(cls, config: Config, stages: int) -> Schedule:
        """The config's schedule over `stages` stages (train.pipeline_*)."""
        t = config.train
        return cls(stages, pipeline_microbatches(config, stages), t.pipeline_repeats,
                   t.pipeline_unroll_layers)

    def block_layers(self, n_layers: int) -> int:
        """Layers in each of a stage's R blocks: n_layers / (S R)."""
        return n_layers // (self.stages * self.repeats)

    def unrolled(self, n_layers: int) -> bool:
        """Whether a stage runs its block of layers unrolled, not as a loop."""
        return self.block_layers(n_layers) <= self.unroll_layers

    @property
    def ticks(self) -> int:
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        """The fraction of every stage's time spent idle: (S - 1) / (R M + S - 1)."""
        return (self.stages - 1) / self.ticks

    @property
    def delay(self) -> int:
        """Slots of stage 0's delay line between laps: M - S (R > 1)."""
        return self.microbatches - self.stages if self.repeats > 1 else 0

    @property
    def permutes_per_pass(self) -> int:
        """Hand-overs of one micro-batch activation per stage and pass (forward; as many back)."""
        return self.ticks - 1


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    return Schedule(stages, microbatches, repeats).bubble


def stage_axis() -> str:
    axis = RULES["stages"]
    assert isinstance(axis, str)
    return axis


def _transpose_blocks(leaf: jax.Array, outer: int, inner: int) -> jax.Array:
    """[n, ...] read as [outer, inner, n / (outer inner), ...] blocks -> [inner, outer, ...]."""
    n, rest = leaf.shape[0], leaf.shape[1:]
    blocks = leaf.reshape(outer, inner, n // (outer * inner), *rest)
    return jnp.swapaxes(blocks, 0, 1).reshape(n, *rest)


def to_stage_order(leaf: jax.Array, stages: int, repeats: int) -> jax.Array:
    """[n_layers, ...] in the model's order (repeat-major) -> stage-major: stage s's R blocks
    contiguous."""
    return leaf if repeats == 1 else _transpose_blocks(leaf, repeats, stages)


def to_model_order(leaf: jax.Array, stages: int, repeats: int) -> jax.Array:
    """The inverse of `to_stage_order`."""
    return leaf if repeats == 1 else _transpose_blocks(leaf, stages, repeats)


def _from_previous_stage(x_Sx: jax.Array, wrap: bool) -> jax.Array:
    """Stage s gets stage s - 1's block; stage 0 gets the last stage's (wrap) or zeros."""
    if wrap:
        return jnp.roll(x_Sx, 1, axis=0)
    return jnp.pad(x_Sx, [(1, 0)] + [(0, 0)] * (x_Sx.ndim - 1))[:-1]


def _per_stage(tree: Any, stages: int) -> Any:
    """Every leaf broadcast to [S, ...], one copy per stage: parameters (their gradient is then
    summed over the stages once, after the loop, not at every tick) and the batch's rows (every
    stage holds its data/fsdp shard's; no pipeline split). None stays None."""
    return jax.tree.map(lambda leaf: jnp.broadcast_to(leaf, (stages, *leaf.shape)), tree)


def _micro_batches(x_BxF: jax.Array, micro: int) -> jax.Array:
    """[B, ...] -> [M, B/M, ...], micro-batch m = rows m, m + M, ...: local to every shard."""
    batch, *rest = x_BxF.shape
    return jnp.swapaxes(x_BxF.reshape(batch // micro, micro, *rest), 0, 1)


def loss(stage_fn: StageFn, stacked_layers: Any, first: tuple[FirstFn, Any],
         last: tuple[LastFn, Any], inputs_BxF: jax.Array, targets_BxF: jax.Array | None,
         schedule: Schedule) -> jax.Array:
    """The mean loss of a batch through first, every layer in order, and last, stage by stage.

    `stacked_layers` leaves are [n_layers, ...] in stage order (`to_stage_order`), sharded
    over `pipeline`; `first` = (fn, params) maps inputs rows to activations (the embedding),
    `last` = (fn, params) maps final activations and targets to their mean loss. The result
    equals last(first(inputs) through all layers, targets) on one device.
    """
    stages, micro, repeats = schedule.stages, schedule.microbatches, schedule.repeats
    first_fn, first_params = first
    last_fn, last_params = last
    per_stage = jax.tree.map(
        lambda leaf: leaf.reshape(stages, repeats, leaf.shape[0] // (stages * repeats),
                                  *leaf.shape[1:]), stacked_layers)
    stage_ids = jnp.arange(stages)

    def embed(params: Any, inputs_BxF: jax.Array, stage: jax.Array
              ) -> tuple[jax.Array, aux.Aux]:
        with within_stage(), aux.collect() as reported:
            x = _micro_batches(first_fn(params, inputs_BxF), micro)
        return x, _where(stage == 0, reported.values)

    embedded_SxMxRxLxD, embed_aux = jax.vmap(embed, spmd_axis_name=stage_axis())(
        _per_stage(first_params, stages), _per_stage(inputs_BxF, stages), stage_ids)
    activation = embedded_SxMxRxLxD.shape[3:]
    features = ("batch",) + ("length",) * (len(activation) > 1) + (None,) * (len(activation) - 1)
    rows = embedded_SxMxRxLxD.shape[2]

    def one_tick(layers_RxN: Any, embedded_MxRxLxD: jax.Array, state_RxLxD: jax.Array,
                 delay_QxRxLxD: jax.Array, out_MxRxLxD: jax.Array, stage: jax.Array,
                 t: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, aux.Aux]:
        item = t - stage
        lap = jnp.clip(item // micro, 0, repeats - 1)
        m = jnp.mod(item, micro)
        x_RxLxD = jax.lax.dynamic_index_in_dim(embedded_MxRxLxD, m, keepdims=False)
        if repeats > 1:
            if schedule.delay:
                slot = jnp.mod(t, schedule.delay)
                looped_RxLxD = jax.lax.dynamic_index_in_dim(delay_QxRxLxD, slot, keepdims=False)
                delay_QxRxLxD = jax.lax.dynamic_update_index_in_dim(delay_QxRxLxD, state_RxLxD,
                                                                    slot, axis=0)
            else:
                looped_RxLxD = state_RxLxD
            x_RxLxD = jnp.where(lap == 0, x_RxLxD, looped_RxLxD)
        x_RxLxD = jnp.where(stage == 0, x_RxLxD, state_RxLxD)
        if repeats == 1:  # GPipe: a stage's one block, without a copy of it at every tick
            block = jax.tree.map(lambda leaf: leaf[0], layers_RxN)
        else:
            block = jax.tree.map(
                lambda leaf: jax.lax.dynamic_index_in_dim(leaf, lap, keepdims=False), layers_RxN)
        with within_stage(), aux.collect() as reported:
            y_RxLxD = stage_fn(block, x_RxLxD)
        working = (item >= 0) & (item < repeats * micro)  # not a bubble tick
        done = (stage == stages - 1) & (item >= (repeats - 1) * micro) & (item < repeats * micro)
        kept_RxLxD = jax.lax.dynamic_index_in_dim(out_MxRxLxD, m, keepdims=False)
        out_MxRxLxD = jax.lax.dynamic_update_index_in_dim(
            out_MxRxLxD, jnp.where(done, y_RxLxD, kept_RxLxD), m, axis=0)
        return y_RxLxD, delay_QxRxLxD, out_MxRxLxD, _where(working, reported.values)

    all_stages = jax.vmap(one_tick, in_axes=(0, 0, 0, 0, 0, 0, None),
                          spmd_axis_name=stage_axis())

    def tick(carry: tuple[jax.Array, jax.Array, jax.Array], t: jax.Array):
        state_SxRxLxD, delay_SxQxRxLxD, out_SxMxRxLxD = carry
        y_SxRxLxD, delay_SxQxRxLxD, out_SxMxRxLxD, reported_S = all_stages(
            per_stage, embedded_SxMxRxLxD, state_SxRxLxD, delay_SxQxRxLxD, out_SxMxRxLxD,
            stage_ids, t)
        y_SxRxLxD = constrain(y_SxRxLxD, ("stages", *features))
        # Stage s + 1 gets what stage s made; between laps, stage 0 gets the last stage's.
        state_SxRxLxD = constrain(_from_previous_stage(y_SxRxLxD, wrap=repeats > 1),
                                  ("stages", *features))
        return (state_SxRxLxD, delay_SxQxRxLxD, out_SxMxRxLxD), reported_S

    dtype = embedded_SxMxRxLxD.dtype
    state = constrain(jnp.zeros((stages, rows, *activation), dtype), ("stages", *features))
    delay = constrain(jnp.zeros((stages, schedule.delay, rows, *activation), dtype),
                      ("stages", None, *features))
    out = constrain(jnp.zeros((stages, micro, rows, *activation), dtype),
                    ("stages", None, *features))
    (_, _, out_SxMxRxLxD), blocks_aux_TxS = jax.lax.scan(tick, (state, delay, out),
                                                         jnp.arange(schedule.ticks))

    def stage_loss(params: Any, out_MxRxLxD: jax.Array, targets_BxF: jax.Array,
                   stage: jax.Array) -> tuple[jax.Array, aux.Aux]:
        with within_stage(), aux.collect() as reported:
            # Back to the batch's row order: the inverse of _micro_batches, local as well.
            out_BxLxD = jnp.swapaxes(out_MxRxLxD, 0, 1).reshape(micro * rows, *activation)
            loss = last_fn(params, out_BxLxD, targets_BxF)
        return loss, _where(stage == stages - 1, reported.values)

    losses_S, last_aux = jax.vmap(stage_loss, spmd_axis_name=stage_axis())(
        _per_stage(last_params, stages), out_SxMxRxLxD, _per_stage(targets_BxF, stages),
        stage_ids)
    # What the blocks reported: each micro-batch's sum over the layers, meaned over the M
    # micro-batches (aux.py); the embedding and the head saw the whole batch at once.
    aux.report_all({name: values.sum() / micro for name, values in blocks_aux_TxS.items()})
    aux.report_all({name: values.sum() for name, values in embed_aux.items()})
    aux.report_all({name: values.sum() for name, values in last_aux.items()})
    return jnp.sum(jnp.where(stage_ids == stages - 1, losses_S, 0.0))


def _where(keep: jax.Array, values: aux.Aux) -> aux.Aux:
    """What a stage reported where `keep`, zeros where it computed rows it ignores."""
    return {name: jnp.where(keep, value, 0.0) for name, value in values.items()}
