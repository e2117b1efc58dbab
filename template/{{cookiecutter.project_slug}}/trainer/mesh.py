"""The device mesh: axes (pipeline, data, fsdp, tensor), hybrid across slices.

Inside a slice the devices talk over ICI, between slices over DCN. The mesh puts the DCN factor
of every axis outermost, so only the axes given dcn_* > 1 ever cross slices.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from .config import MESH_AXES, ResolvedMesh, Topology

AXES = MESH_AXES


def slice_of(device: jax.Device) -> int:
    """The slice a device belongs to: `slice_index` on TPU; its process elsewhere.

    Under CPU emulation every process plays one slice (CPU devices report slice_index 0).
    """
    if device.platform == "tpu":
        return int(getattr(device, "slice_index", 0) or 0)
    return device.process_index


def process_is_granule(devices: Sequence[jax.Device]) -> bool:
    return any(d.platform != "tpu" for d in devices)


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
    else:
        # Off TPU each process plays one slice (a "granule") instead of slice_index.
        device_array = mesh_utils.create_hybrid_device_mesh(
            resolved.ici, resolved.dcn, devices, process_is_granule=process_is_granule(devices)
        )
    return Mesh(np.asarray(device_array), AXES, axis_types=(AxisType.Auto,) * len(AXES))
