"""`multislice plan`: the Multislice overview's DCN arithmetic, made executable.

Between slices, gradients travel over the data-center network (DCN), host by host. Data
parallelism across slices stays compute-bound while the backward pass does more FLOPs per bit of
DCN traffic than a host can send in the same time:

    hardware intensity    = peak FLOP/s of a host's chips / the host's DCN bits per second
                            (v4: 4 x 275e12 / 50e9 = 22,000 FLOP per bit)
    DCN bits per param    = 32 for 2 slices, 64 for 3 or more (bf16 all-reduce per step)
    operational intensity = backward FLOPs per param / DCN bits per param = 4 * b / bits

where b is the number of tokens one slice (one data-parallel replica) processes per step. So b
must be at least 22,000 * 32 / 4 = 176,000 tokens on two v4 slices and 352,000 on three or more;
the overview asks for about twice that (350,000 for two pods, 700,000 for many) because the DCN
can drop packets. `--tokens-per-batch` is the global batch; b is its share per slice.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from infra.mesh import DCN_KEYS, ICI_KEYS, MESH_KEYS
from infra.topology import MAX_SLICES
from scripts.argtypes import fraction, int_range, mesh_axis, positive_int, report_error

ADAM_MOMENT_BYTES = 8  # two fp32 moments per parameter
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
STRATEGIES = ("data_parallel", "fsdp_over_dcn", "pipeline", "does_not_fit")


class PlanError(ValueError):
    """A planner input is out of range; the message names the value and what is allowed."""


# ---------------------------------------------------------------------------------------------
# The seed's arithmetic.


def dcn_bits_per_param(replicas: int) -> int:
    """DCN bits each parameter costs per step when `replicas` slices all-reduce gradients."""
    if replicas <= 1:
        return 0
    return 32 if replicas == 2 else 64


def operational_intensity(tokens_per_replica: float, replicas: int) -> float:
    """Backward FLOPs per parameter (4 * b) over DCN bits per parameter; inf without DCN."""
    bits = dcn_bits_per_param(replicas)
    return math.inf if bits == 0 else 4.0 * tokens_per_replica / bits


def min_tokens_per_replica(hardware_flops_per_bit: float, replicas: int) -> int:
    """Smallest per-slice batch (tokens) whose backward pass hides the DCN all-reduce."""
    exact = hardware_flops_per_bit * dcn_bits_per_param(replicas) / 4.0
    return math.ceil(exact - 1e-6)


def recommended_tokens_per_replica(minimum: int) -> int:
    """The overview's safety margin: twice the minimum, to two significant figures.

    v4: 2 x 176,000 -> 350,000 (two pods) and 2 x 352,000 -> 700,000 (many pods).
    """
    doubled = 2 * minimum
    if doubled == 0:
        return 0
    scale = 10 ** (int(math.floor(math.log10(doubled))) - 1)
    return int(round(doubled / scale) * scale)


def transformer_params(
    d_model: int, n_layers: int, vocab_size: int, d_ff: int | None = None, tied: bool = True
) -> int:
    """Parameters of the template's decoder: attention 4*d^2, MLP 2*d*d_ff, RMSNorm scales."""
    ff = d_ff if d_ff is not None else 4 * d_model
    per_layer = 4 * d_model * d_model + 2 * d_model * ff + 2 * d_model
    embeddings = vocab_size * d_model * (1 if tied else 2)
    return n_layers * per_layer + embeddings + d_model


# ---------------------------------------------------------------------------------------------
# Meshes and their cost.


@dataclass(frozen=True)
class Mesh:
    ici_data: int = 1
    ici_fsdp: int = 1
    ici_tensor: int = 1
    ici_pipeline: int = 1
    dcn_data: int = 1
    dcn_fsdp: int = 1
    dcn_tensor: int = 1
    dcn_pipeline: int = 1  # pipeline stages across slices: activations cross DCN, not gradients

    @property
    def stages(self) -> int:
        return self.ici_pipeline * self.dcn_pipeline

    @property
    def dcn_replicas(self) -> int:
        """Slices that split the batch and reduce gradients over DCN (data and fsdp axes)."""
        return self.dcn_data * self.dcn_fsdp

    @property
    def batch_shards(self) -> int:
        """The data and fsdp shards a (micro-)batch is split over."""
        return self.ici_data * self.ici_fsdp * self.dcn_data * self.dcn_fsdp

    @property
    def state_shards(self) -> int:
        return self.ici_fsdp * self.ici_tensor * self.dcn_fsdp * self.dcn_tensor * self.stages

    def trainer_keys(self) -> dict[str, int]:
        return {key: getattr(self, key) for key in MESH_KEYS}


