"""A toy Mixture-of-Experts variant, defined in the tests only: what a fork adds to train one.

The dense transformer with its MLP replaced by EXPERTS experts, each token routed to its top
TOP_K (their router probabilities, renormalised, weigh the outputs), a load-balancing loss
(Switch Transformer's: EXPERTS x sum over experts of the fraction of routed tokens x the mean
router probability, 1 when balanced) reported with a weight, the router's entropy reported as a
metric, and the experts split over a mesh axis of its own, `toyexpert` (logical axis
`toy_experts`; a fork's would be `expert` and `experts`).

Every expert runs on every token and the gate zeroes the ones not chosen: no capacity, no
dispatch, so routing is per token and causal (cached decoding equals the full forward pass).

In-process tests call `declare()` and `forget()` around their use (the mesh axis); trainer
processes get it from tests/hooks/sitecustomize.py under TRAINER_TEST_VARIANTS=toy_moe.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from trainer import config as config_module
from trainer import sharding
from trainer.model import aux
from trainer.model.registry import register
from trainer.model.transformer import Block, TransformerLM, _param
from trainer.model.transformer import flops_per_token as dense_flops_per_token

KIND = "toy-moe"
AXIS = "toyexpert"  # not "expert": a fork may have that one
EXPERTS = 4
TOP_K = 2
BALANCE_WEIGHT = 0.01


class MoeMlp(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs):
        d, f, e = cfg.d_model, cfg.d_ff, EXPERTS
        pdt = jnp.dtype(cfg.param_dtype)
        self.router_DxE = _param(rngs, d**-0.5, (d, e), ("embed", None), pdt)
        self.w_in_ExDxF = _param(rngs, d**-0.5, (e, d, f), ("toy_experts", "embed", "mlp"), pdt)
        self.w_out_ExFxD = _param(rngs, (f * 2 * cfg.n_layers) ** -0.5, (e, f, d),
                                  ("toy_experts", "mlp", "embed"), pdt)
        self.dtype = jnp.dtype(cfg.dtype)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        dt = self.dtype
        logits_BxLxE = jnp.einsum("bld,de->ble", x_BxLxD, self.router_DxE[...].astype(dt),
                                  preferred_element_type=jnp.float32)
        probs_BxLxE = jax.nn.softmax(logits_BxLxE, axis=-1)
        top_BxLxK, chosen_BxLxK = jax.lax.top_k(probs_BxLxE, TOP_K)
        routed_BxLxKxE = jax.nn.one_hot(chosen_BxLxK, EXPERTS, dtype=jnp.float32)
        gates_BxLxE = jnp.einsum("blk,blke->ble", top_BxLxK / top_BxLxK.sum(-1, keepdims=True),
                                 routed_BxLxKxE)
        h_BxLxExF = jax.nn.gelu(jnp.einsum("bld,edf->blef", x_BxLxD,
                                           self.w_in_ExDxF[...].astype(dt)))
        h_BxLxExF = sharding.constrain(h_BxLxExF, ("batch", "length", "toy_experts", "mlp"))
        out_BxLxD = jnp.einsum("blef,efd,ble->bld", h_BxLxExF, self.w_out_ExFxD[...].astype(dt),
                               gates_BxLxE.astype(dt))
        routed_E = routed_BxLxKxE.sum(2).mean((0, 1)) / TOP_K
        aux.report("load_balance", EXPERTS * jnp.sum(routed_E * probs_BxLxE.mean((0, 1))),
                   weight=BALANCE_WEIGHT)
        entropy = -jnp.sum(probs_BxLxE * jnp.log(probs_BxLxE + 1e-9), axis=-1).mean()
        aux.report("router_entropy", entropy)
        return out_BxLxD


class MoeBlock(Block):
    mlp_class = MoeMlp


def flops_per_token(cfg) -> int:
    """The dense count with TOP_K experts' MLP per token and the router (the experts not
    chosen compute here too, but a real dispatch would skip them: MFU counts useful work)."""
    mlp = 2 * cfg.d_model * cfg.d_ff
    return int(dense_flops_per_token(cfg) + 6 * cfg.n_layers * ((TOP_K - 1) * mlp
                                                               + cfg.d_model * EXPERTS))


@register(KIND, flops_per_token=flops_per_token)
class ToyMoeLM(TransformerLM):
    block_class = MoeBlock


def declare() -> None:
    """The mesh axis and its rule (a fork writes both into config.py and sharding.py)."""
    config_module.declare_mesh_axis(AXIS)
    sharding.RULES["toy_experts"] = AXIS


def forget() -> None:
    config_module.forget_mesh_axis(AXIS)
    sharding.RULES.pop("toy_experts", None)
