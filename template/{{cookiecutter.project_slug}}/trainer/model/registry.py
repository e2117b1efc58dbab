"""Model variants side by side: `model.kind` in a preset picks one by name.

Every module of this package may register a variant; the registry imports them all the first
time a kind is looked up, so a fork adds a variant by adding a module (say `moe.py`):

    from . import aux
    from .registry import register
    from .transformer import Block, TransformerLM

    class MoeMlp(nnx.Module):
        ...  # parameters with logical axes ("experts", "embed", "mlp"); a rule in sharding.py
        def __call__(self, x_BxLxD):
            ...
            aux.report("load_balance", balance, weight=0.01)  # a loss the step adds
            return y_BxLxD

    class MoeBlock(Block):
        mlp_class = MoeMlp

    @register("moe", flops_per_token=moe_flops_per_token)
    class MoeLM(TransformerLM):
        block_class = MoeBlock

and a preset that says `kind = "moe"` in its [model] section (`extends = "tiny"` keeps the rest;
the variant's own keys, declared by `register(..., settings={...})`, go in [model.settings] and
are read with `settings(cfg)`). A variant is built as `Variant(model_config,
rngs=nnx.Rngs(...))` and offers the parts the dense transformer does (transformer.py:
`embed_tokens`/`embed_params`, the units of `blocks` called with their place in the stack,
`head`/`head_params`, `init_cache`, `layers_per_unit`); every path is built from those parts, so
subclassing TransformerLM and replacing one is the short way. What it reports through model/aux.py
is logged and, weighted, trained on.

What the toolkit derives from the variant (`describe`, an abstract build): the parameter count
(exact, unless `param_count` gives a formula), its layer stack (units and layers per unit: what
the pipeline's stages split) and the model.* keys it reads (what --check shows); model/checks.py
asks these. What it cannot: `flops_per_token` (MFU, the planner's token arithmetic; the default
is the dense transformer's, which counts every parameter as used by every token, so a sparse
variant gives its own) and `activation_bytes` (--check's memory estimate of one device's saved
activations; the default is the dense block's, check.activation_bytes_estimate, which a variant
may call and add to).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import math
import pkgutil
from collections.abc import Callable
from typing import Any

from ..config import ConfigError

DEFAULT_KIND = "transformer"


@dataclasses.dataclass(frozen=True)
class ModelKind:
    name: str
    build: Callable[..., Any]  # (model config, *, rngs) -> the nnx module
    param_count: Callable[[Any], int] | None  # None: counted from the abstract parameters
    flops_per_token: Callable[[Any], int] | None  # None: the dense transformer's arithmetic
    activation_bytes: Callable[..., int] | None = None  # None: check.activation_bytes_estimate
    settings: tuple[tuple[str, Any], ...] = ()  # its [model.settings] keys and their defaults


_KINDS: dict[str, ModelKind] = {}
_discovered = False


def register(name: str, *, param_count: Callable[[Any], int] | None = None,
             flops_per_token: Callable[[Any], int] | None = None,
             activation_bytes: Callable[..., int] | None = None,
             settings: dict[str, Any] | None = None) -> Callable[[Any], Any]:
    """Class (or factory) decorator: `model.kind = name` builds it. `activation_bytes(config,
    batch_shards, tensor, stages=1, rows=None)` has check.activation_bytes_estimate's
    signature and meaning. `settings`: the variant's own keys with their defaults, set in a
    preset's [model.settings] or by --set model.settings.KEY=VALUE and read with
    `settings(cfg)`."""
    declared = tuple(sorted((settings or {}).items()))

    def add(build: Any) -> Any:
        if name in _KINDS and _KINDS[name].build is not build:
            raise ValueError(f"model kind {name!r} is registered twice ({_KINDS[name].build} "
                             f"and {build}); give the variant another name")
        _KINDS[name] = ModelKind(name, build, param_count, flops_per_token, activation_bytes,
                                 declared)
        return build

    return add


def _discover() -> None:
    global _discovered
    if _discovered:
        return
    _discovered = True
    package = __name__.rsplit(".", 1)[0]
    for module in pkgutil.iter_modules(importlib.import_module(package).__path__):
        importlib.import_module(f"{package}.{module.name}")


def known_kinds() -> list[str]:
    _discover()
    return sorted(_KINDS)


def model_kind(cfg: Any) -> ModelKind:
    """The registered variant `cfg.kind` names; a ConfigError listing the known ones if none."""
    _discover()
    name = getattr(cfg, "kind", DEFAULT_KIND)
    if name not in _KINDS:
        raise ConfigError(f"model.kind = {name!r}: no such model variant; known: "
                          f"{', '.join(sorted(_KINDS))} (a module in trainer/model/ registers "
                          "one with @register)")
    return _KINDS[name]


def settings(cfg: Any) -> dict[str, Any]:
    """The variant's [model.settings]: its declared defaults with what the config sets, each of
    its default's type; a ConfigError for a key it does not declare or a value of another
    type (at every entry point: resolve builds the variant abstractly first)."""
    kind = model_kind(cfg)
    values = dict(kind.settings)
    for key, value in getattr(cfg, "settings", ()):
        if key not in values:
            close = difflib.get_close_matches(key, list(values), n=1, cutoff=0.75)
            hint = f" (did you mean model.settings.{close[0]}?)" if close else ""
            allowed = ", ".join(values) or "none"
            raise ConfigError(f"model.settings.{key}{hint}: model.kind = {kind.name!r} has no "
                              f"such setting; its settings: {allowed}")
        default = values[key]
        if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if type(value) is not type(default):
            raise ConfigError(f"model.settings.{key} = {value!r}: expected "
                              f"{type(default).__name__} (the default of model.kind = "
                              f"{kind.name!r} is {default!r})")
        values[key] = value
    return values


def build_model(cfg: Any, *, rngs: Any) -> Any:
    return model_kind(cfg).build(cfg, rngs=rngs)


def param_count(cfg: Any) -> int:
    """The variant's parameter count (the logs, --check, the planner)."""
    kind = model_kind(cfg)
    if kind.param_count is not None:
        return kind.param_count(cfg)
    return sum(math.prod(shape) for _, shape, _ in parameter_layout(cfg))


