"""GPipe over the mesh's `pipeline` axis: S stages of n_layers / S consecutive scanned layers.

The stacked layer parameters [n_layers, ...] are sharded over `pipeline` (sharding.py maps
`layers` to it), so stage s holds layers [s L/S, (s + 1) L/S) and nothing else: no parameter
ever crosses the stage axis. A pass splits its batch into M micro-batches and runs M + S - 1
ticks; at every tick each stage runs its layers on the micro-batch it holds (one function
vmapped over the stage dimension, which is sharded over `pipeline`), then hands the result to
the next stage. Stage 0 starts micro-batch t at tick t, the last stage finishes it at tick
t + S - 1: fill, steady state and drain, a bubble of (S - 1) / (M + S - 1) of every stage's time.

Everything that moves between stages is a shift by one along the stage dimension, which XLA
lowers to a collective permute: the activations going forward (and their gradients coming back),
and a conveyor of micro-batch slots (the layout of MaxText's pipeline) that brings stage 0 its
next input and carries every finished output back to the stage whose rows it holds. Outside the
stages the batch is split over `pipeline` too, so the embedding and the loss are not repeated
on every stage.

Micro-batch layout: the pass's rows [B, ...] are [S, B/S] over `pipeline`, and stage s's B/S
rows are K = M/S slots of B/M rows (row r in slot r % K: a reshape local to every data and fsdp
shard). Slot k of stage s is micro-batch s K + k. The loop is a `lax.scan` over ticks and each
stage scans its layers, so compile time does not grow with n_layers or M.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .sharding import RULES, constrain, within_stage

StageFn = Callable[[Any, jax.Array], jax.Array]  # (one stage's stacked layers, x) -> x


@dataclasses.dataclass(frozen=True)
class Schedule:
    stages: int  # S
    microbatches: int  # M, a multiple of S

    @property
    def slots(self) -> int:
        """K = M / S: micro-batch slots each stage holds."""
        return self.microbatches // self.stages

    @property
    def ticks(self) -> int:
        return self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        """The fraction of every stage's time spent idle: (S - 1) / (M + S - 1)."""
        return (self.stages - 1) / self.ticks


def bubble_fraction(stages: int, microbatches: int) -> float:
    return Schedule(stages, microbatches).bubble


def stage_axis() -> str:
    axis = RULES["stages"]
    assert isinstance(axis, str)
    return axis


def _by_stage(leaf: jax.Array, stages: int) -> jax.Array:
    """[n_layers, ...] -> [S, n_layers / S, ...]: a reshape local to each stage's shard."""
    return leaf.reshape(stages, leaf.shape[0] // stages, *leaf.shape[1:])


def _from_previous_stage(x_Sx: jax.Array) -> jax.Array:
    """Stage s gets stage s - 1's block (stage 0 zeros): S - 1 sends, none wrapping around."""
    return jnp.pad(x_Sx, [(1, 0)] + [(0, 0)] * (x_Sx.ndim - 1))[:-1]


def _from_next_stage(x_Sx: jax.Array) -> jax.Array:
    """Stage s gets stage s + 1's block (the last stage zeros)."""
    return jnp.pad(x_Sx, [(0, 1)] + [(0, 0)] * (x_Sx.ndim - 1))[1:]


def run(stage_fn: StageFn, stacked_layers: Any, x_BxLxD: jax.Array, schedule: Schedule,
        logical: Sequence[str | None] = ("batch", "length", None)) -> jax.Array:
    """x through every layer, stage by stage; the same function as scanning all n_layers.

    `logical` names x's axes (its first is the batch); the result has x's shape and sharding.
    """
    stages, slots, micro = schedule.stages, schedule.slots, schedule.microbatches
    batch, *rest = x_BxLxD.shape
    rows = batch // micro
    features = tuple(logical[1:])
    per_stage = jax.tree.map(lambda leaf: _by_stage(leaf, stages), stacked_layers)

    # io[s, k] holds micro-batch s K + k now and its output at the end.
    io_SxKxRxLxD = jnp.swapaxes(x_BxLxD.reshape(stages, rows, slots, *rest), 1, 2)
    io_SxKxRxLxD = constrain(io_SxKxRxLxD, ("stages", None, "micro", *features))
    state_SxRxLxD = constrain(jnp.zeros((stages, rows, *rest), x_BxLxD.dtype),
                              ("stages", "micro", *features))
    stage_ids = jnp.arange(stages).reshape(stages, *[1] * (1 + len(rest)))

    def one_stage(layers: Any, x_RxLxD: jax.Array) -> jax.Array:
        with within_stage():
            return stage_fn(layers, x_RxLxD)

    all_stages = jax.vmap(one_stage, spmd_axis_name=stage_axis())

    def tick(carry: tuple[jax.Array, jax.Array], t: jax.Array):
        state_SxRxLxD, io_SxKxRxLxD = carry
        slot = t % slots
        column_SxRxLxD = jax.lax.dynamic_index_in_dim(io_SxKxRxLxD, slot, axis=1,
                                                      keepdims=False)
        inputs_SxRxLxD = jnp.where(stage_ids == 0, column_SxRxLxD, state_SxRxLxD)
        outputs_SxRxLxD = all_stages(per_stage, inputs_SxRxLxD)
        outputs_SxRxLxD = constrain(outputs_SxRxLxD, ("stages", "micro", *features))
        # The conveyor moves one stage towards 0; the last stage drops its output on it.
        column_SxRxLxD = jnp.where(stage_ids == stages - 1, outputs_SxRxLxD,
                                   _from_next_stage(column_SxRxLxD))
        io_SxKxRxLxD = jax.lax.dynamic_update_index_in_dim(io_SxKxRxLxD, column_SxRxLxD, slot,
                                                           axis=1)
        # Stage s + 1 gets what stage s made (stage 0's copy is replaced by its next input).
        state_SxRxLxD = _from_previous_stage(outputs_SxRxLxD)
        return (state_SxRxLxD, io_SxKxRxLxD), None

    (_, io_SxKxRxLxD), _ = jax.lax.scan(tick, (state_SxRxLxD, io_SxKxRxLxD),
                                        jnp.arange(schedule.ticks))
    # Micro-batch s K + k left the last stage at tick s K + k + S - 1 into slot (k + S - 1) % K
    # and rode the conveyor back to stage s: undo that rotation of the slots (local).
    io_SxKxRxLxD = jnp.roll(io_SxKxRxLxD, -(stages - 1), axis=1)
    y_BxLxD = jnp.swapaxes(io_SxKxRxLxD, 1, 2).reshape(batch, *rest)
    return constrain(y_BxLxD, tuple(logical))
