"""The device mesh: axes (pipeline, data, fsdp, tensor, and any a fork adds: config.MESH_AXES),
hybrid across slices.

Inside a slice the devices talk over ICI, between slices over DCN. The mesh puts the DCN factor
of every axis outermost, so only the axes given dcn_* > 1 ever cross slices.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from .config import ResolvedMesh, Topology
from .runtime.distributed import processes_per_slice


def slice_of(device: jax.Device) -> int:
    """The slice a device belongs to: `slice_index` on TPU; elsewhere its process // the hosts
    of a slice (CPU devices report slice_index 0).

    Under `multislice local` every process plays one slice; an emulated TPU VM takes the hosts of
    a slice from its metadata, as on TPU (see distributed.processes_per_slice).
    """
    if device.platform == "tpu":
        return int(getattr(device, "slice_index", 0) or 0)
    return device.process_index // processes_per_slice()


def devices_by_slice(devices: Sequence[jax.Device] | None = None) -> dict[int, list[jax.Device]]:
    groups: dict[int, list[jax.Device]] = collections.defaultdict(list)
    for device in devices if devices is not None else jax.devices():
        groups[slice_of(device)].append(device)
    return dict(sorted(groups.items()))


def current_topology(devices: Sequence[jax.Device] | None = None) -> Topology:
    devices = list(devices if devices is not None else jax.devices())
    groups = devices_by_slice(devices)
    sizes = {len(g) for g in groups.values()}
    if len(sizes) != 1:
        detail = ", ".join(f"slice {s}: {len(g)}" for s, g in groups.items())
        raise RuntimeError(f"slices have different device counts ({detail})")
    return Topology(
        num_slices=len(groups),
        devices_per_slice=sizes.pop(),
        num_processes=jax.process_count(),
    )


def build_mesh(resolved: ResolvedMesh, devices: Sequence[jax.Device] | None = None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    if all(size == 1 for size in resolved.dcn):
        device_array = mesh_utils.create_device_mesh(resolved.ici, devices)
    elif all(d.platform == "tpu" for d in devices):
        device_array = mesh_utils.create_hybrid_device_mesh(resolved.ici, resolved.dcn, devices)
    else:
        device_array = _hybrid_mesh_by_slice(resolved.ici, resolved.dcn, devices)
    axes = resolved.axes
    return Mesh(np.asarray(device_array), axes, axis_types=(AxisType.Auto,) * len(axes))


def _hybrid_mesh_by_slice(ici: Sequence[int], dcn: Sequence[int],
                          devices: Sequence[jax.Device]) -> np.ndarray:
    """create_hybrid_device_mesh with the slices of `slice_of` as its granules: off TPU there is
    no slice_index, and a slice may span several processes (JAX's process_is_granule would make
    each host a slice). With one process a slice this is exactly process_is_granule=True."""
    groups = devices_by_slice(devices)
    if math.prod(dcn) != len(groups):
        raise ValueError(f"{len(groups)} slices (hosts {processes_per_slice()} a slice) but the "
                         f"DCN axes {tuple(dcn)} multiply to {math.prod(dcn)}")
    per_slice = [mesh_utils.create_device_mesh(ici, group) for group in groups.values()]
    layout = np.arange(len(per_slice)).reshape(dcn)
    blocks = np.vectorize(lambda i: per_slice[i], otypes=[object])(layout)
    return np.block(blocks.tolist())
