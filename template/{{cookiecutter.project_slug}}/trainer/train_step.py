"""The train state, its shardings, a sharded init, the one jitted train step and the eval step.

With train.grad_accum_steps = K the step splits the global batch into K micro-batches (row r goes
to micro-batch r % K, so every batch shard holds an equal part of each), runs forward and backward
on each in a scan, and applies the mean gradient once: the same update as K = 1, with 1/K of the
activation memory (for a loss that is a mean over rows; model/aux.py says what a batch-statistic
loss gets instead).

With elastic.canonical_reduction the step instead cuts the batch into chunks of c rows that one
batch shard holds whole (chunk q is rows q*c .. q*c + c - 1 whatever the mesh), keeps each chunk's
gradient apart and sums them in one fixed pairwise tree over q. The sum is then the same bits on
any number of batch shards that keeps c (an elastic job at N or N-1 slices, with grad_accum_steps
scaled to match): XLA's all-reduce would add the partial gradients in an order of its own mesh.
It costs memory (each batch shard holds its chunks' whole gradients until the tree sums them)
and the tree's transfers.

The step also reports `finite` (loss and gradient norm are finite); the train loop stops before
saving anything computed from a non-finite step.

Metrics: the step's own (loss, grad_norm, learning_rate, finite) and every auxiliary value the
model reported (model/aux.py), all replicated scalars, logged by name with no list to keep.

The train state is a plain pytree of jax.Arrays:
    {"params": nested dict of arrays, "opt_state": optax state, "step": int32 scalar}
so Orbax can save it and restore it into any mesh (`abstract_state` carries the target
shardings). The NNX graph definition is static and lives outside the state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from . import pipeline
from .config import Config
from .model.loss import next_token_loss
from .model.registry import build_model
from .optim import learning_rate_schedule, make_optimizer
from .pipeline import Schedule, stage_axis
from .sharding import constrain, logical_to_sharding, tree_shardings, within_chunk

TrainState = dict[str, Any]
Metrics = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class TrainProgram:
    """Everything compiled for one (config, mesh): init and step, plus the shardings they use."""

    mesh: Mesh
    graphdef: nnx.GraphDef
    state_shardings: Any  # same tree as TrainState, NamedSharding leaves
    batch_sharding: NamedSharding
    batch_shape: tuple[int, int]  # (global_batch_size, seq_len + 1)
    abstract_state: Any  # TrainState of jax.ShapeDtypeStruct with .sharding (Orbax restore)
    init: Callable[[], TrainState]
    step: Callable[[TrainState, jax.Array], tuple[TrainState, Metrics]]
    eval_loss: Callable[[Any, jax.Array], jax.Array]  # (params, batch) -> mean loss
    # The train state lives in the layout the step wants (a circular pipeline keeps its stacked
    # layers in stage order); checkpoints, weights and digests see the model's layer order.
    # Both are identities unless train.pipeline_repeats > 1.
    to_saved: Callable[[TrainState], TrainState]
    from_saved: Callable[[TrainState], TrainState]

    def compile_step(self) -> Any:
        """Ahead-of-time compile the step (so compile time is measured on its own)."""
        batch = jax.ShapeDtypeStruct(self.batch_shape, jnp.int32, sharding=self.batch_sharding)
        with jax.set_mesh(self.mesh):
            return self.step.lower(self.abstract_state, batch).compile()


def pipeline_schedule(config: Config, mesh: Mesh) -> Schedule | None:
    """The pipeline schedule of this mesh's pipeline axis; None without stages."""
    stages = dict(mesh.shape).get(stage_axis(), 1)
    if stages == 1:
        return None
    return Schedule.of(config, stages)


def _is_layer_stacked(spec: PartitionSpec) -> bool:
    return len(spec) > 0 and spec[0] == "layers"


def _layer_order_converters(schedule: Schedule | None, logical_specs: Any, tx: Any,
                            opt_shapes: Any) -> tuple[Callable, Callable]:
    """(to_saved, from_saved) for a train state: the stacked layers of params and optimizer
    state between the model's order (checkpoints, digests) and stage order (pipeline.py).
    Identities without a circular schedule."""
    if schedule is None or schedule.repeats == 1:
        return (lambda state: state), (lambda state: state)
    stacked = jax.tree.map(_is_layer_stacked, logical_specs,
                           is_leaf=lambda x: isinstance(x, PartitionSpec))
    opt_stacked = optax.tree_map_params(tx, lambda _, flag: flag, opt_shapes, stacked,
                                        transform_non_params=lambda _: False)
    flags = {"params": stacked, "opt_state": opt_stacked, "step": False}
    stages, repeats = schedule.stages, schedule.repeats

    def convert(order: Callable) -> Callable:
        def apply(state: TrainState) -> TrainState:
            parts = {k: state[k] for k in flags if k in state}
            return {**state, **jax.tree.map(
                lambda leaf, flag: order(leaf, stages, repeats) if flag else leaf,
                parts, {k: flags[k] for k in parts})}
        return apply

    return convert(pipeline.to_model_order), convert(pipeline.to_stage_order)


