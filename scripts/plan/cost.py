"""What a mesh costs on a slice: memory per chip and DCN traffic per step (the seed's
formulas applied to one candidate mesh)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from infra.stack_config.mesh import MESH_KEYS
from scripts.plan.formulas import (
    ADAM_MOMENT_BYTES,
    active_fraction,
    dcn_bits_per_param,
    min_tokens_per_replica,
    operational_intensity,
    recommended_tokens_per_replica,
)


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
    host_dcn_gbps: float = 0.0
    dcn_source: str = ""  # where the host's DCN bandwidth comes from


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
    # Tokens per sequence and optimizer micro-steps per step, when the experiment is known: a
    # batch the plan needs is then said as train.global_batch_size.
    seq_len: int | None = None
    grad_accum: int = 1
    # The experiment's model.flops_per_token (its model variant's arithmetic), when known: a
    # sparse model does less work per token for the same gradient traffic.
    flops_per_token: float | None = None
    # How the messages name n_layers: an experiment's variant may stack its layers in units
    # of several, and then n_layers is the count of those units the stages split.
    layers_text: str | None = None

    @property
    def depth_text(self) -> str:
        return self.layers_text or f"n-layers {self.n_layers}"

    @property
    def active_fraction(self) -> float:
        return active_fraction(self.flops_per_token, self.params)

    @property
    def state_bytes_per_param(self) -> int:
        # parameters, their gradients (same dtype), Adam's two fp32 moments
        return 2 * self.param_bytes + ADAM_MOMENT_BYTES


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
    oi = operational_intensity(tokens, replicas) * work.active_fraction
    minimum = min_tokens_per_replica(hw.flops_per_bit, replicas, work.active_fraction)
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


def tokens_text(x: float) -> str:
    return f"{x:,.0f}"


def gib_text(x: float) -> str:
    return f"{x / 2**30:,.1f} GiB"
