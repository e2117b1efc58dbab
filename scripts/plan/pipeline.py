"""What a pipeline axis costs: the GPipe or circular bubble, micro-batches, and the stage-to-stage
activation traffic over DCN."""

from __future__ import annotations

from collections.abc import Callable

from scripts.plan.cost import Hardware, Mesh, PipelineCost, Workload, gib_text
from scripts.plan.formulas import PlanError, dcn_bits_per_param

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


def schedule_line(cost: PipelineCost) -> str:
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


def traffic_line(hw: Hardware, cost: PipelineCost) -> str:
    grads = (f"gradients {gib_text(cost.gradient_bytes_per_step)} instead of "
             f"{gib_text(cost.data_parallel_gradient_bytes_per_step)} under data parallelism")
    if cost.activation_bytes_per_step is None:
        return (f"Per slice and step over DCN: {grads}; give --d-model (or the model's "
                "dimensions) to size the activations the stages send each other.")
    verdict = ("which hides behind the stage's compute" if cost.compute_bound else
               "so the activations, too, would wait on DCN: use fewer stages over DCN, a "
               "larger d_model per stage, or more tokens per step")
    return (f"Per slice and step over DCN: activations {gib_text(cost.activation_bytes_per_step)} "
            f"(each tick one micro-batch to the next stage, and its gradient back; "
            f"train.pipeline_repeats R multiplies the ticks) plus {grads}, which include "
            f"the embedding's (and an untied head's): every stage holds them, so they are "
            f"summed over the stages once a step, the one reduction across them. That is "
            f"{cost.activation_intensity:,.0f} stage FLOPs per activation bit against "
            f"{hw.flops_per_bit:,.0f} per bit the host can send, {verdict}.")
