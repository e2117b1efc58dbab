"""The checks of orchestration tpu-vm (a queued resource of TPU VMs), and the queueing window as
the TPU API takes it."""

from __future__ import annotations

import re
from datetime import UTC, datetime

from infra.stack_config.schema import StackConfig
from infra.stack_config.topology import SliceTopology, runtime_version_generation

_DURATION_RE = re.compile(r"^(\d+)([smhd])\Z")


def parse_window_time(value: str) -> datetime | None:
    """An ISO-8601 timestamp with its offset (``Z`` or ``+09:00``) as an aware datetime.

    None when ``value`` is not a timestamp; a timestamp without an offset raises ValueError, since
    it would mean a different instant on every machine.
    """
    try:
        stamp = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    if stamp.tzinfo is None:
        raise ValueError(f"{value!r} has no time zone; add Z (UTC) or an offset such as +09:00")
    return stamp


def queueing_window_to_api(value: str) -> dict[str, str]:
    """``6h`` -> ``{"duration": "21600s"}``; a timestamp -> ``{"time": "...Z"}``, in UTC.

    ``2026-12-01T09:00:00+09:00`` is the instant ``2026-12-01T00:00:00Z``: the offset is applied,
    never dropped.
    """
    match = _DURATION_RE.match(value)
    if match:
        unit = {"s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]
        return {"duration": f"{int(match.group(1)) * unit}s"}
    stamp = parse_window_time(value)
    if stamp is None:
        raise ValueError(f"{value!r} is neither a duration nor an ISO-8601 timestamp")
    return {"time": stamp.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}


def _window_problems(cfg: StackConfig, now: datetime | None = None) -> list[str]:
    now = now or datetime.now(UTC)
    problems: list[str] = []
    stamps: dict[str, datetime] = {}
    for field in ("valid_after", "valid_until"):
        value = getattr(cfg, field)
        if value is None or _DURATION_RE.match(value):
            continue
        try:
            stamp = parse_window_time(value)
        except ValueError as exc:
            problems.append(f"{field}: {exc}")
            continue
        if stamp is None:
            problems.append(
                f"{field}: {value!r} is neither a duration (e.g. 30m, 6h, 2d) nor an ISO-8601 "
                "timestamp with a time zone (e.g. 2026-12-01T00:00:00Z)"
            )
        elif field == "valid_until" and stamp <= now:
            problems.append(
                f"valid_until: {value!r} is in the past (now {now:%Y-%m-%dT%H:%M:%SZ}); the "
                "request would expire before it is queued: use a later time or a duration"
            )
        else:
            stamps[field] = stamp
    if problems:
        return problems
    if cfg.valid_until and cfg.valid_after:
        if _DURATION_RE.match(cfg.valid_until) or _DURATION_RE.match(cfg.valid_after):
            return [
                f"valid_until/valid_after: {cfg.valid_after!r}..{cfg.valid_until!r}: when both "
                "are set they form an interval and must both be ISO-8601 timestamps"
            ]
        if stamps["valid_after"] >= stamps["valid_until"]:
            return [
                f"valid_after/valid_until: {cfg.valid_after!r} is not before "
                f"{cfg.valid_until!r}; the interval is empty: valid_after must come first"
            ]
    return []


def _runtime_problems(cfg: StackConfig, topo: SliceTopology) -> list[str]:
    version = cfg.effective_runtime_version
    owner = runtime_version_generation(version)
    if owner is not None and owner is not topo.generation:
        return [
            f"runtime_version: {version!r} is the software image for TPU {owner.family}, not "
            f"for {topo.accelerator_type}; use {topo.generation.default_runtime_version!r} "
            "(or leave runtime_version unset for that default)"
        ]
    return []


def tpu_vm_problems(cfg: StackConfig, topo: SliceTopology | None,
                    now: datetime | None = None) -> tuple[list[str], list[str]]:
    """(problems, warnings) of a stack whose orchestration is tpu-vm."""
    problems: list[str] = []
    warnings: list[str] = []
    if cfg.gke is not None:
        problems.append("gke: is set but orchestration is 'tpu-vm'; set "
                        "multislice:orchestration: gke to run on GKE, or remove multislice:gke")
    if cfg.capacity == "flex-start":
        problems.append("capacity: 'flex-start' is a GKE node pool setting here (the "
                        "google-cloud-tpu client of the queued resource has no flex-start "
                        "field); set multislice:orchestration: gke, or use on-demand, spot, "
                        "reserved or guaranteed")
    if topo is not None and not topo.generation.cloud_tpu_api:
        problems.append(
            f"accelerator_type: {topo.accelerator_type!r} is {topo.family.upper()}, which the "
            "Cloud TPU API (queued resources, TPU VMs: orchestration 'tpu-vm') does not serve "
            "(Cloud TPU's TPU7x page: \"you must use Google Kubernetes Engine\"); set "
            "multislice:orchestration: gke with gke.kind 'all' (pools of its own), 'capacity' "
            "(a platform team's pools) or 'workload' (a team's job on them)")
        return problems, warnings
    if topo is not None and cfg.slices > 1 and topo.hosts == 1:
        warnings.append(
            f"accelerator_type: {topo.accelerator_type} is a single-host slice; whether the TPU "
            "API accepts a multislice of single-host slices is not settled by a public source "
            "(Google's GKE multislice page allows multi-host slices only; the TPU VM pages say "
            "nothing): the create may be refused. A multi-host type (e.g. v5litepod-16) is "
            "the documented path"
        )
    if topo is not None:
        problems += _runtime_problems(cfg, topo)
    problems += _window_problems(cfg, now=now)
    return problems, warnings
