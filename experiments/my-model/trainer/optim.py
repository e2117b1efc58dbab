"""AdamW with linear warmup, cosine decay over train.total_steps, and global-norm clipping."""

from __future__ import annotations

import jax
import optax

from .config import Config


def learning_rate_schedule(config: Config) -> optax.Schedule:
    o = config.optim
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=o.learning_rate,
        warmup_steps=o.warmup_steps,
        decay_steps=config.train.total_steps,  # the horizon is config, never --steps
        end_value=o.learning_rate * o.min_lr_ratio,
    )


def _decay_mask(params):
    # No weight decay on norm scales (1-D); every matrix and the embedding decay.
    return jax.tree.map(lambda p: p.ndim > 1, params)


def make_optimizer(config: Config) -> optax.GradientTransformation:
    o = config.optim
    return optax.chain(
        optax.clip_by_global_norm(o.grad_clip_norm),
        optax.adamw(
            learning_rate=learning_rate_schedule(config),
            b1=o.b1,
            b2=o.b2,
            eps=o.eps,
            weight_decay=o.weight_decay,
            mask=_decay_mask,
        ),
    )
