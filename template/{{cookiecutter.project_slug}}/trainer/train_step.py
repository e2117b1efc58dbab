"""The train state, its shardings, a sharded init, and the one jitted train step.

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

from .config import Config
from .model import TransformerLM
from .optim import learning_rate_schedule, make_optimizer
from .sharding import logical_to_sharding, tree_shardings

TrainState = dict[str, Any]
Metrics = dict[str, jax.Array]


def cross_entropy(logits_BxLxV: jax.Array, targets_BxL: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy, computed in float32."""
    logits = logits_BxLxV.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets_BxL).mean()


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

    def compile_step(self) -> Any:
        """Ahead-of-time compile the step (so compile time is measured on its own)."""
        batch = jax.ShapeDtypeStruct(self.batch_shape, jnp.int32, sharding=self.batch_sharding)
        with jax.set_mesh(self.mesh):
            return self.step.lower(self.abstract_state, batch).compile()


def _model_factory(config: Config, seed: int) -> Callable[[], TransformerLM]:
    return lambda: TransformerLM(config.model, rngs=nnx.Rngs(params=seed))


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

    def train_step(state: TrainState, batch_BxLp1: jax.Array) -> tuple[TrainState, Metrics]:
        inputs_BxL, targets_BxL = batch_BxLp1[:, :-1], batch_BxLp1[:, 1:]

        def loss_fn(params):
            model = nnx.merge(graphdef, params)
            return cross_entropy(model(inputs_BxL), targets_BxL)

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {
            "loss": loss,
            "grad_norm": optax.tree.norm(grads),
            "learning_rate": schedule(state["step"]),
        }
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    batch_sharding = logical_to_sharding(("batch", None), mesh)
    metric_shardings = {"loss": replicated, "grad_norm": replicated, "learning_rate": replicated}
    return TrainProgram(
        mesh=mesh,
        graphdef=graphdef,
        state_shardings=state_shardings,
        batch_sharding=batch_sharding,
        batch_shape=(config.train.global_batch_size, config.model.seq_len + 1),
        abstract_state=abstract_state,
        # Born sharded: each device computes only its own shard of the initial state.
        init=jax.jit(init_state, out_shardings=state_shardings),
        step=jax.jit(
            train_step,
            in_shardings=(state_shardings, batch_sharding),
            out_shardings=(state_shardings, metric_shardings),
            donate_argnums=(0,),
        ),
    )
