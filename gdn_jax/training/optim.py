"""AdamW with warmup and cosine decay, gradient clipping, and decay on matrices only."""

from __future__ import annotations

import optax
from flax import nnx

from gdn_jax.layers import NoWeightDecay
from gdn_jax.training.config import TrainConfig


def learning_rate_schedule(train: TrainConfig) -> optax.Schedule:
    """Linear warmup to ``learning_rate``, cosine decay to ``learning_rate * final_lr_ratio``
    at ``steps``."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=train.learning_rate,
        warmup_steps=train.warmup_steps,
        decay_steps=train.steps,
        end_value=train.learning_rate * train.final_lr_ratio,
    )


def weight_decay_mask(params: nnx.State) -> dict:
    """True for parameters to decay: matrices (projections, embeddings, conv filters), not
    ``NoWeightDecay`` gates (``A_log``, ``dt_bias``), norm scales or biases (all 1-D)."""
    mask = {}
    for path, variable in nnx.to_flat_state(params):
        node = mask
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = not isinstance(variable, NoWeightDecay) and variable.get_value().ndim >= 2
    return mask


def make_optimizer(train: TrainConfig, params: nnx.State) -> optax.GradientTransformation:
    """The optimizer for ``params`` (an ``nnx.State``), acting on their pure-dict form."""
    return optax.chain(
        optax.clip_by_global_norm(train.grad_clip),
        optax.adamw(
            learning_rate_schedule(train),
            b1=train.adam_b1,
            b2=train.adam_b2,
            weight_decay=train.weight_decay,
            mask=weight_decay_mask(params),
        ),
    )
