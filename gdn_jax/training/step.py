"""The pure training and evaluation steps."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from gdn_jax.data.mqar import IGNORE_INDEX


class TrainState(NamedTuple):
    """Everything that changes during training (a pytree): the step, the parameters as a
    pure dict (``nnx.to_pure_dict(nnx.split(model)[1])``) and the optimizer state."""

    step: jax.Array
    params: dict
    opt_state: optax.OptState


def loss_and_accuracy(model, batch: dict, *, logits_at_labels: bool):
    """Mean cross-entropy over labelled positions and per-example accuracy ``[B]``.

    With ``logits_at_labels`` the LM head runs only at the ``n`` labelled positions of each
    example instead of all ``T``: for MQAR at T=256, n=16 and an 8192-token vocabulary the
    head is most of the model's arithmetic, and this cuts it 16-fold.
    """
    if logits_at_labels:
        hidden = model.hidden(batch["inputs"])
        hidden = jnp.take_along_axis(hidden, batch["positions"][..., None], axis=1)
        logits = model.logits(hidden).astype(jnp.float32)
        targets = batch["targets"]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        correct = jnp.argmax(logits, axis=-1).astype(targets.dtype) == targets
        return jnp.mean(ce), jnp.mean(correct, axis=1, dtype=jnp.float32)
    logits = model(batch["inputs"]).astype(jnp.float32)
    labels = batch["labels"]
    valid = labels != IGNORE_INDEX
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(valid, labels, 0))
    correct = (jnp.argmax(logits, axis=-1).astype(labels.dtype) == labels) & valid
    count = jnp.sum(valid, axis=1, dtype=jnp.float32)
    per_example = jnp.sum(correct, axis=1, dtype=jnp.float32) / count
    return jnp.sum(jnp.where(valid, ce, 0.0)) / jnp.sum(count), per_example


def make_train_step(graphdef, optimizer, schedule, *, logits_at_labels: bool):
    """``train_step(state, batch) -> (state, metrics)``, pure; jit it once."""

    def train_step(state: TrainState, batch: dict):
        def loss_fn(params):
            model = nnx.merge(graphdef, params)
            loss, per_example = loss_and_accuracy(model, batch, logits_at_labels=logits_at_labels)
            return loss, jnp.mean(per_example)

        (loss, accuracy), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(
            loss=loss,
            accuracy=accuracy,
            grad_norm=optax.tree.norm(grads),
            learning_rate=schedule(state.step),
        )
        return TrainState(state.step + 1, params, opt_state), metrics

    return train_step


def make_eval_step(graphdef, *, logits_at_labels: bool):
    """``eval_step(params, batch) -> (loss, per_example_accuracy [B])``."""

    def eval_step(params, batch):
        model = nnx.merge(graphdef, params)
        return loss_and_accuracy(model, batch, logits_at_labels=logits_at_labels)

    return eval_step
