"""A plan as text for a terminal and as JSON."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from scripts.plan.cost import Assessment, gib_text, tokens_text
from scripts.plan.planner import Plan, paste_settings


def _assessment_json(a: Assessment) -> dict[str, Any]:
    out = asdict(a)
    out["mesh"] = asdict(a.mesh)
    out["pipeline"] = None if a.pipeline is None else asdict(a.pipeline)
    return out


def plan_to_json(plan: Plan) -> dict[str, Any]:
    dp, rec, hw, work = plan.data_parallel, plan.recommendation, plan.hardware, plan.workload
    return {
        "accelerator_type": hw.accelerator_type,
        "slices": work.slices,
        "devices_per_slice": hw.devices_per_slice,
        "hosts_per_slice": hw.hosts_per_slice,
        "params": work.params,
        "tokens_per_batch": work.tokens_per_batch,
        "tokens_per_slice": dp.tokens_per_replica,
        "hardware_flops_per_bit": hw.flops_per_bit,
        "host_dcn_gbps": hw.host_dcn_gbps,
        "host_dcn_source": hw.dcn_source,
        "dcn_bits_per_param": dp.dcn_bits_per_param,
        "operational_intensity": dp.operational_intensity,
        "flops_per_token": work.flops_per_token,
        "active_fraction": work.active_fraction,
        "min_tokens_per_slice": dp.min_tokens_per_slice,
        "recommended_tokens_per_slice": dp.recommended_tokens_per_slice,
        "min_global_tokens_per_batch": dp.min_tokens_per_slice * work.slices,
        "compute_bound": dp.compute_bound,
        "meets_margin": dp.meets_margin,
        "hbm": {
            "bytes_per_device": dp.state_bytes_per_device,
            "budget_bytes": dp.hbm_budget_bytes,
            "hbm_bytes_per_device": hw.hbm_bytes_per_device,
            "fits": dp.fits_hbm,
            "bytes_per_param": work.state_bytes_per_param,
            "note": "parameters + gradients + Adam moments (fp32); activations excluded",
        },
        "recommendation": {
            "strategy": rec.strategy,
            "mesh": {**rec.assessment.mesh.trainer_keys(), **plan.added_axes},
            "pipeline": None if rec.assessment.pipeline is None
            else asdict(rec.assessment.pipeline),
            "stack_settings": "\n".join(paste_settings(rec, plan.stack_trainer, plan.added_axes)),
            "data_parallel_replicas": rec.assessment.dcn_replicas,
            "tokens_per_replica": rec.assessment.tokens_per_replica,
            "state_bytes_per_device": rec.assessment.state_bytes_per_device,
            "reasons": rec.reasons,
        },
        "check": None
        if plan.check is None
        else {**_assessment_json(plan.check), "notes": plan.check_notes},
    }


def format_plan(plan: Plan) -> str:
    dp, rec, hw, work = plan.data_parallel, plan.recommendation, plan.hardware, plan.workload
    oi = "n/a" if dp.operational_intensity is None else f"{dp.operational_intensity:,.0f} FLOP/bit"
    rows = [
        ("accelerator", f"{hw.accelerator_type} x {work.slices} slices "
         f"({hw.hosts_per_slice} host(s), {hw.devices_per_slice} devices per slice)"),
        ("parameters", f"{work.params:,}"
         + (f" ({plan.model_source})" if plan.model_source else "")),
        ("tokens per step", f"{tokens_text(work.tokens_per_batch)} ({tokens_text(dp.tokens_per_replica)} per slice)"),
        *([("work per token", f"{work.flops_per_token:,.0f} FLOP (the experiment's flops_per_token): "
            f"{work.active_fraction:.1%} of 6 x parameters, so a slice needs "
            f"{1 / work.active_fraction:,.1f}x the tokens of a dense model")]
          if work.active_fraction < 1 else []),
        ("hardware intensity", f"{hw.flops_per_bit:,.0f} FLOP per DCN bit per host"),
        *([("host DCN", f"{hw.host_dcn_gbps:,.0f} Gbps ({hw.dcn_source})")]
          if hw.dcn_source else []),
        ("DCN bits per param", f"{dp.dcn_bits_per_param} per step (data parallel over {work.slices})"),
        ("operational intensity", f"{oi} (4 x tokens per slice / bits"
         + (f" x {work.active_fraction:.3g} active" if work.active_fraction < 1 else "") + ")"),
        ("min tokens per slice", f"{tokens_text(dp.min_tokens_per_slice)} "
         f"(global {tokens_text(dp.min_tokens_per_slice * work.slices)})"),
        ("recommended per slice", f"{tokens_text(dp.recommended_tokens_per_slice)} (margin for DCN drops)"),
        ("compute-bound (DP)", "NO" if not dp.compute_bound
         else "yes" if dp.meets_margin else "yes, but below the recommended margin"),
        ("state per device (DP)", f"{gib_text(dp.state_bytes_per_device)} of "
         f"{gib_text(dp.hbm_budget_bytes)} budget ({gib_text(hw.hbm_bytes_per_device)} HBM): "
         + ("fits" if dp.fits_hbm else "does NOT fit")),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    mesh = rec.assessment.mesh
    axes = " ".join(f"{k}={v}" for k, v in {**mesh.trainer_keys(), **plan.added_axes}.items()
                    if v != 1)
    lines += ["", f"recommendation: {rec.strategy.replace('_', ' ')}  ({axes})"]
    lines += [f"  - {reason}" for reason in rec.reasons]
    if rec.strategy != "does_not_fit":
        where = plan.stack_file or "stacks/Pulumi.STACK.yaml"
        lines += ["", f"stack settings to paste ({where}, replacing its multislice:trainer "
                      "block under config:):" if plan.stack_file else
                      f"stack settings to paste ({where}, under config:):"]
        lines += [f"  {line}" for line in paste_settings(rec, plan.stack_trainer, plan.added_axes)]
    if plan.check is not None:
        c = plan.check
        c_oi = "n/a" if c.operational_intensity is None else f"{c.operational_intensity:,.0f}"
        lines += [
            "",
            "your mesh: " + " ".join(f"{k}={v}" for k, v in c.mesh.trainer_keys().items()
                                     if v != 1 or not k.endswith("_pipeline")),
            f"  {tokens_text(c.tokens_per_replica)} tokens per replica, intensity {c_oi} FLOP/bit, "
            f"compute-bound: {'yes' if c.compute_bound else 'NO'}, state "
            f"{gib_text(c.state_bytes_per_device)} per device: {'fits' if c.fits_hbm else 'does NOT fit'}",
        ]
        lines += [f"  - {note}" for note in plan.check_notes]
    return "\n".join(lines)
