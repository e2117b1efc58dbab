"""Auxiliary values a model reports from anywhere in its forward pass: losses and metrics.

A module calls `report("load_balance", value, weight=0.01)` for a loss the step adds to the
objective (weight x value), or `report("router_entropy", value)` for a metric it only logs.
Values are scalars; each name is summed over everything that reports it (every layer, every
scan step, every pipeline stage), so a per-layer quantity arrives as its sum over layers. The
train step logs every name (train/NAME in TensorBoard, a field of the metrics rows, `report`'s
summary) with no list to keep.

The blocks carry what they report through every transformation the model uses: the layer scan,
remat and the pipeline's stages each collect inside their traced function and hand the sums
out as outputs (a value never leaves the function it was traced in). Outside a `collect()`
(decoding, a plain forward call) reports are dropped.

Gradient accumulation and pipeline micro-batches: the step averages each value over the
micro-batches. For a value that is a mean over the batch's rows (a cross-entropy, a per-token
penalty) that is exactly its full-batch value; a value computed from batch statistics (a
load-balancing loss from the batch's routing fractions) is the mean of its per-micro-batch
values instead, which train.grad_accum_steps and pipeline micro-batches then change.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping

import jax
import jax.numpy as jnp

Aux = dict[str, jax.Array]  # name -> float32 scalar
# What the train step reports itself, and the cross-entropy the loss adds beside a model's
# weighted losses: a model's report may not take these names.
STEP_METRICS = ("loss", "grad_norm", "learning_rate", "finite", "batch_digest")
RESERVED = (*STEP_METRICS, "cross_entropy")


@dataclasses.dataclass
class _Bag:
    values: Aux
    weights: dict[str, float]  # shared with the outermost bag: a loss's weight, by name


_bags: list[_Bag | None] = []  # None: reports are dropped (muted)


def report(name: str, value: jax.Array | float, weight: float | None = None) -> None:
    """Add `value` (a scalar) to the auxiliary value `name`; with `weight`, the step also adds
    weight x value to the loss it differentiates."""
    if not _bags or _bags[-1] is None:
        return
    if name in RESERVED or not name.replace("_", "").isalnum():
        raise ValueError(f"auxiliary value name {name!r}: use letters, digits and _, and none of "
                         f"the step's own names ({', '.join(RESERVED)})")
    value = jnp.asarray(value, jnp.float32)
    if value.shape != ():
        raise ValueError(f"auxiliary value {name!r} has shape {value.shape}; report a scalar "
                         "(reduce it first, e.g. .mean())")
    bag = _bags[-1]
    if weight is not None:
        known = bag.weights.setdefault(name, float(weight))
        if known != float(weight):
            raise ValueError(f"auxiliary loss {name!r} is reported with weights {known} and "
                             f"{weight}; one name, one weight")
    bag.values[name] = bag.values[name] + value if name in bag.values else value


def report_all(values: Mapping[str, jax.Array]) -> None:
    """Add what a nested `collect()` returned (its weights are already known) to this one."""
    if not _bags or _bags[-1] is None:
        return
    bag = _bags[-1]
    for name, value in values.items():
        bag.values[name] = bag.values[name] + value if name in bag.values else value


@contextlib.contextmanager
def collect() -> Iterator[_Bag]:
    """Collect what is reported while tracing the body; `bag.values` is the sum by name and
    `bag.weights` the weight of each loss (of this bag and every bag nested in it)."""
    outer = next((b for b in reversed(_bags) if b is not None), None)
    bag = _Bag(values={}, weights=outer.weights if outer is not None else {})
    _bags.append(bag)
    try:
        yield bag
    finally:
        _bags.pop()


@contextlib.contextmanager
def muted() -> Iterator[None]:
    """Drop what is reported in the body (decoding: no loss is being computed)."""
    _bags.append(None)
    try:
        yield
    finally:
        _bags.pop()


def weighted_sum(values: Aux, weights: Mapping[str, float]) -> jax.Array:
    """sum(weight x value) over the reported losses; 0 when there are none."""
    total = jnp.zeros((), jnp.float32)
    for name, weight in sorted(weights.items()):
        total = total + weight * values[name]
    return total
