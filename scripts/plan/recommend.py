"""Which parallelism to use across slices: the overview's reasoning as a search over meshes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from scripts.plan.cost import Assessment, Hardware, Mesh, Workload, assess, gib_text, tokens_text
from scripts.plan.formulas import PlanError
from scripts.plan.pipeline import pipeline_cost, schedule_line, traffic_line

# what Recommendation.strategy can be
STRATEGIES = ("data_parallel", "fsdp_over_dcn", "pipeline", "does_not_fit")


@dataclass
class Recommendation:
    strategy: str
    assessment: Assessment
    reasons: list[str] = field(default_factory=list)
    # The train.global_batch_size the recommendation needs, when it is not the experiment's own.
    global_batch_size: int | None = None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _pipeline_depths(n: int) -> list[int]:
    """Depth 2, then 4, ... (powers of two dividing n), then n itself: shallowest first."""
    depths, d = [], 2
    while d <= n:
        if n % d == 0:
            depths.append(d)
        d *= 2
    if n not in depths:
        depths.append(n)
    return depths


def recommend(hw: Hardware, work: Workload, ici: Mesh) -> Recommendation:
    """Start from pure data parallelism and move away from it only for the reasons the seed gives.

    `ici` carries the within-slice axes; the DCN axes are chosen here.
    """
    n = work.slices
    dp = assess(hw, work, replace(ici, dcn_data=n))
    batch_line = (
        f"{tokens_text(work.tokens_per_batch)} tokens per step over {n} slices is "
        f"{tokens_text(dp.tokens_per_replica)} per slice; the minimum for {n} slices is "
        f"{tokens_text(dp.min_tokens_per_slice)} (4 x b / {dp.dcn_bits_per_param} bits >= "
        f"{hw.flops_per_bit:,.0f} FLOP/bit)"
    )
    if dp.compute_bound and dp.fits_hbm:
        reasons = [
            batch_line + ", so the gradient all-reduce hides behind the backward pass.",
            "Pure data parallelism is the overview's starting point: it needs no weight traffic "
            "over DCN beyond the one all-reduce per step.",
        ]
        if not dp.meets_margin:
            reasons.append(
                f"Warning: below the recommended margin of {tokens_text(dp.recommended_tokens_per_slice)}"
                " tokens per slice; DCN can drop packets, so a larger batch is safer."
            )
        return Recommendation("data_parallel", dp, reasons)

    if dp.compute_bound:
        # Enough tokens for DCN, but a full replica per slice does not fit: shard over DCN.
        for f in _divisors(n)[1:]:
            fsdp = assess(hw, work, replace(ici, dcn_data=n // f, dcn_fsdp=f))
            if fsdp.fits_hbm:
                return Recommendation(
                    "fsdp_over_dcn",
                    fsdp,
                    [
                        batch_line + ".",
                        f"Replicated per slice the training state needs "
                        f"{gib_text(dp.state_bytes_per_device)} per device, over the "
                        f"{gib_text(dp.hbm_budget_bytes)} budget; sharding it over {f} slices "
                        f"(dcn_fsdp={f}) brings it to {gib_text(fsdp.state_bytes_per_device)}.",
                        "FSDP over DCN adds weight all-gathers per step, so keep dcn_fsdp as small "
                        "as fits; the overview checks it against DCN the same way as data "
                        "parallelism.",
                    ],
                )
        return _does_not_fit(hw, work, ici, dp, batch_line)

    # Too few tokens per slice for data parallelism over DCN: pipeline stages share the batch.
    reasons = [batch_line + ", so pure data parallelism would wait on DCN."]
    unsplit, unbatched = [], []
    for depth in _pipeline_depths(n):
        if work.n_layers is not None and work.n_layers % depth:
            unsplit.append(depth)
            continue
        pp = assess(hw, work, replace(ici, dcn_data=n // depth, dcn_pipeline=depth))
        if pp.compute_bound and pp.fits_hbm:
            replicas = n // depth
            try:
                cost = pipeline_cost(hw, work, pp.mesh)
            except PlanError:
                if work.microbatches is not None or work.repeats is not None:
                    raise  # the schedule the user asked for: their input, said as it is
                unbatched.append(depth)  # the batch does not split into its micro-batches
                continue
            pp.pipeline = cost
            reasons.append(
                f"A pipeline of {depth} stages over DCN (dcn_pipeline={depth}) with {replicas} "
                f"data-parallel replica(s) gives {tokens_text(pp.tokens_per_replica)} tokens per "
                "pipeline"
                + (
                    f" (minimum {tokens_text(pp.min_tokens_per_slice)} for {replicas} replicas)."
                    if replicas > 1
                    else " and no layer-gradient all-reduce over DCN at all."
                )
            )
            reasons.append(
                "Shallowest pipeline that hides DCN: 2 stages with N/2 replicas, then 4 with N/4, "
                "... as the overview suggests, because the bubble and the micro-batching cost "
                "FLOPs."
            )
            reasons.append(schedule_line(cost))
            reasons.append(traffic_line(hw, cost))
            reasons.append(
                f"Alternative: raise the global batch to at least "
                f"{tokens_text(dp.min_tokens_per_slice * n)} tokens (recommended "
                f"{tokens_text(dp.recommended_tokens_per_slice * n)}) and keep pure data parallelism, "
                "if convergence per example holds at that batch size (check that first)."
            )
            return Recommendation("pipeline", pp, reasons)
    bigger = _larger_batch(hw, work, ici, dp, batch_line, unsplit + unbatched)
    if bigger is not None:
        return bigger
    if unsplit:
        reasons.append(f"A pipeline over {', '.join(map(str, unsplit))} slices would hide DCN "
                       f"traffic, but {work.depth_text} does not split into that many "
                       "stages; choose a layer count divisible by the stages.")
        return Recommendation("does_not_fit", dp, reasons)
    return _does_not_fit(hw, work, ici, dp, batch_line)


def _larger_batch(hw: Hardware, work: Workload, ici: Mesh, dp: Assessment, batch_line: str,
                  pipelines_tried: list[int]) -> Recommendation | None:
    """Pure data parallelism at the global batch that hides DCN with the recommended margin,
    when the experiment's sequence length is known and that batch fits; else None."""
    if not work.seq_len:
        return None
    n, accum = work.slices, max(work.grad_accum, 1)
    step = dp.mesh.batch_shards * accum  # the trainer splits each micro-step over the shards
    tokens = dp.recommended_tokens_per_slice * n
    sequences = math.ceil(tokens / work.seq_len / step) * step
    larger = replace(work, tokens_per_batch=sequences * work.seq_len,
                     batch_sequences=sequences // accum)
    big = assess(hw, larger, replace(ici, dcn_data=n))
    if not (big.compute_bound and big.fits_hbm):
        return None
    current = work.tokens_per_batch // work.seq_len
    tried = (f" (a pipeline over {', '.join(map(str, pipelines_tried))} slices does not split "
             "this model or this batch)" if pipelines_tried else "")
    return Recommendation("data_parallel", big, [
        batch_line + ", so pure data parallelism would wait on DCN" + tried + ".",
        f"Raise train.global_batch_size from {current:,} to {sequences:,} sequences of "
        f"{work.seq_len:,} tokens ({tokens_text(big.tokens_per_replica)} tokens per slice, the "
        "recommended margin) and keep pure data parallelism, if convergence per example holds "
        "at that batch (check that first).",
        "Pure data parallelism is the overview's starting point: it needs no weight traffic "
        "over DCN beyond the one all-reduce per step.",
    ], global_batch_size=sequences)


def _does_not_fit(
    hw: Hardware, work: Workload, ici: Mesh, dp: Assessment, batch_line: str
) -> Recommendation:
    widest = assess(hw, work, replace(ici, dcn_fsdp=work.slices))
    return Recommendation(
        "does_not_fit",
        widest,
        [
            batch_line + ".",
            f"Even sharded over every device of all {work.slices} slices the training state needs "
            f"{gib_text(widest.state_bytes_per_device)} per device, over the "
            f"{gib_text(widest.hbm_budget_bytes)} budget "
            f"({work.hbm_budget:.0%} of {gib_text(hw.hbm_bytes_per_device)} HBM).",
            "Use larger slices, more slices, bfloat16 parameters, or a smaller model.",
        ],
    )