@dataclass(frozen=True)
class Hardware:
    accelerator_type: str
    devices_per_slice: int
    hosts_per_slice: int
    chips_per_host: int
    flops_per_bit: float
    hbm_bytes_per_device: int
    peak_flops_per_device: float


@dataclass(frozen=True)
class Workload:
    slices: int
    params: int
    tokens_per_batch: int
    param_bytes: int = 4
    hbm_budget: float = 0.75  # share of HBM the training state may take; activations get the rest
    d_model: int | None = None  # sizes the activations a pipeline sends; None: not known
    n_layers: int | None = None  # the stages must divide it; None: not known
    embedding_params: int = 0  # embedding (+ untied head): reduced over stages, not split
    microbatches: int | None = None  # --pipeline-microbatches; None: the planner picks M
    repeats: int | None = None  # --pipeline-repeats; None: the planner picks R with M
    # Sequences per optimizer micro-step (global batch / grad_accum_steps) when the experiment
    # is known: the micro-batches must split it. None: any power-of-two multiple of S is taken.
    batch_sequences: int | None = None

    @property
    def state_bytes_per_param(self) -> int:
        # parameters, their gradients (same dtype), Adam's two fp32 moments
        return 2 * self.param_bytes + ADAM_MOMENT_BYTES


@dataclass
class Assessment:
    mesh: Mesh
    dcn_replicas: int
    tokens_per_replica: float
    dcn_bits_per_param: int
    operational_intensity: float | None  # None: no gradient traffic over DCN
    min_tokens_per_slice: int
    recommended_tokens_per_slice: int
    compute_bound: bool
    meets_margin: bool
    state_bytes_per_device: float
    hbm_budget_bytes: float
    fits_hbm: bool
    pipeline: PipelineCost | None = None


def assess(hw: Hardware, work: Workload, mesh: Mesh) -> Assessment:
    replicas = mesh.dcn_replicas
    tokens = work.tokens_per_batch / replicas
    oi = operational_intensity(tokens, replicas)
    minimum = min_tokens_per_replica(hw.flops_per_bit, replicas)
    margin = recommended_tokens_per_replica(minimum)
    state = work.params * work.state_bytes_per_param / mesh.state_shards
    budget = work.hbm_budget * hw.hbm_bytes_per_device
    return Assessment(
        mesh=mesh,
        dcn_replicas=replicas,
        tokens_per_replica=tokens,
        dcn_bits_per_param=dcn_bits_per_param(replicas),
        operational_intensity=None if math.isinf(oi) else oi,
        min_tokens_per_slice=minimum,
        recommended_tokens_per_slice=margin,
        compute_bound=oi >= hw.flops_per_bit,
        meets_margin=tokens >= margin,
        state_bytes_per_device=state,
        hbm_budget_bytes=budget,
        fits_hbm=state <= budget,
    )


# ---------------------------------------------------------------------------------------------
# The recommendation (the overview's "which parallelism across slices" reasoning).


@dataclass
class Recommendation:
    strategy: str
    assessment: Assessment
    reasons: list[str] = field(default_factory=list)


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


def _tok(x: float) -> str:
    return f"{x:,.0f}"


def _gib(x: float) -> str:
    return f"{x / 2**30:,.1f} GiB"


