"""A whole plan from validated inputs: hardware, mesh groups, the recommendation and the
snippet that pastes into a stack."""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

from infra.stack_config.mesh import DCN_KEYS, ICI_KEYS, MESH_KEYS, group_keys
from infra.stack_config.topology import MAX_SLICES
from scripts.plan.cost import Assessment, Hardware, Mesh, Workload, assess
from scripts.plan.formulas import DTYPE_BYTES, PlanError
from scripts.plan.pipeline import pipeline_cost, schedule_line, traffic_line
from scripts.plan.recommend import Recommendation, recommend


def hardware_for(accelerator_type: str) -> Hardware:
    from infra.stack_config.topology import (
        UnknownAcceleratorError,
        flop_per_dcn_bit_per_host,
        parse_accelerator_type,
    )

    try:
        topo = parse_accelerator_type(accelerator_type)
    except UnknownAcceleratorError as exc:
        raise PlanError(str(exc)) from None
    return Hardware(
        accelerator_type=topo.accelerator_type,
        devices_per_slice=topo.devices,
        hosts_per_slice=topo.hosts,
        chips_per_host=topo.chips_per_host,
        flops_per_bit=flop_per_dcn_bit_per_host(topo),
        hbm_bytes_per_device=topo.hbm_bytes_per_chip * topo.chips // topo.devices,
        peak_flops_per_device=topo.peak_bf16_flops_per_slice / topo.devices,
        host_dcn_gbps=topo.host_dcn_bits_per_s / 1e9,
        dcn_source=topo.generation.dcn_source,
    )


def resolve_group(values: dict[str, int | None], total: int, group: str) -> dict[str, int]:
    """Fill one -1 (an unset axis is 1) so the group's product equals `total`."""
    from infra.stack_config.mesh import MeshFillError, fill_mesh_group

    resolved = {k: (v if v is not None else 1) for k, v in values.items()}
    try:
        return fill_mesh_group(resolved, total)
    except MeshFillError as err:
        if err.problem == "bad_value":
            key = err.keys[0]
            raise PlanError(f"{key.replace('_', '-')} {resolved[key]} is not allowed: use a "
                            "positive number or -1") from None
        if err.problem == "two_fills":
            raise PlanError(f"at most one {group} axis may be -1, got {', '.join(err.keys)}"
                            ) from None
        if err.problem == "not_divisible":
            raise PlanError(f"{group} axes: {total} is not divisible by the product {err.known} "
                            "of the others") from None
        shown = " x ".join(f"{k}={v}" for k, v in resolved.items())
        raise PlanError(f"{group} axes multiply to {err.known} ({shown}) but must equal {total}"
                        ) from None


