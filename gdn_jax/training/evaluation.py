"""Held-out evaluation: a fixed set of the task's examples from the test seed, batched once."""

from __future__ import annotations

import math

import numpy as np

from gdn_jax.data.mqar import make_batch, split_seeds
from gdn_jax.data.tasks import make_examples
from gdn_jax.training import mesh as mesh_lib
from gdn_jax.training.config import Config
from gdn_jax.training.metrics_log import MetricsLog
from gdn_jax.training.state import EvalStep


def held_out_set(config: Config, batch_shardings) -> list[dict]:
    """The fixed held-out batches, from the test seed, batched and placed once."""
    train = config.train
    _, test_seed = split_seeds(train.seed)
    num_batches = math.ceil(train.eval_examples / train.batch_size)
    inputs, labels = make_examples(
        config.data, num_examples=num_batches * train.batch_size, seed=test_seed
    )
    rows = (slice(i * train.batch_size, (i + 1) * train.batch_size) for i in range(num_batches))
    return [mesh_lib.place(make_batch(inputs[r], labels[r]), batch_shardings) for r in rows]


def evaluate(eval_step: EvalStep, params, held_out: list[dict]) -> tuple[float, float]:
    """Mean held-out loss and accuracy of ``params``."""
    losses, accuracies = [], []
    for batch in held_out:
        loss, per_example = eval_step(params, batch)
        losses.append(float(loss))
        accuracies.append(np.asarray(per_example))
    return float(np.mean(losses)), float(np.concatenate(accuracies).mean())


def final_evaluation(log: MetricsLog, step: int, eval_step: EvalStep, params, held_out) -> dict:
    """The held-out loss and accuracy at ``step``: as logged, or evaluated and logged now."""
    logged = [r for r in log.read("eval") if r["step"] == step]
    if logged:
        return dict(eval_loss=logged[-1]["loss"], eval_accuracy=logged[-1]["accuracy"])
    eval_loss, eval_accuracy = evaluate(eval_step, params, held_out)
    log.append("eval", step, loss=eval_loss, accuracy=eval_accuracy, elapsed_s=0.0)
    return dict(eval_loss=eval_loss, eval_accuracy=eval_accuracy)