def recommend(hw: Hardware, work: Workload, ici: Mesh) -> Recommendation:
    """Start from pure data parallelism and move away from it only for the reasons the seed gives.

    `ici` carries the within-slice axes; the DCN axes are chosen here.
    """
    n = work.slices
    dp = assess(hw, work, replace(ici, dcn_data=n))
    batch_line = (
        f"{_tok(work.tokens_per_batch)} tokens per step over {n} slices is "
        f"{_tok(dp.tokens_per_replica)} per slice; the minimum for {n} slices is "
        f"{_tok(dp.min_tokens_per_slice)} (4 x b / {dp.dcn_bits_per_param} bits >= "
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
                f"Warning: below the recommended margin of {_tok(dp.recommended_tokens_per_slice)}"
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
                        f"{_gib(dp.state_bytes_per_device)} per device, over the "
                        f"{_gib(dp.hbm_budget_bytes)} budget; sharding it over {f} slices "
                        f"(dcn_fsdp={f}) brings it to {_gib(fsdp.state_bytes_per_device)}.",
                        "FSDP over DCN adds weight all-gathers per step, so keep dcn_fsdp as small "
                        "as fits; the overview checks it against DCN the same way as data "
                        "parallelism.",
                    ],
                )
        return _does_not_fit(hw, work, ici, dp, batch_line)

    # Too few tokens per slice for data parallelism over DCN: pipeline stages share the batch.
    reasons = [batch_line + ", so pure data parallelism would wait on DCN."]
    unsplit = []
    for depth in _pipeline_depths(n):
        if work.n_layers is not None and work.n_layers % depth:
            unsplit.append(depth)
            continue
        pp = assess(hw, work, replace(ici, dcn_data=n // depth, dcn_pipeline=depth))
        if pp.compute_bound and pp.fits_hbm:
            replicas = n // depth
            cost = pipeline_cost(hw, work, pp.mesh)
            pp.pipeline = cost
            reasons.append(
                f"A pipeline of {depth} stages over DCN (dcn_pipeline={depth}) with {replicas} "
                f"data-parallel replica(s) gives {_tok(pp.tokens_per_replica)} tokens per "
                "pipeline"
                + (
                    f" (minimum {_tok(pp.min_tokens_per_slice)} for {replicas} replicas)."
                    if replicas > 1
                    else " and no layer-gradient all-reduce over DCN at all."
                )
            )
            reasons.append(
                "Shallowest pipeline that hides DCN: 2 stages with N/2 replicas, then 4 with N/4, "
                "... as the overview suggests, because the bubble and the micro-batching cost "
                "FLOPs."
            )
            reasons.append(_schedule_line(cost))
            reasons.append(_traffic_line(hw, cost))
            reasons.append(
                f"Alternative: raise the global batch to at least "
                f"{_tok(dp.min_tokens_per_slice * n)} tokens (recommended "
                f"{_tok(dp.recommended_tokens_per_slice * n)}) and keep pure data parallelism, "
                "if convergence per example holds at that batch size (check that first)."
            )
            return Recommendation("pipeline", pp, reasons)
    if unsplit:
        reasons.append(f"A pipeline over {', '.join(map(str, unsplit))} slices would hide DCN "
                       f"traffic, but n-layers {work.n_layers} does not split into that many "
                       "stages; choose a layer count divisible by the stages.")
        return Recommendation("does_not_fit", dp, reasons)
    return _does_not_fit(hw, work, ici, dp, batch_line)


BUBBLE_TARGET = 0.10  # the planner picks the fewest micro-batches whose bubble is at most this


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """Every stage idles S - 1 of the R M + S - 1 ticks of a pass (R = 1: GPipe)."""
    return (stages - 1) / (repeats * microbatches + stages - 1)


def activation_sends_per_micro_batch(stages: int, microbatches: int, repeats: int) -> float:
    """Micro-batch activations a stage sends per micro-batch of a pass, forward and backward:
    one each way at every tick (trainer/pipeline.py), 2 (R M + S - 1) / M."""
    return 2 * (repeats * microbatches + stages - 1) / microbatches


def default_schedule(stages: int, sequences: int | None = None, shards: int = 1,
                     n_layers: int | None = None, microbatches: int | None = None,
                     repeats: int | None = None,
                     hidden: Callable[[int, int], bool] | None = None) -> tuple[int, int]:
    """(M, R): of the micro-batch counts that split the batch and the repeats that split the
    layers, the fewest repeats and then the fewest micro-batches with a bubble of at most
    BUBBLE_TARGET (R multiplies the activation hand-overs of a step, so R = 1 whenever enough
    micro-batches split the batch); when none reaches the target, the smallest bubble there is,
    with the fewest hand-overs. `hidden(M, R)` says whether the hand-overs hide behind the
    stage's compute: a repeat count that would make them wait on DCN is not taken when R = 1
    hides them (a bubble costs less than a stalled link). A given M or R is kept."""
    if microbatches is not None:
        micros = [microbatches]
    elif sequences is None:
        micros = [default_microbatches(stages)]
    else:
        micros = [m for m in range(stages, sequences + 1, stages)
                  if sequences % m == 0 and (sequences // m) % shards == 0]
        if not micros:
            raise PlanError(f"a batch of {sequences} sequences does not split into a multiple "
                            f"of {stages} micro-batches of {shards} data x fsdp shards each; "
                            f"raise train.global_batch_size to a multiple of {stages * shards}")
    if repeats is not None:
        laps = [repeats]
    elif n_layers is not None:
        laps = [r for r in range(1, n_layers // stages + 1) if n_layers % (stages * r) == 0]
    else:
        laps = [1, 2, 4, 8]
    pairs = [(m, r) for m in micros for r in laps]
    if hidden is not None and repeats is None:
        hiding = [p for p in pairs if p[1] == 1 or hidden(*p)]
        if any(hidden(m, 1) for m in micros):
            pairs = hiding
    good = [p for p in pairs if bubble_fraction(stages, *p) <= BUBBLE_TARGET]
    if good:
        return min(good, key=lambda p: (p[1], p[0]))
    return min(pairs, key=lambda p: (bubble_fraction(stages, *p),
                                     activation_sends_per_micro_batch(stages, *p), p))


def default_microbatches(stages: int) -> int:
    """Without a batch to split: the fewest S x 2**k micro-batches (the trainer needs a
    multiple of S) with a bubble of at most BUBBLE_TARGET: 16 for 2 stages (5.9%), 32 for 4."""
    micro = stages
    while bubble_fraction(stages, micro) > BUBBLE_TARGET:
        micro *= 2
    return micro


@dataclass
class PipelineCost:
    stages: int
    microbatches: int
    repeats: int
    bubble_fraction: float
    # Bytes one slice sends over DCN per step. Activations: at each of the R M + S - 1 ticks a
    # stage hands one micro-batch to the next (trainer/pipeline.py), and its gradient back in
    # the backward pass; bfloat16. None without --d-model.
    activation_bytes_per_step: float | None
    # The layer gradients each stage still all-reduces with its replicas in other slices, plus
    # the embedding's (and the head's), which every stage holds: summed over all slices.
    gradient_bytes_per_step: float
    # What pure data parallelism over all slices sends instead.
    data_parallel_gradient_bytes_per_step: float
    # Stage FLOPs per activation bit sent (None without --d-model), against the hardware's.
    activation_intensity: float | None
    compute_bound: bool | None


def pipeline_cost(hw: Hardware, work: Workload, mesh: Mesh) -> PipelineCost:
    stages = mesh.stages
    tokens = work.tokens_per_batch / mesh.dcn_replicas

    def intensity_of(micro: int, repeats: int) -> float | None:
        """Stage FLOPs per activation bit sent; None without --d-model."""
        if work.d_model is None:
            return None
        sent = activation_sends_per_micro_batch(stages, micro, repeats) * tokens * work.d_model
        return 6 * work.params / stages * tokens / (8 * 2 * sent)

    def hidden(micro: int, repeats: int) -> bool:
        found = intensity_of(micro, repeats)
        return found is None or found >= hw.flops_per_bit

    micro, repeats = default_schedule(stages, work.batch_sequences, mesh.batch_shards,
                                      work.n_layers, work.microbatches, work.repeats, hidden)
    if micro % stages:
        raise PlanError(f"pipeline microbatches {micro} is not a multiple of the {stages} "
                        f"pipeline stages; use {stages}, {2 * stages}, {4 * stages}, ...")
    sequences = work.batch_sequences
    if sequences is not None and (sequences % micro or (sequences // micro) % mesh.batch_shards):
        raise PlanError(f"pipeline microbatches {micro}: the batch of {sequences} sequences "
                        f"does not split into {micro} micro-batches of {mesh.batch_shards} "
                        "data x fsdp shards each")
    replicas = mesh.dcn_replicas
    layer_params = max(work.params - work.embedding_params, 0)
    gradients = (layer_params / stages * dcn_bits_per_param(replicas)
                 + work.embedding_params * dcn_bits_per_param(work.slices)) / 8
    activations = None
    if work.d_model is not None:
        activations = (activation_sends_per_micro_batch(stages, micro, repeats) * tokens
                       * work.d_model * 2)
    intensity = intensity_of(micro, repeats)
    return PipelineCost(
        stages=stages,
        microbatches=micro,
        repeats=repeats,
        bubble_fraction=bubble_fraction(stages, micro, repeats),
        activation_bytes_per_step=activations,
        gradient_bytes_per_step=gradients,
        data_parallel_gradient_bytes_per_step=work.params * dcn_bits_per_param(work.slices) / 8,
        activation_intensity=intensity,
        compute_bound=None if intensity is None else intensity >= hw.flops_per_bit,
    )


def _schedule_line(cost: PipelineCost) -> str:
    s, m, r = cost.stages, cost.microbatches, cost.repeats
    if r == 1:
        return (f"GPipe with train.pipeline_microbatches={m}: a bubble of (S-1)/(M+S-1) = "
                f"{s - 1}/{m + s - 1} = {cost.bubble_fraction:.1%} of every stage's time; more "
                "micro-batches shrink it, as long as each still splits over a stage's data x "
                "fsdp devices (or train.pipeline_repeats, at R times the hand-overs).")
    return (f"Circular with train.pipeline_microbatches={m} and train.pipeline_repeats={r}: a "
            f"bubble of (S-1)/(RM+S-1) = {s - 1}/{r * m + s - 1} = {cost.bubble_fraction:.1%} "
            f"of every stage's time (GPipe's with M = {m}: {s - 1}/{m + s - 1} = "
            f"{bubble_fraction(s, m):.1%}), for {r} times its activation hand-overs.")


def _traffic_line(hw: Hardware, cost: PipelineCost) -> str:
    grads = (f"gradients {_gib(cost.gradient_bytes_per_step)} instead of "
             f"{_gib(cost.data_parallel_gradient_bytes_per_step)} under data parallelism")
    if cost.activation_bytes_per_step is None:
        return (f"Per slice and step over DCN: {grads}; give --d-model (or the model's "
                "dimensions) to size the activations the stages send each other.")
    verdict = ("which hides behind the stage's compute" if cost.compute_bound else
               "so the activations, too, would wait on DCN: use fewer stages over DCN, a "
               "larger d_model per stage, or more tokens per step")
    return (f"Per slice and step over DCN: activations {_gib(cost.activation_bytes_per_step)} "
            f"(each tick one micro-batch to the next stage, and its gradient back; "
            f"train.pipeline_repeats R multiplies the ticks) plus {grads}, which include "
            f"the embedding's (and an untied head's): every stage holds them, so they are "
            f"summed over the stages once a step, the one reduction across them. That is "
            f"{cost.activation_intensity:,.0f} stage FLOPs per activation bit against "
            f"{hw.flops_per_bit:,.0f} per bit the host can send, {verdict}.")


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
            f"{_gib(widest.state_bytes_per_device)} per device, over the "
            f"{_gib(widest.hbm_budget_bytes)} budget "
            f"({work.hbm_budget:.0%} of {_gib(hw.hbm_bytes_per_device)} HBM).",
            "Use larger slices, more slices, bfloat16 parameters, or a smaller model.",
        ],
    )


# ---------------------------------------------------------------------------------------------
# Inputs.


def hardware_for(accelerator_type: str) -> Hardware:
    from infra.topology import (
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
    )


def resolve_group(values: dict[str, int | None], total: int, group: str) -> dict[str, int]:
    """Fill one -1 (an unset axis is 1) so the group's product equals `total`."""
    from infra.mesh import MeshFillError, fill_mesh_group

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
) -> Plan:
    """Validate the inputs (before anything else) and work out the plan."""
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
    )
    mesh_args = mesh_args or {}
    user_ici = {k: mesh_args.get(k) for k in ICI_KEYS}
    user_dcn = {k: mesh_args.get(k) for k in DCN_KEYS}
    if all(v is None for v in user_ici.values()):
        # The overview: inside a slice, prefer FSDP over data parallelism (ICI is fast).
        ici = Mesh(ici_fsdp=hw.devices_per_slice)
    else:
        ici = Mesh(
            **resolve_group(
                user_ici, hw.devices_per_slice,
                "ICI (ici_data x ici_fsdp x ici_tensor x ici_pipeline)",
            )
        )
    plan = Plan(
        hardware=hw,
        workload=work,
        data_parallel=assess(hw, work, replace(ici, dcn_data=slices)),
        recommendation=recommend(hw, work, ici),
    )
    if any(v is not None for v in mesh_args.values()):
        dcn = resolve_group(user_dcn, slices,
                            "DCN (dcn_data x dcn_fsdp x dcn_tensor x dcn_pipeline)")
        mesh = replace(ici, **dcn)
        plan.check = assess(hw, work, mesh)
        if mesh.stages > 1:
            _check_stages(work, mesh)
            plan.check.pipeline = pipeline_cost(hw, work, mesh)
            plan.check_notes.append(_schedule_line(plan.check.pipeline))
            plan.check_notes.append(_traffic_line(hw, plan.check.pipeline))
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
        raise PlanError(f"{shown} stages do not divide n-layers {work.n_layers}; use a number "
                        "of stages that divides the layer count")
    if (work.repeats is not None and work.n_layers is not None
            and work.n_layers % (stages * work.repeats)):
        raise PlanError(f"{shown} stages x pipeline repeats {work.repeats} do not divide "
                        f"n-layers {work.n_layers}")
    if work.microbatches is not None and work.microbatches % stages:
        raise PlanError(f"pipeline microbatches {work.microbatches} is not a multiple of the "
                        f"{shown} stages")


def paste_settings(rec: Recommendation, trainer: dict[str, Any] | None = None) -> list[str]:
    """The stack's `multislice:trainer:` block with the recommendation applied, to paste over
    the existing one: `trainer` is that block as the stack file has it (None: a fresh block)."""
    import yaml

    mesh = rec.assessment.mesh
    keys = {k: v for k, v in mesh.trainer_keys().items()
            if v != 1 or k in ("ici_fsdp", "dcn_data")}
    block = dict(trainer or {})
    block["mesh"] = keys
    overrides = {k: v for k, v in (block.get("overrides") or {}).items()
                 if k not in ("train.pipeline_microbatches", "train.pipeline_repeats")}
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


# ---------------------------------------------------------------------------------------------
# Output.


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
        "dcn_bits_per_param": dp.dcn_bits_per_param,
        "operational_intensity": dp.operational_intensity,
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
            "mesh": rec.assessment.mesh.trainer_keys(),
            "pipeline": None if rec.assessment.pipeline is None
            else asdict(rec.assessment.pipeline),
            "stack_settings": "\n".join(paste_settings(rec, plan.stack_trainer)),
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
        ("tokens per step", f"{_tok(work.tokens_per_batch)} ({_tok(dp.tokens_per_replica)} per slice)"),
        ("hardware intensity", f"{hw.flops_per_bit:,.0f} FLOP per DCN bit per host"),
        ("DCN bits per param", f"{dp.dcn_bits_per_param} per step (data parallel over {work.slices})"),
        ("operational intensity", f"{oi} (4 x tokens per slice / bits)"),
        ("min tokens per slice", f"{_tok(dp.min_tokens_per_slice)} "
         f"(global {_tok(dp.min_tokens_per_slice * work.slices)})"),
        ("recommended per slice", f"{_tok(dp.recommended_tokens_per_slice)} (margin for DCN drops)"),
        ("compute-bound (DP)", "NO" if not dp.compute_bound
         else "yes" if dp.meets_margin else "yes, but below the recommended margin"),
        ("state per device (DP)", f"{_gib(dp.state_bytes_per_device)} of "
         f"{_gib(dp.hbm_budget_bytes)} budget ({_gib(hw.hbm_bytes_per_device)} HBM): "
         + ("fits" if dp.fits_hbm else "does NOT fit")),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    mesh = rec.assessment.mesh
    axes = " ".join(f"{k}={v}" for k, v in mesh.trainer_keys().items() if v != 1)
    lines += ["", f"recommendation: {rec.strategy.replace('_', ' ')}  ({axes})"]
    lines += [f"  - {reason}" for reason in rec.reasons]
    if rec.strategy != "does_not_fit":
        where = plan.stack_file or "stacks/Pulumi.STACK.yaml"
        lines += ["", f"stack settings to paste ({where}, replacing its multislice:trainer "
                      "block under config:):" if plan.stack_file else
                      f"stack settings to paste ({where}, under config:):"]
        lines += [f"  {line}" for line in paste_settings(rec, plan.stack_trainer)]
    if plan.check is not None:
        c = plan.check
        c_oi = "n/a" if c.operational_intensity is None else f"{c.operational_intensity:,.0f}"
        lines += [
            "",
            "your mesh: " + " ".join(f"{k}={v}" for k, v in c.mesh.trainer_keys().items()
                                     if v != 1 or not k.endswith("_pipeline")),
            f"  {_tok(c.tokens_per_replica)} tokens per replica, intensity {c_oi} FLOP/bit, "
            f"compute-bound: {'yes' if c.compute_bound else 'NO'}, state "
            f"{_gib(c.state_bytes_per_device)} per device: {'fits' if c.fits_hbm else 'does NOT fit'}",
        ]
        lines += [f"  - {note}" for note in plan.check_notes]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Command line.


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="DCN arithmetic, HBM fit and a parallelism recommendation for a multislice job",
        description="Check a Multislice job before paying for it: is data parallelism across "
        "slices compute-bound over the data-center network, does the training state fit in HBM, "
        "and which parallelism to use. The per-slice batch must be large enough that the "
        "backward pass does more FLOPs per bit of DCN traffic than a host can send. The model "
        "and batch come from a stack file (--stack-config), an experiment's preset "
        "(--experiment DIR --config NAME), or the size flags.",
    )
    source = parser.add_argument_group("what to plan (a stack, an experiment, or sizes)")
    source.add_argument("--stack-config", type=Path, metavar="FILE",
                        help="a stacks/Pulumi.STACK.yaml: accelerator, slices, mesh and the "
                        "experiment's preset with the stack's trainer settings")
    source.add_argument("--experiment", type=Path, metavar="DIR",
                        help="an experiment directory (multislice new): its preset gives the "
                        "model and the batch")
    source.add_argument("--config", default=None, metavar="NAME",
                        help="with --experiment: the preset (default: default)")
    source.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="with --experiment: a config override")
    parser.add_argument("--accelerator-type", help="e.g. v4-8, v5litepod-16")
    parser.add_argument("--slices", type=int_range(2, MAX_SLICES), help=f"2 to {MAX_SLICES}")
    parser.add_argument("--tokens-per-batch", type=parse_count,
                        help="global tokens per step (default with an experiment: "
                        "train.global_batch_size x model.seq_len)")
    size = parser.add_argument_group("model size (--params, or the model's dimensions)")
    size.add_argument("--params", type=parse_count, help="parameter count, e.g. 8e9 or 8B")
    size.add_argument("--d-model", type=positive_int)
    size.add_argument("--n-layers", type=positive_int)
    size.add_argument("--vocab-size", type=positive_int, default=None,
                      help="default 256 (bytes)")
    size.add_argument("--d-ff", type=positive_int, help="default 4 x d-model")
    size.add_argument("--untied-embeddings", action="store_true")
    mesh = parser.add_argument_group("a mesh to check (optional; -1 fills the rest of a group)")
    for key in MESH_KEYS:
        mesh.add_argument(f"--{key.replace('_', '-')}", type=mesh_axis, default=None)
    parser.add_argument("--pipeline-microbatches", type=positive_int, default=None, metavar="M",
                        help="GPipe micro-batches for a pipeline (default: the fewest that "
                        f"split the batch with a bubble of at most {BUBBLE_TARGET * 100:.0f}%%)")
    parser.add_argument("--pipeline-repeats", type=positive_int, default=None, metavar="R",
                        help="laps of a circular pipeline (default: 1 when enough micro-batches "
                        "split the batch, else the fewest that reach the bubble target)")
    parser.add_argument("--param-dtype", choices=tuple(DTYPE_BYTES), default=None,
                        help="default float32 (with an experiment: its model.param_dtype)")
    parser.add_argument(
        "--hbm-budget",
        type=fraction(allow_zero=False, allow_one=True),
        default=0.75,
        help="share of HBM the training state may use (default 0.75; activations need the rest)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=main)


SIZE_FLAGS = ("params", "d_model", "n_layers", "vocab_size", "d_ff", "untied_embeddings")


@dataclass
class Inputs:
    """What the plan is made of, from the flags, an experiment or a stack."""
    accelerator_type: str
    slices: int
    params: float
    tokens_per_batch: float
    mesh_args: dict[str, int | None]
    param_dtype: str
    d_model: int | None
    n_layers: int | None
    embedding_params: int
    batch_sequences: int | None = None
    model_source: str | None = None
    stack_file: str | None = None
    stack_trainer: dict[str, Any] | None = None


def _params_from_args(args: argparse.Namespace) -> float:
    dims = {"--d-model": args.d_model, "--n-layers": args.n_layers}
    if args.params is not None:
        if any(v is not None for v in dims.values()):
            raise PlanError("give either --params or --d-model/--n-layers, not both")
        return args.params
    missing = [k for k, v in dims.items() if v is None]
    if missing:
        raise PlanError(f"model size missing: give --params, or {' and '.join(missing)}, or "
                        "--experiment DIR --config NAME, or --stack-config FILE")
    return transformer_params(
        args.d_model, args.n_layers, args.vocab_size or 256, args.d_ff,
        tied=not args.untied_embeddings
    )


def _inputs_from_flags(args: argparse.Namespace) -> Inputs:
    missing = [flag for flag, value in (("--accelerator-type", args.accelerator_type),
                                        ("--slices", args.slices),
                                        ("--tokens-per-batch", args.tokens_per_batch))
               if value is None]
    if missing:
        raise PlanError(f"give {', '.join(missing)} (or --stack-config FILE, which has them)")
    vocab = args.vocab_size or 256
    return Inputs(
        accelerator_type=args.accelerator_type, slices=args.slices,
        params=_params_from_args(args), tokens_per_batch=args.tokens_per_batch,
        mesh_args={k: getattr(args, k) for k in MESH_KEYS},
        param_dtype=args.param_dtype or "float32", d_model=args.d_model,
        n_layers=args.n_layers,
        embedding_params=(vocab * args.d_model * (2 if args.untied_embeddings else 1)
                          if args.params is None else 0))


def _inputs_from_experiment(args: argparse.Namespace, experiment: Path, preset: str,
                            overrides: list[str], accelerator_type: str | None,
                            slices: int | None, mesh_args: dict[str, int | None]) -> Inputs:
    from infra.experiment import ExperimentError, model_summary

    given = [f"--{k.replace('_', '-')}" for k in SIZE_FLAGS if getattr(args, k)]
    if given:
        raise PlanError(f"{', '.join(given)}: the model comes from {experiment} --config "
                        f"{preset}; drop the size flags (or use --set model.KEY=VALUE)")
    missing = [flag for flag, value in (("--accelerator-type", accelerator_type),
                                        ("--slices", slices)) if value is None]
    if missing:
        raise PlanError(f"give {' and '.join(missing)} (or --stack-config FILE, which has them)")
    try:
        summary = model_summary(experiment, preset, overrides)
    except ExperimentError as exc:
        raise PlanError(str(exc)) from None
    model, train = summary["model"], summary["train"]
    tokens = args.tokens_per_batch or train["global_batch_size"] * model["seq_len"]
    accum = max(int(train.get("grad_accum_steps") or 1), 1)
    return Inputs(
        accelerator_type=accelerator_type, slices=slices, params=summary["param_count"],
        tokens_per_batch=tokens, mesh_args=mesh_args,
        param_dtype=args.param_dtype or ("bfloat16" if model["param_dtype"] == "bfloat16"
                                         else "float32"),
        d_model=model["d_model"], n_layers=model["n_layers"],
        embedding_params=model["vocab_size"] * model["d_model"]
        * (1 if model["tie_embeddings"] else 2),
        batch_sequences=train["global_batch_size"] // accum,
        model_source=f"{experiment} --config {preset}"
        + "".join(f" --set {o}" for o in overrides if not o.startswith("mesh.")))


def _inputs_from_stack(args: argparse.Namespace) -> Inputs:
    from infra.experiment import trainer_overrides
    from infra.schema import StackConfigError, find_project_root, project_name, read_stack_file
    from infra.validation import load_stack_file

    given = [flag for flag, value in (("--experiment", args.experiment),
                                      ("--config", args.config),
                                      ("--set", args.overrides),
                                      ("--accelerator-type", args.accelerator_type),
                                      ("--slices", args.slices),
                                      *((f"--{k.replace('_', '-')}", getattr(args, k))
                                        for k in MESH_KEYS)) if value]
    if given:
        raise PlanError(f"{', '.join(given)}: --stack-config {args.stack_config} already says "
                        "that; change the stack file instead")
    path = args.stack_config
    if not path.is_file():
        raise PlanError(f"--stack-config {path}: no such file (a stacks/Pulumi.STACK.yaml)")
    try:
        root = find_project_root(path.parent)
        cfg = load_stack_file(path, base_dir=root, check_files=False)
        raw = read_stack_file(path, project_name(root))
    except StackConfigError as exc:
        raise PlanError(str(exc)) from None
    if cfg.slices < 2:
        raise PlanError(f"--stack-config {path}: slices {cfg.slices}: a single slice sends "
                        "nothing over DCN, so there is nothing to plan (Multislice is 2 to "
                        f"{MAX_SLICES} slices)")
    preset, overrides = trainer_overrides(cfg)
    trainer = json.loads(next((v for k, v in raw.items() if k.endswith(":trainer")), "{}"))
    experiment = Path(cfg.experiment_dir)
    inputs = _inputs_from_experiment(
        args, experiment if experiment.is_absolute() else root / experiment, preset, overrides,
        cfg.accelerator_type, cfg.slices,
        mesh_args=dict(cfg.resolved_mesh()))
    inputs.stack_file = str(path)
    inputs.stack_trainer = trainer if isinstance(trainer, dict) else {}
    return inputs


def inputs_from_args(args: argparse.Namespace) -> Inputs:
    if args.stack_config is not None:
        return _inputs_from_stack(args)
    if args.experiment is not None:
        return _inputs_from_experiment(
            args, args.experiment, args.config or "default", list(args.overrides),
            args.accelerator_type, args.slices, {k: getattr(args, k) for k in MESH_KEYS})
    if args.config or args.overrides:
        raise PlanError("--config and --set go with --experiment DIR")
    return _inputs_from_flags(args)


def main(args: argparse.Namespace) -> int:
    try:
        inputs = inputs_from_args(args)
        plan = make_plan(
            accelerator_type=inputs.accelerator_type,
            slices=inputs.slices,
            params=inputs.params,
            tokens_per_batch=inputs.tokens_per_batch,
            mesh_args=inputs.mesh_args,
            param_dtype=inputs.param_dtype,
            hbm_budget=args.hbm_budget,
            d_model=inputs.d_model,
            n_layers=inputs.n_layers,
            embedding_params=inputs.embedding_params,
            microbatches=args.pipeline_microbatches,
            batch_sequences=inputs.batch_sequences,
            repeats=args.pipeline_repeats,
        )
    except PlanError as exc:
        report_error("plan", exc)
        return 2
    plan.model_source = inputs.model_source
    plan.stack_file, plan.stack_trainer = inputs.stack_file, inputs.stack_trainer
    print(json.dumps(plan_to_json(plan), indent=2) if args.json else format_plan(plan))
    return 0
