"""An elastic job: training on fewer slices than the job has while some are away.

With `elastic.min_slices = F` (> 0) a launcher that lost a slice restarts the survivors at once as
a job of S < N slices (N: the job's full size, MULTISLICE_FULL_SLICES; S >= F) instead of waiting
for the lost one. The step does not change with S:

- the global batch is the same, and global batch g is the same examples (the data order is
  global, trainer.dataset.input_pipeline), so every step sees the example ids it would have;
- the slices that are left take the missing slices' rows as extra micro-batches:
  train.grad_accum_steps K on N slices becomes K * N / S on S, so a device's micro-batch (its
  memory) is the same at every size;
- with `elastic.canonical_reduction` the gradient is summed chunk by chunk in a fixed order
  (train_step.py), so the parameters after a shrink and a grow-back are the bits of an
  uninterrupted run. Without it the run equals any replay of the same failure schedule.

Every size from F to N is checked at start, so a batch that does not split over F slices fails
before the first step rather than at the first failure.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping

from ..config import Config, ConfigError, Topology

FULL_SLICES_ENV = "MULTISLICE_FULL_SLICES"
MARKER = "MULTISLICE_ELASTIC"  # the line that tells a launcher the job's floor


def full_slices(topology: Topology, env: Mapping[str, str] | None = None) -> int:
    """N, the job's full slice count: MULTISLICE_FULL_SLICES, else the slices it has now."""
    env = os.environ if env is None else env
    raw = env.get(FULL_SLICES_ENV, "")
    if not raw:
        return topology.num_slices
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < topology.num_slices:
        raise ConfigError(f"{FULL_SLICES_ENV}={raw!r}: expected the job's full slice count, an "
                          f"integer >= the {topology.num_slices} slice(s) running now")
    return value


def at_size(config: Config, full: int, slices: int) -> Config:
    """The config of an elastic job of `full` slices running on `slices` of them: dcn_data is
    the slice count and grad_accum_steps K * full / slices. The config itself when elastic is
    off or the job is whole."""
    e = config.elastic
    if slices == full:
        return config
    if not e.min_slices:
        raise ConfigError(
            f"{slices} of the job's {full} slices are running ({FULL_SLICES_ENV}={full}), but "
            "elastic.min_slices = 0 (off): a job that is not elastic trains on all its slices")
    if slices < e.min_slices:
        raise ConfigError(f"{slices} slice(s) running, fewer than elastic.min_slices = "
                          f"{e.min_slices}: the launcher waits for the lost slices instead")
    accum = config.train.grad_accum_steps
    if accum * full % slices:
        multiple = slices // math.gcd(full, slices)
        raise ConfigError(
            f"train.grad_accum_steps = {accum} on the job's {full} slices is {accum * full} "
            f"micro-batches a step, which do not split over {slices} slices (elastic.min_slices"
            f" = {e.min_slices}); make grad_accum_steps a multiple of {multiple}, or raise "
            "elastic.min_slices")
    mesh = config.mesh
    if mesh.dcn_data not in (-1, full):
        raise ConfigError(f"mesh.dcn_data = {mesh.dcn_data} but the job has {full} slices; "
                          "an elastic job sets it to -1 (the slices running)")
    return dataclasses.replace(
        config, mesh=dataclasses.replace(mesh, dcn_data=slices),
        train=dataclasses.replace(config.train, grad_accum_steps=accum * full // slices))


def sizes(config: Config, full: int) -> range:
    """The slice counts the job may train on: F .. N (just N when elastic is off)."""
    floor = config.elastic.min_slices
    if floor > full:
        raise ConfigError(f"elastic.min_slices = {floor} but the job has {full} slices: the floor "
                          "must be at most the job's size")
    return range(floor or full, full + 1)


def check_every_size(config: Config, full: int, topology: Topology, resolve) -> None:
    """Resolve the mesh at every size the job may shrink to (`resolve`: model.checks.resolve),
    naming the size that fails."""
    per_slice = topology.num_processes // topology.num_slices
    for slices in sizes(config, full):
        if slices == topology.num_slices:
            continue
        shrunk = Topology(num_slices=slices, devices_per_slice=topology.devices_per_slice,
                          num_processes=per_slice * slices)
        try:
            resolve(at_size(config, full, slices), shrunk)
        except ConfigError as exc:
            raise ConfigError(f"elastic.min_slices = {config.elastic.min_slices}: on {slices} of "
                              f"the job's {full} slices: {exc}") from None


def marker(config: Config, full: int, slices: int) -> str:
    return f"{MARKER} min_slices={config.elastic.min_slices} full_slices={full} slices={slices}"
