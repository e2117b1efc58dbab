"""Logical axis names -> mesh axes, in one place.

Parameters and activations are annotated with logical names (`embed`, `mlp`, ...); this module
decides which mesh axes they are split over. Change a rule here to change the parallelism
strategy of the whole model; a variant's new logical axis (say `experts`) gets a rule here, onto
a built-in mesh axis or one the fork adds (config.MESH_AXES).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None

RULES: dict[str, MeshAxes] = {
    # activations: the batch is split over data and fsdp; every pipeline stage holds the rows
    # of its data/fsdp shard (pipeline.py: the token ids are all that is repeated)
    "batch": ("data", "fsdp"),
    "embed": "fsdp",  # parameters: FSDP shards the model dimension of every weight
    "mlp": "tensor",
    "heads": "tensor",
    "vocab": "tensor",
    "kv": None,
    "length": None,
    # the stacked-layer axis of scanned blocks (stage-major order: pipeline.to_stage_order)
    "layers": "pipeline",
    "stages": "pipeline",  # the stage axis of the pipeline's buffers (pipeline.py)
}
_active_rules: list[dict[str, MeshAxes]] = [RULES]


def stage_rules() -> dict[str, MeshAxes]:
    """RULES inside a pipeline stage: the pipeline axis is taken by the stage dimension
    (pipeline.py vmaps the stage function over it), so a stage's slice of the stacked layers is
    not split again. Made from RULES when asked, so a rule a fork adds holds in stages too."""
    return {**RULES, "layers": None}


@contextlib.contextmanager
def within_stage() -> Iterator[None]:
    """Trace the body of a pipeline stage: logical names map with stage_rules()."""
    _active_rules.append(stage_rules())
    try:
        yield
    finally:
        _active_rules.pop()


@contextlib.contextmanager
def within_chunk() -> Iterator[None]:
    """Trace the loss of one chunk of rows that a single batch shard holds whole (the canonical
    reduction, train_step.py): the batch dimension is not split again inside it."""
    _active_rules.append({**_active_rules[-1], "batch": None})
    try:
        yield
    finally:
        _active_rules.pop()


def logical_to_spec(logical: Sequence[str | None], rules: dict[str, MeshAxes] | None = None
                    ) -> PartitionSpec:
    rules = _active_rules[-1] if rules is None else rules
    used: set[str] = set()
    axes: list[MeshAxes] = []
    for name in logical:
        if name is not None and name not in rules:
            raise ValueError(f"logical axis {name!r} (in {tuple(logical)}) has no rule in "
                             f"trainer/sharding.py RULES; known: {', '.join(sorted(rules))}. "
                             "Add a rule for it (a mesh axis, a tuple of them, or None)")
        mesh_axes = None if name is None else rules[name]
        flat = (mesh_axes,) if isinstance(mesh_axes, str) else (mesh_axes or ())
        if used & set(flat):
            raise ValueError(f"logical axes {tuple(logical)} map mesh axis {flat} twice")
        used |= set(flat)
        axes.append(mesh_axes)
    return PartitionSpec(*axes)


def logical_to_sharding(logical: Sequence[str | None], mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(logical))


def tree_shardings(logical_specs, mesh: Mesh):
    """Map a tree of logical PartitionSpecs (from `nnx.get_partition_spec`) to NamedShardings."""
    return jax.tree.map(
        lambda spec: logical_to_sharding(tuple(spec), mesh),
        logical_specs,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def constrain(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
    """Sharding constraint on an activation; a no-op outside a mesh context (unsharded runs)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(logical))