_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str) -> float:
    """8e9, 8000000000, 8B, 350M, 1.5T."""
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([kKmMbBgGtT]?)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (e.g. 8e9, 8B, 350M)")
    try:
        value = float(match.group(1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (e.g. 8e9, 8B, 350M)") from None
    return value * _SUFFIX.get(match.group(2).lower(), 1.0)


@dataclass
class Plan:
    hardware: Hardware
    workload: Workload
    data_parallel: Assessment
    recommendation: Recommendation
    check: Assessment | None = None
    check_notes: list[str] = field(default_factory=list)
    model_source: str | None = None  # "experiments/x --config y": where the sizes came from
    stack_file: str | None = None
    stack_trainer: dict[str, Any] | None = None  # the stack's multislice:trainer block, raw
    # ici_NAME/dcn_NAME of axes the experiment adds, kept as given: the plan does not model
    # what they shard (the state is counted as if they did not), so it errs on the safe side
    added_axes: dict[str, int] = field(default_factory=dict)


def added_axes(mesh_args: dict[str, int | None]) -> dict[str, int]:
    """The mesh keys of axes an experiment adds (infra/stack_config/mesh.py), with their sizes (None: 1)."""
    keys = [k for group in ("ici", "dcn") for k in group_keys(mesh_args, group)
            if k not in MESH_KEYS]
    return {k: int(mesh_args.get(k) or 1) for k in keys}


def _left_by(added: dict[str, int], group: str, total: int, what: str) -> int:
    """What the added axes of `group` leave of `total` for the plan's axes."""
    taken = math.prod(v for k, v in added.items() if k.startswith(f"{group}_"))
    if taken < 1 or total % taken:
        shown = " x ".join(f"{k}={v}" for k, v in added.items() if k.startswith(f"{group}_"))
        raise PlanError(f"{shown} does not divide the {total} {what}")
    return total // taken


def make_plan(
    accelerator_type: str,
    slices: int,
    params: float,
    tokens_per_batch: float,
    mesh_args: dict[str, int | None] | None = None,
    param_dtype: str = "float32",
    hbm_budget: float = 0.75,
    d_model: int | None = None,
    n_layers: int | None = None,
    embedding_params: int = 0,
    microbatches: int | None = None,
    batch_sequences: int | None = None,
    repeats: int | None = None,
    seq_len: int | None = None,
    grad_accum: int = 1,
    flops_per_token: float | None = None,
    default_ici: dict[str, int] | None = None,
    layers_text: str | None = None,
) -> Plan:
    """Validate the inputs (before anything else) and work out the plan. `default_ici`: the
    within-slice axes when none are given (default: FSDP over the whole slice); ici_NAME and
    dcn_NAME keys of an axis the experiment adds are kept as given and take their devices out
    of the slice (or their slices out of the job) the plan divides."""
    hw = hardware_for(accelerator_type)
    if not isinstance(slices, int) or not 2 <= slices <= MAX_SLICES:
        raise PlanError(
            f"slices {slices!r} is out of range: Multislice uses 2 to {MAX_SLICES} slices "
            "(one slice has no DCN traffic to plan)"
        )
    if not params > 0 or not math.isfinite(params):
        raise PlanError(f"params {params:g} must be a positive number of parameters (e.g. 8e9)")
    if not tokens_per_batch >= 1 or not math.isfinite(tokens_per_batch):
        raise PlanError(
            f"tokens per batch {tokens_per_batch:g} must be a positive number of tokens"
        )
    if param_dtype not in DTYPE_BYTES:
        raise PlanError(f"param dtype {param_dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    if not 0 < hbm_budget <= 1:
        raise PlanError(f"HBM budget {hbm_budget!r} must be a fraction in (0, 1]")
    if microbatches is not None and microbatches < 1:
        raise PlanError(f"pipeline microbatches {microbatches} must be a positive integer (a "
                        "multiple of the pipeline stages)")
    if repeats is not None and repeats < 1:
        raise PlanError(f"pipeline repeats {repeats} must be a positive integer (1 = GPipe)")
    work = Workload(
        slices=slices,
        params=int(params),
        tokens_per_batch=int(tokens_per_batch),
        param_bytes=DTYPE_BYTES[param_dtype],
        hbm_budget=hbm_budget,
        d_model=d_model,
        n_layers=n_layers,
        embedding_params=embedding_params,
        microbatches=microbatches,
        batch_sequences=batch_sequences,
        repeats=repeats,
        seq_len=seq_len,
        layers_text=layers_text,
        grad_accum=grad_accum,
        flops_per_token=flops_per_token,
    )
    mesh_args = mesh_args or {}
    added = added_axes(mesh_args)
    devices = _left_by(added, "ici", hw.devices_per_slice, "devices per slice")
    slices_left = _left_by(added, "dcn", slices, "slices")
    work = replace(work, slices=slices_left) if slices_left != slices else work
    user_ici = {k: mesh_args.get(k) for k in ICI_KEYS}
    user_dcn = {k: mesh_args.get(k) for k in DCN_KEYS}
    if all(v is None for v in user_ici.values()):
        # The overview: inside a slice, prefer FSDP over data parallelism (ICI is fast).
        ici = Mesh(**(default_ici or {"ici_fsdp": devices}))
    else:
        ici = Mesh(
            **resolve_group(
                user_ici, devices,
                "ICI (ici_data x ici_fsdp x ici_tensor x ici_pipeline)",
            )
        )
    plan = Plan(
        hardware=hw,
        workload=work,
        data_parallel=assess(hw, work, replace(ici, dcn_data=slices)),
        recommendation=recommend(hw, work, ici),
        added_axes=added,
    )
    if any(v is not None for k, v in mesh_args.items() if k not in added):
        dcn = resolve_group(user_dcn, slices_left,
                            "DCN (dcn_data x dcn_fsdp x dcn_tensor x dcn_pipeline)")
        mesh = replace(ici, **dcn)
        plan.check = assess(hw, work, mesh)
        if mesh.stages > 1:
            _check_stages(work, mesh)
            plan.check.pipeline = pipeline_cost(hw, work, mesh)
            plan.check_notes.append(schedule_line(plan.check.pipeline))
            plan.check_notes.append(traffic_line(hw, plan.check.pipeline))
        if mesh.dcn_tensor > 1:
            plan.check_notes.append(
                f"dcn_tensor={mesh.dcn_tensor}: tensor parallelism over DCN needs far more "
                "bandwidth than DCN has; the overview says to keep it at 1"
            )
        if mesh.ici_data > 1:
            plan.check_notes.append(
                f"ici_data={mesh.ici_data}: inside a slice ICI is fast enough that FSDP is almost "
                "always better than data parallelism"
            )
        if not plan.check.compute_bound:
            plan.check_notes.append("this mesh is DCN-bound at this batch size")
        if not plan.check.fits_hbm:
            plan.check_notes.append("the training state does not fit the HBM budget")
    return plan


def _check_stages(work: Workload, mesh: Mesh) -> None:
    stages = mesh.stages
    shown = f"ici_pipeline x dcn_pipeline = {mesh.ici_pipeline} x {mesh.dcn_pipeline} = {stages}"
    if work.n_layers is not None and work.n_layers % stages:
        raise PlanError(f"{shown} stages do not divide {work.depth_text}; use a number "
                        f"of stages that divides {work.n_layers}")
    if (work.repeats is not None and work.n_layers is not None
            and work.n_layers % (stages * work.repeats)):
        raise PlanError(f"{shown} stages x pipeline repeats {work.repeats} do not divide "
                        f"{work.depth_text}")
    if work.microbatches is not None and work.microbatches % stages:
        raise PlanError(f"pipeline microbatches {work.microbatches} is not a multiple of the "
                        f"{shown} stages")


def paste_settings(rec: Recommendation, trainer: dict[str, Any] | None = None,
                   added: dict[str, int] | None = None) -> list[str]:
    """The stack's `multislice:trainer:` block with the recommendation applied, to paste over
    the existing one: `trainer` is that block as the stack file has it, or the one the planned
    preset and --set overrides make (so the paste trains the model and batch that were
    planned)."""
    import yaml

    mesh = rec.assessment.mesh
    keys = {k: v for k, v in {**mesh.trainer_keys(), **(added or {})}.items()
            if v != 1 or k in ("ici_fsdp", "dcn_data")}
    block = dict(trainer or {})
    block["mesh"] = keys
    overrides = {k: v for k, v in (block.get("overrides") or {}).items()
                 if k not in ("train.pipeline_microbatches", "train.pipeline_repeats")}
    if rec.global_batch_size is not None:
        overrides["train.global_batch_size"] = rec.global_batch_size
    if rec.assessment.pipeline is not None:
        overrides["train.pipeline_microbatches"] = rec.assessment.pipeline.microbatches
        overrides["train.pipeline_repeats"] = rec.assessment.pipeline.repeats
    if overrides:
        block["overrides"] = overrides
    else:
        block.pop("overrides", None)
    body = yaml.safe_dump({"multislice:trainer": block}, sort_keys=False,
                          default_flow_style=False)
    return body.rstrip("\n").splitlines()
