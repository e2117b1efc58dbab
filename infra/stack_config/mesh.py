"""The -1 fill of one mesh group (ici_* over a slice's devices, dcn_* over the slices).

One home for the rule the stack schema, the planner and the trainer's config share: at most one
axis of a group is -1 and takes whatever the fixed axes leave of the group's total; every other
axis is a positive integer; the product must equal the total. Each caller words its own message
from the ``MeshFillError`` fields.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

# Pipeline stages last here (they are the trainer mesh's outermost axis): a message about a mesh
# without stages reads as it did before the pipeline axis existed.
ICI_KEYS = ("ici_data", "ici_fsdp", "ici_tensor", "ici_pipeline")  # over the devices of a slice
DCN_KEYS = ("dcn_data", "dcn_fsdp", "dcn_tensor", "dcn_pipeline")  # over the slices
MESH_KEYS = ICI_KEYS + DCN_KEYS
# An axis an experiment adds (its trainer/config.py MESH_AXES, e.g. "expert") is one more
# ici_NAME/dcn_NAME pair; the experiment's own config check says whether it knows the name.
FORK_AXIS_KEY = re.compile(r"^(ici|dcn)_[a-z][a-z0-9]*\Z")


def group_keys(mesh: Mapping[str, object], group: Literal["ici", "dcn"]) -> tuple[str, ...]:
    """The built-in keys of `group` and then, in name order, those of the axes an experiment
    adds: every other ici_NAME or dcn_NAME in `mesh` names the axis NAME in both groups (a key
    not given is 1)."""
    builtin = ICI_KEYS if group == "ici" else DCN_KEYS
    added = sorted({f"{group}_{key[4:]}" for key in mesh
                    if FORK_AXIS_KEY.match(key) and key not in MESH_KEYS})
    return builtin + tuple(key for key in added if key not in builtin)


def group_values(mesh: Mapping[str, object], group: Literal["ici", "dcn"]) -> dict[str, int]:
    return {key: int(mesh.get(key, 1)) for key in group_keys(mesh, group)}  # type: ignore[call-overload]

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
