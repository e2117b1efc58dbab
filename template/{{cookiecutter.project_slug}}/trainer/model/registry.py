"""Model variants side by side: `model.kind` in a preset picks one by name.

Every module of this package may register a variant; the registry imports them all the first
time a kind is looked up, so a fork adds a variant by adding a module (say `moe.py`):

    from .registry import register
    from .transformer import TransformerLM, param_count, flops_per_token

    @register("moe", param_count=moe_param_count, flops_per_token=moe_flops_per_token)
    class MoeLM(TransformerLM):
        ...

and a preset that says `kind = "moe"` in its [model] section (`extends = "tiny"` keeps the rest).
A variant is built as `Variant(model_config, rngs=nnx.Rngs(...))` and offers what the dense
transformer does to the train step, the loss, decoding and the pipeline (`hidden`,
`unembedding`, `__call__`, `decode`, `blocks`): subclassing TransformerLM and replacing a part is
the short way. `param_count` and `flops_per_token` feed the logs, MFU, `--check` and the planner;
they default to the dense transformer's arithmetic, which counts every parameter as used by every
token, so a sparse variant gives its own.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable
from typing import Any

DEFAULT_KIND = "transformer"


@dataclasses.dataclass(frozen=True)
class ModelKind:
    name: str
    build: Callable[..., Any]  # (model config, *, rngs) -> the nnx module
    param_count: Callable[[Any], int] | None  # None: the dense transformer's arithmetic
    flops_per_token: Callable[[Any], int] | None


_KINDS: dict[str, ModelKind] = {}
_discovered = False


def register(name: str, *, param_count: Callable[[Any], int] | None = None,
             flops_per_token: Callable[[Any], int] | None = None) -> Callable[[Any], Any]:
    """Class (or factory) decorator: `model.kind = name` builds it."""

    def add(build: Any) -> Any:
        if name in _KINDS and _KINDS[name].build is not build:
            raise ValueError(f"model kind {name!r} is registered twice ({_KINDS[name].build} "
                             f"and {build}); give the variant another name")
        _KINDS[name] = ModelKind(name, build, param_count, flops_per_token)
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
    from ..config import ConfigError

    _discover()
    name = getattr(cfg, "kind", DEFAULT_KIND)
    if name not in _KINDS:
        raise ConfigError(f"model.kind = {name!r}: no such model variant; known: "
                          f"{', '.join(sorted(_KINDS))} (a module in trainer/model/ registers "
                          "one with @register)")
    return _KINDS[name]


def build_model(cfg: Any, *, rngs: Any) -> Any:
    return model_kind(cfg).build(cfg, rngs=rngs)


def param_count(cfg: Any) -> int:
    """The variant's parameter count (the logs, --check, the planner)."""
    from . import transformer

    return (model_kind(cfg).param_count or transformer.param_count)(cfg)


def flops_per_token(cfg: Any) -> int:
    """The variant's training FLOPs per token (MFU, the planner's token arithmetic)."""
    from . import transformer

    return (model_kind(cfg).flops_per_token or transformer.flops_per_token)(cfg)
