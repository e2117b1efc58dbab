"""The collectives of a compiled program, and which mesh axes each one crosses.

`collectives(compiled.as_text(), mesh)` reads XLA's optimized HLO: every all-gather, all-reduce,
reduce-scatter, all-to-all and collective-permute, its operand bytes, and the mesh axes along
which its device groups (or source-target pairs) differ. That answers questions such as "does
anything but activations cross the pipeline axis?" (tests/test_pipeline.py) or "what crosses
DCN?" (benchmarks/pipeline.py) from the program itself instead of from what the code intends.

Device ids in the HLO are positions in the program's device assignment, which for a jitted
function over a mesh is `mesh.devices.flat`; XLA writes the groups in three forms (explicit
lists, iota `[G,N]<=[dims]T(perm)`, and mesh-axis subsets `mesh['axis_0'=a,...] {'axis_0'}`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import numpy as np
from jax.sharding import Mesh

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_OP_RE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.-]+ = (?P<shape>.+?) (?P<kind>" + "|".join(KINDS)
                    + r")(?:-start)?\((?P<rest>.*)$")
_ARRAY_RE = re.compile(r"\b(pred|s8|u8|s16|u16|bf16|f16|s32|u32|f32|s64|u64|f64)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    shape: str  # the result type as XLA prints it
    bytes: int  # of the result (all arrays of a tuple)
    axes: tuple[str, ...]  # mesh axes its groups span, in mesh order
    line: str
    # device groups (source-target pairs for a permute), as positions in mesh.devices.flat;
    # empty: one group of every device
    groups: tuple[tuple[int, ...], ...] = ()


def _iota(text: str) -> np.ndarray:
    """`[G,N]<=[d0,d1]T(1,0)` (or `<=[n]`) -> the device ids as a G x N array."""
    match = re.fullmatch(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if not match:
        raise ValueError(f"unrecognised iota device list {text!r}")
    out = [int(v) for v in match.group(1).split(",")]
    dims = [int(v) for v in match.group(2).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if match.group(3):
        ids = ids.transpose([int(v) for v in match.group(3).split(",")])
    return ids.reshape(out)


def _groups(rest: str) -> list[list[int]]:
    pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", rest)
    if pairs:
        return [[int(v) for v in pair.split(",")] for pair in re.findall(r"\{(\d+,\d+)\}",
                                                                          pairs.group(0))]
    mesh_form = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(([^)]*\)?)\))?"
                          r" \{([^}]*)\}", rest)
    if mesh_form:
        sizes = {name: int(size) for name, size in
                 re.findall(r"'([^']+)'=(\d+)", mesh_form.group(1))}
        total = math.prod(sizes.values())
        ids = (_iota(f"[{total}]<={mesh_form.group(2)}") if mesh_form.group(2)
               else np.arange(total)).reshape(list(sizes.values()))
        names = list(sizes)
        spanned = [names.index(n) for n in re.findall(r"'([^']+)'", mesh_form.group(3))]
        kept = [i for i in range(len(names)) if i not in spanned]
        grouped = ids.transpose(kept + spanned)
        return grouped.reshape(-1, math.prod(grouped.shape[len(kept):]) or 1).tolist()
    iota = re.search(r"replica_groups=(\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)", rest)
    if iota:
        return _iota(iota.group(1)).tolist()
    explicit = re.search(r"replica_groups=\{(.*?)\}(?:,|$| )", rest)
    if explicit:
        return [[int(v) for v in group.split(",")]
                for group in re.findall(r"\{([\d,]+)\}", explicit.group(0))]
    return []  # no groups: every device (one group)


def _spanned_axes(groups: Sequence[Sequence[int]], mesh: Mesh) -> tuple[str, ...]:
    if not groups:
        return tuple(name for name, size in mesh.shape.items() if size > 1)
    coords = np.stack(np.unravel_index(np.arange(mesh.devices.size), mesh.devices.shape), 1)
    varies = np.zeros(len(mesh.axis_names), bool)
    for group in groups:
        members = coords[np.asarray(group, int)]
        varies |= (members != members[0]).any(axis=0)
    return tuple(name for name, flag in zip(mesh.axis_names, varies, strict=True) if flag)


def array_bytes(shape_text: str) -> int:
    return sum(_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
               for dtype, dims in _ARRAY_RE.findall(shape_text))


def collectives(hlo_text: str, mesh: Mesh) -> list[Collective]:
    """Every collective op of a compiled module (`compiled.as_text()`), with what it spans."""
    found = []
    for line in hlo_text.splitlines():
        match = _OP_RE.match(line)
        if not match:
            continue
        groups = _groups(match.group("rest"))
        found.append(Collective(kind=match.group("kind"), shape=match.group("shape"),
                                bytes=array_bytes(match.group("shape")),
                                axes=_spanned_axes(groups, mesh), line=line.strip(),
                                groups=tuple(tuple(g) for g in groups)))
    return found


def crossing(found: Sequence[Collective], axis: str) -> list[Collective]:
    """The collectives whose groups span `axis`."""
    return [c for c in found if axis in c.axes]
