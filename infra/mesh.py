"""The -1 fill of one mesh group (ici_* over a slice's devices, dcn_* over the slices).

One home for the rule the stack schema, the planner and the trainer's config share: at most one
axis of a group is -1 and takes whatever the fixed axes leave of the group's total; every other
axis is a positive integer; the product must equal the total. Each caller words its own message
from the ``MeshFillError`` fields.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

# Pipeline stages last here (they are the trainer mesh's outermost axis): a message about a mesh
# without stages reads as it did before the pipeline axis existed.
ICI_KEYS = ("ici_data", "ici_fsdp", "ici_tensor", "ici_pipeline")  # over the devices of a slice
DCN_KEYS = ("dcn_data", "dcn_fsdp", "dcn_tensor", "dcn_pipeline")  # over the slices
MESH_KEYS = ICI_KEYS + DCN_KEYS

Problem = Literal["bad_value", "two_fills", "not_divisible", "wrong_product"]


@dataclass(frozen=True)
class MeshFillError(ValueError):
    problem: Problem
    keys: tuple[str, ...]  # the offending axes (bad values, the fills)
    known: int  # product of the fixed axes
    total: int

    def __str__(self) -> str:
        return f"{self.problem}: {', '.join(self.keys)} (fixed product {self.known}, total {self.total})"


def fill_mesh_group(values: Mapping[str, int], total: int) -> dict[str, int]:
    """``values`` with its -1 filled in so the product is ``total``; raises MeshFillError."""
    bad = tuple(k for k, v in values.items() if v == 0 or v < -1)
    if bad:
        raise MeshFillError("bad_value", bad, 0, total)
    fills = tuple(k for k, v in values.items() if v == -1)
    known = math.prod(v for v in values.values() if v != -1)
    if len(fills) > 1:
        raise MeshFillError("two_fills", fills, known, total)
    if fills:
        if total % known:
            raise MeshFillError("not_divisible", fills, known, total)
        return {k: (total // known if v == -1 else v) for k, v in values.items()}
    if known != total:
        raise MeshFillError("wrong_product", (), known, total)
    return dict(values)
