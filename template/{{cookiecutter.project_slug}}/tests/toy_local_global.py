"""The README's second worked example, defined in the tests only: a variant whose layers differ
by depth and whose head adds a loss term, written with the model's seams and nothing else.

Layers alternate local attention (each position sees the last `window` positions) and global
attention: a unit of two layers (`layers_per_unit = 2`), the block at position 0 of each unit
local. The head caps the logits (`logit_cap * tanh(logits / logit_cap)`) and reports a z-loss,
the squared log of the softmax normaliser, as a weighted auxiliary loss. Its three settings
live in the preset's [model.settings]. No other file changes: the loss, the pipeline, decoding,
the checks and the planner ask the variant.

In-process tests import it (it registers itself); trainer processes get it from
tests/hooks/sitecustomize.py under TRAINER_TEST_VARIANTS=toy_local_global.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from trainer.model import aux
from trainer.model.attention import masked
from trainer.model.registry import register, settings
from trainer.model.transformer import Attention, Block, TransformerLM

KIND = "toy-local-global"


class WindowedAttention(Attention):
    window = 0  # 0: every earlier position (global); else the last `window` positions

    def _visible(self, queries_L: jax.Array, keys_M: jax.Array) -> jax.Array:
        seen_LxM = keys_M[None, :] <= queries_L[:, None]
        if self.window:
            seen_LxM &= queries_L[:, None] - keys_M[None, :] < self.window
        return seen_LxM

    def __call__(self, x_BxLxD):
        q_BxLxHxK, k_BxLxGxK, v_BxLxGxK = self._project(x_BxLxD)
        positions_L = jnp.arange(x_BxLxD.shape[1])
        return self._output(masked(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK,
                                   self._visible(positions_L, positions_L)))

    def decode(self, x_BxSxD, start, cache):
        positions_S = start + jnp.arange(x_BxSxD.shape[1])
        q_BxSxHxK, k_BxSxGxK, v_BxSxGxK = self._project(x_BxSxD, positions_S)
        cache = cache.write(start, k_BxSxGxK, v_BxSxGxK)
        visible_SxT = self._visible(positions_S, jnp.arange(cache.k.shape[1]))
        return self._output(masked(q_BxSxHxK, cache.k, cache.v, visible_SxT)), cache


class LocalGlobalBlock(Block):
    attention_class = WindowedAttention

    def __init__(self, cfg, *, rngs, position=0):
        super().__init__(cfg, rngs=rngs, position=position)
        if position == 0:  # the first layer of every unit attends locally
            self.attn.window = settings(cfg)["window"]


@register(KIND, settings={"window": 8, "logit_cap": 30.0, "z_loss": 1e-4})
class LocalGlobalLM(TransformerLM):
    block_class = LocalGlobalBlock
    layers_per_unit = 2

    def __init__(self, cfg, *, rngs):
        super().__init__(cfg, rngs=rngs)
        own = settings(cfg)
        self.logit_cap, self.z_loss = own["logit_cap"], own["z_loss"]

    def head(self, params, x_BxCxD):
        logits_BxCxV = super().head(params, x_BxCxD)
        capped_BxCxV = self.logit_cap * jnp.tanh(logits_BxCxV / self.logit_cap)
        log_z_BxC = jax.nn.logsumexp(capped_BxCxV, axis=-1)
        aux.report("z_loss", jnp.mean(log_z_BxC**2), weight=self.z_loss)
        return capped_BxCxV


def declare() -> None:
    """Nothing to declare: no mesh axis of its own (tests/hooks/sitecustomize.py calls it)."""


def forget() -> None:
    """Nothing to forget."""