def flops_per_token(cfg: Any) -> int:
    """The variant's training FLOPs per token (MFU, the planner's token arithmetic)."""
    count = model_kind(cfg).flops_per_token or _KINDS[DEFAULT_KIND].flops_per_token
    assert count is not None, "the dense transformer registers its FLOPs"
    return count(cfg)


Parameter = tuple[str, tuple[int, ...], tuple[str | None, ...]]  # path, shape, logical axes


@dataclasses.dataclass(frozen=True)
class ModelLayout:
    """What an abstract build of the variant shows (no arrays): its parameters, how its layers
    stack, and which model.* keys it read. Every check the toolkit makes on a model asks this,
    not the dense transformer's keys the variant may ignore (model/checks.py)."""

    kind: str
    parameters: tuple[Parameter, ...]
    units: int  # entries of the layer stack: what the pipeline's stages split
    layers_per_unit: int  # layers each entry holds (the variant's repeating unit)
    reads: frozenset[str]  # the model.* keys the variant read while it was built

    @property
    def count(self) -> int:
        return sum(math.prod(shape) for _, shape, _ in self.parameters)


def _recording(cfg: Any) -> tuple[Any, set[str]]:
    """A copy of `cfg` that notes every key read from it, and the set it notes them in."""
    reads: set[str] = set()
    keys = {f.name for f in dataclasses.fields(cfg)}

    class Recording(type(cfg)):
        def __getattribute__(self, name: str) -> Any:
            if name in keys:
                reads.add(name)
            return object.__getattribute__(self, name)

    Recording.__name__ = Recording.__qualname__ = type(cfg).__name__
    return Recording(**{key: getattr(cfg, key) for key in keys}), reads


@functools.lru_cache(maxsize=16)
def describe(cfg: Any) -> ModelLayout:
    """The variant's layout from an abstract build (no arrays); ConfigError where it refuses
    the config (a depth that is not a whole number of its units, say)."""
    import jax
    from flax import nnx
    from jax.sharding import PartitionSpec

    kind = model_kind(cfg)
    settings(cfg)  # a setting the variant does not declare is refused even if it never reads it
    recorded, reads = _recording(cfg)
    abstract = nnx.eval_shape(lambda: kind.build(recorded, rngs=nnx.Rngs(params=0)))
    state = nnx.state(abstract)
    specs = nnx.to_pure_dict(nnx.get_partition_spec(state))
    shapes = nnx.to_pure_dict(state)
    flat_specs = jax.tree_util.tree_flatten_with_path(
        specs, is_leaf=lambda x: isinstance(x, PartitionSpec))[0]
    flat_shapes = jax.tree.leaves(shapes)
    parameters = tuple(
        (jax.tree_util.keystr(path, simple=True, separator="."), tuple(shape.shape),
         tuple(spec) if isinstance(spec, PartitionSpec) else (None,) * len(shape.shape))
        for (path, spec), shape in zip(flat_specs, flat_shapes, strict=True))
    size = int(getattr(abstract, "layers_per_unit", 1))
    stacked = {shape[0] for _, shape, logical in parameters if logical[:1] == ("layers",)}
    units = stacked.pop() if len(stacked) == 1 else int(getattr(abstract, "units",
                                                                cfg.n_layers // size))
    return ModelLayout(kind.name, parameters, units, size, frozenset(reads))


def parameter_layout(cfg: Any) -> tuple[Parameter, ...]:
    """(path, shape, logical axis names) of every parameter of the variant (describe)."""
    return describe(cfg).parameters
