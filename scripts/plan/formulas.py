"""The Multislice overview's DCN arithmetic, one function per formula (check them against the
seed line by line).

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

import math

from infra.packaging.experiment import ADAM_MOMENT_BYTES  # noqa: F401 - two fp32 moments a parameter

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


class PlanError(ValueError):
    """A planner input is out of range; the message names the value and what is allowed."""


def dcn_bits_per_param(replicas: int) -> int:
    """DCN bits each parameter costs per step when `replicas` slices all-reduce gradients."""
    if replicas <= 1:
        return 0
    return 32 if replicas == 2 else 64


def operational_intensity(tokens_per_replica: float, replicas: int) -> float:
    """Backward FLOPs per parameter (4 * b) over DCN bits per parameter; inf without DCN."""
    bits = dcn_bits_per_param(replicas)
    return math.inf if bits == 0 else 4.0 * tokens_per_replica / bits


def min_tokens_per_replica(hardware_flops_per_bit: float, replicas: int,
                           active_fraction: float = 1.0) -> int:
    """Smallest per-slice batch (tokens) whose backward pass hides the DCN all-reduce.

    `active_fraction`: the share of the parameters a token's compute uses (below 1 for a
    sparse model, say a mixture of experts: every parameter's gradient still crosses the DCN,
    but a token does the work of only this share of them), so it needs 1/fraction the tokens."""
    exact = hardware_flops_per_bit * dcn_bits_per_param(replicas) / 4.0 / active_fraction
    return math.ceil(exact - 1e-6)


def active_fraction(flops_per_token: float | None, params: float) -> float:
    """A model's training FLOPs per token over the dense 6 FLOPs per parameter, at most 1.

    The dense model's attention FLOPs would put it above 1; the overview's arithmetic counts
    the weights alone, so a dense model keeps exactly its numbers. Unknown: 1."""
    if not flops_per_token or params <= 0:
        return 1.0
    return min(1.0, flops_per_token / (6.0 * params))


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