def pairwise_sum(stacked: jax.Array) -> jax.Array:
    """The sum over axis 0 in one fixed tree: (0+1)+(2+3)+..., an odd last one carried up.
    Every addition has the same operands whatever devices the rows sit on."""
    while stacked.shape[0] > 1:
        even = stacked.shape[0] // 2 * 2
        paired = stacked[0:even:2] + stacked[1:even:2]
        stacked = paired if even == stacked.shape[0] else jnp.concatenate(
            [paired, stacked[even:]], axis=0)
    return stacked[0]


def _model_factory(config: Config, seed: int) -> Callable[[], nnx.Module]:
    return lambda: build_model(config.model, rngs=nnx.Rngs(params=seed))


def build_program(config: Config, mesh: Mesh, seed: int | None = None) -> TrainProgram:
    """Derive shardings from the logical annotations and jit init and step for this mesh."""
    seed = config.train.seed if seed is None else seed
    tx = make_optimizer(config)
    schedule = learning_rate_schedule(config)
    replicated = NamedSharding(mesh, PartitionSpec())

    abstract_model = nnx.eval_shape(_model_factory(config, seed))
    graphdef, abstract_vars = nnx.split(abstract_model)
    logical_specs = nnx.to_pure_dict(nnx.get_partition_spec(abstract_vars))
    param_shardings = tree_shardings(logical_specs, mesh)

    def init_state() -> TrainState:
        params = nnx.to_pure_dict(nnx.state(_model_factory(config, seed)()))
        return {"params": params, "opt_state": tx.init(params),
                "step": jnp.zeros((), jnp.int32)}

    shapes = jax.eval_shape(init_state)
    opt_shardings = optax.tree_map_params(
        tx,
        lambda _, sharding: sharding,
        shapes["opt_state"],
        param_shardings,
        transform_non_params=lambda _: replicated,
    )
    state_shardings = {"params": param_shardings, "opt_state": opt_shardings,
                       "step": replicated}
    abstract_state = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, state_shardings
    )

    chunk = config.model.loss_chunk_size
    accum = config.train.grad_accum_steps
    stages = pipeline_schedule(config, mesh)
    to_saved, from_saved = _layer_order_converters(stages, logical_specs, tx,
                                                   shapes["opt_state"])
    if stages is not None and stages.repeats > 1:
        to_saved = jax.jit(to_saved, out_shardings=state_shardings)
        from_saved = jax.jit(from_saved, out_shardings=state_shardings)

    def batch_loss(params, batch_BxLp1: jax.Array) -> tuple[jax.Array, Metrics]:
        model = nnx.merge(graphdef, params)
        return next_token_loss(model, batch_BxLp1[:, :-1], batch_BxLp1[:, 1:], chunk, stages)

    def held_out_loss(params, batch_BxLp1: jax.Array) -> jax.Array:
        """The cross-entropy alone: what evaluations of any variant compare."""
        loss, reported = batch_loss(params, batch_BxLp1)
        return reported.get("cross_entropy", loss)

    def loss_and_grads(params, batch_BxLp1: jax.Array):
        """((mean loss, mean auxiliary values), mean gradient) over the micro-batches."""
        if accum == 1:
            return jax.value_and_grad(batch_loss, has_aux=True)(params, batch_BxLp1)
        rows, width = batch_BxLp1.shape
        # Micro-batch k = rows k, k + K, ...: a reshape local to every batch shard.
        micro_KxMxLp1 = jnp.swapaxes(batch_BxLp1.reshape(rows // accum, accum, width), 0, 1)
        micro_KxMxLp1 = constrain(micro_KxMxLp1, (None, "batch", None))

        def add_micro_batch(carry, micro_MxLp1):
            loss_sum, grad_sum = carry
            (loss, reported), grads = jax.value_and_grad(batch_loss, has_aux=True)(
                params, micro_MxLp1)
            grad_sum = jax.tree.map(jnp.add, grad_sum, grads)
            return (loss_sum + loss, jax.lax.with_sharding_constraint(grad_sum,
                                                                      param_shardings)), reported

        zeros = jax.lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, params),
                                                 param_shardings)
        (loss_sum, grad_sum), reported_K = jax.lax.scan(add_micro_batch,
                                                        (jnp.zeros((), jnp.float32), zeros),
                                                        micro_KxMxLp1)
        reported = {name: values.mean() for name, values in reported_K.items()}
        return (loss_sum / accum, reported), jax.tree.map(lambda g: g / accum, grad_sum)

    shards = dict(mesh.shape).get("data", 1) * dict(mesh.shape).get("fsdp", 1)
    batch_axes = tuple(axis for axis in ("data", "fsdp") if axis in mesh.axis_names)

    def canonical_loss_and_grads(params, batch_BxLp1: jax.Array):
        """((mean loss, mean auxiliary values), mean gradient), summed chunk by chunk in the
        fixed order of pairwise_sum; chunk q = d * K + k is micro-batch k of batch shard d."""
        rows, width = batch_BxLp1.shape
        per_chunk = rows // (shards * accum)
        chunks_KxDxCxLp1 = jnp.swapaxes(
            batch_BxLp1.reshape(shards, accum, per_chunk, width), 0, 1)
        chunks_KxDxCxLp1 = constrain(chunks_KxDxCxLp1, (None, "batch", None, None))

        def one_chunk(p, chunk_CxLp1):
            with within_chunk():
                return jax.value_and_grad(batch_loss, has_aux=True)(p, chunk_CxLp1)

        def by_shard(a: jax.Array) -> jax.Array:
            spec = PartitionSpec(batch_axes, *([None] * (a.ndim - 1)))
            return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, spec))

        def micro_batch(_, chunks_DxCxLp1):
            (loss_D, reported_D), grads_D = jax.vmap(
                one_chunk, in_axes=(None, 0), spmd_axis_name=batch_axes)(params, chunks_DxCxLp1)
            return None, (loss_D, reported_D, jax.tree.map(by_shard, grads_D))

        _, (loss_KxD, reported_KxD, grads_KxD) = jax.lax.scan(micro_batch, None,
                                                               chunks_KxDxCxLp1)

        def in_chunk_order(a: jax.Array) -> jax.Array:  # [K, D, ...] -> [D * K, ...]
            return jnp.swapaxes(a, 0, 1).reshape((-1, *a.shape[2:]))

        count = shards * accum
        grads = jax.tree.map(lambda g: pairwise_sum(in_chunk_order(g)) / count, grads_KxD)
        grads = jax.lax.with_sharding_constraint(grads, param_shardings)
        loss = pairwise_sum(in_chunk_order(loss_KxD)) / count
        reported = {name: values.mean() for name, values in reported_KxD.items()}
        return (loss, reported), grads

    gradients = (canonical_loss_and_grads if config.elastic.canonical_reduction
                 else loss_and_grads)

    def train_step(state: TrainState, batch_BxLp1: jax.Array) -> tuple[TrainState, Metrics]:
        (loss, reported), grads = gradients(state["params"], batch_BxLp1)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        grad_norm = optax.tree.norm(grads)
        metrics = {
            **reported,
            "loss": loss,
            "grad_norm": grad_norm,
            "learning_rate": schedule(state["step"]),
            "finite": jnp.isfinite(loss) & jnp.isfinite(grad_norm),
        }
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    batch_sharding = logical_to_sharding(("batch", None), mesh)
    metric_shardings = replicated  # a prefix: every metric, whatever the model reports
    return TrainProgram(
        mesh=mesh,
        graphdef=graphdef,
        state_shardings=state_shardings,
        batch_sharding=batch_sharding,
        batch_shape=(config.train.global_batch_size, config.model.seq_len + 1),
        abstract_state=abstract_state,
        # Born sharded: each device computes only its own shard of the initial state.
        init=jax.jit(lambda: from_saved(init_state()), out_shardings=state_shardings),
        step=jax.jit(
            train_step,
            in_shardings=(state_shardings, batch_sharding),
            out_shardings=(state_shardings, metric_shardings),
            donate_argnums=(0,),
        ),
        eval_loss=jax.jit(held_out_loss, in_shardings=(param_shardings, batch_sharding),
                          out_shardings=replicated),
        to_saved=to_saved,
        from_saved=from_saved,
    )
