"""Held-out evaluation: a fixed set of the task's examples from the test seed, batched once."""

from __future__ import annotations

import math

import numpy as np

from gdn_jax.data.mqar import make_batch, split_seeds
from gdn_jax.data.tasks import TaskConfig, make_examples
from gdn_jax.training import mesh as mesh_lib
from gdn_jax.training.metrics_log import MetricsLog
from gdn_jax.training.state import EvalStep


def held_out_batches(data: TaskConfig, *, seed: int, examples: int, batch_size: int) -> list[dict]:
    """The fixed held-out batches of task ``data`` on the host (``make_batch``'s arrays):
    ``examples`` (``train.eval_examples``) rounded up to whole batches of ``batch_size``,
    from the test seed of ``seed`` (``train.seed``, ``split_seeds``)."""
    _, test_seed = split_seeds(seed)
    num_batches = math.ceil(examples / batch_size)
    inputs, labels = make_examples(data, num_examples=num_batches * batch_size, seed=test_seed)
    rows = (slice(i * batch_size, (i + 1) * batch_size) for i in range(num_batches))
    return [make_batch(inputs[r], labels[r]) for r in rows]


def held_out_set(
    data: TaskConfig, *, seed: int, examples: int, batch_size: int, batch_shardings
) -> list[dict]:
    """``held_out_batches``, placed once by ``batch_shardings``."""
    batches = held_out_batches(data, seed=seed, examples=examples, batch_size=batch_size)
    return [mesh_lib.place(batch, batch_shardings) for batch in batches]


def evaluate(eval_step: EvalStep, params, held_out: list[dict]) -> tuple[float, float]:
    """Mean held-out loss and accuracy of ``params``."""
    loss, accuracy = evaluate_runs(eval_step, params, held_out)
    return float(loss), float(accuracy)


def evaluate_runs(eval_step, params, held_out: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """``evaluate`` of each run where ``params`` and the batches have a leading run axis R
    (``eval_step`` then returns a loss ``[R]`` and accuracies ``[R, B]``): the mean loss and
    accuracy ``[R]``; without one, the same as 0-d arrays."""
    losses, accuracies = [], []
    for batch in held_out:
        loss, per_example = eval_step(params, batch)
        losses.append(np.asarray(loss, np.float64))
        accuracies.append(np.asarray(per_example))
    loss, accuracy = np.mean(losses, axis=0), np.concatenate(accuracies, axis=-1).mean(axis=-1)
    return np.asarray(loss), np.asarray(accuracy)


def final_evaluation(log: MetricsLog, step: int, eval_step: EvalStep, params, held_out) -> dict:
    """The held-out loss and accuracy at ``step``: as logged, or evaluated and logged now."""
    logged = [r for r in log.read("eval") if r["step"] == step]
    if logged:
        return dict(eval_loss=logged[-1]["loss"], eval_accuracy=logged[-1]["accuracy"])
    eval_loss, eval_accuracy = evaluate(eval_step, params, held_out)
    log.append("eval", step, loss=eval_loss, accuracy=eval_accuracy, elapsed_s=0.0)
    return dict(eval_loss=eval_loss, eval_accuracy=eval_accuracy)
