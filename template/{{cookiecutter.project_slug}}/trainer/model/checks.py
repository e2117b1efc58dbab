"""The checks that ask the model variant, before anything is compiled or provisioned.

config.resolve checks what the config alone decides (the mesh, the batch); `resolve` here adds
what only the variant can answer, from its abstract build (registry.describe): whether its layer
stack splits into the pipeline's stages, and whether every parameter dimension divides over the
mesh axes its logical axis maps to. The trainer, `--check`, `sample`, the planner and the
preview (infra/packaging/experiment.py) all call this one, so they agree, and each refusal is
one ConfigError line naming the value and what would divide.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ..config import (
    Config,
    ConfigError,
    ResolvedMesh,
    Topology,
    axis_text,
)
from ..config import (
    resolve as resolve_mesh_and_batch,
)
from ..sharding import RULES, logical_to_spec
from .registry import ModelLayout, describe


def resolve(config: Config, topology: Topology) -> ResolvedMesh:
    """config.resolve, then the variant's depth over the stages and its parameters over the
    mesh (every refusal a ConfigError)."""
    resolved = resolve_mesh_and_batch(config, topology)
    layout = describe(config.model)
    check_depth(config, resolved.pipeline, layout)
    check_parameter_shards(config.model, resolved, layout)
    return resolved


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def depth_text(config: Config, layout: ModelLayout) -> str:
    """The stack the stages split, as the user set it: model.n_layers, and the variant's units
    where it repeats more than one layer as a unit."""
    n = config.model.n_layers
    if layout.layers_per_unit == 1 and layout.units == n:
        return f"model.n_layers = {n}"
    units = f"{layout.units} unit{'s' if layout.units != 1 else ''}"
    return (f"model.n_layers = {n} ({units} of {layout.layers_per_unit} layers: model.kind = "
            f"{layout.kind!r} repeats its layers in units of {layout.layers_per_unit})")


def check_depth(config: Config, stages: int, layout: ModelLayout) -> None:
    """The variant's stack of units splits into `stages` stages of R blocks each."""
    if stages == 1:
        return
    units, given = layout.units, f"mesh.ici_pipeline * mesh.dcn_pipeline = {stages}"
    what = depth_text(config, layout)
    if units % stages:
        raise ConfigError(
            f"{what} does not split into {stages} pipeline stages ({given}); use a number of "
            f"stages that divides {units}: {', '.join(map(str, divisors(units)))}")
    repeats = config.train.pipeline_repeats
    if units % (stages * repeats):
        fits = [r for r in range(1, units // stages + 1) if units % (stages * r) == 0]
        raise ConfigError(
            f"{what} does not split into {stages} pipeline stages x train.pipeline_repeats = "
            f"{repeats} blocks ({given}): each stage holds R blocks of {units} / (S R) units; "
            f"use train.pipeline_repeats in {fits}")


def keys_of_size(m: Any, path: str, dim: int, size: int) -> list[str]:
    """The model.* keys that set dimension `dim` of parameter `path`: those whose value (or
    derived value) is `size` and that change it when doubled (the error path only)."""
    derived = {"n_kv_heads": m.kv_heads, "head_dim": m.head_size}
    keys = []
    for f in dataclasses.fields(m):
        if str(f.type) != "int" or derived.get(f.name, getattr(m, f.name)) != size:
            continue
        try:
            doubled = describe(dataclasses.replace(m, **{f.name: 2 * size})).parameters
        except Exception:  # noqa: BLE001 - a doubling the model cannot build says nothing
            continue
        if any(p == path and len(shape) > dim and shape[dim] != size
               for p, shape, _ in doubled):
            keys.append(f"model.{f.name}")
    return keys


def check_parameter_shards(m: Any, resolved: ResolvedMesh, layout: ModelLayout) -> None:
    """Every parameter dimension divides over the mesh axes its logical axis maps to (the rules
    of sharding.py over what the variant declares)."""
    for path, shape, logical in layout.parameters:
        try:
            spec = logical_to_spec(logical, RULES)
        except ValueError as exc:
            raise ConfigError(f"parameter {path}: {exc}") from None
        for dim, (size, name, axes) in enumerate(zip(shape, logical, spec, strict=True)):
            if axes is None or name == "layers":  # stages: check_depth says it better
                continue
            axes = (axes,) if isinstance(axes, str) else tuple(axes)
            shards = math.prod(resolved.size(axis) for axis in axes)
            if size % shards:
                keys = keys_of_size(m, path, dim, size)
                named = (f"{keys[0]}" + "".join(f" (or {k})" for k in keys[1:]) if keys
                         else f"dimension {dim} of {path} (no model.* key sets it)")
                over = " * ".join(axis_text(resolved, axis) for axis in axes)
                raise ConfigError(
                    f"{named} = {size} is not divisible by the {'/'.join(axes)} parallelism "
                    f"{shards} ({over}): parameter {path} splits its dimension {dim} (logical "
                    f"axis {name!r}) over it; change the key or the mesh")
