"""The MQAR training run: data stream, sharded jitted steps, evaluation, checkpoints, logs."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import yaml
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from gdn_jax.data.mqar import make_mqar, split_seeds
from gdn_jax.models import LanguageModel
from gdn_jax.training.config import Config, to_dict
from gdn_jax.training.optim import learning_rate_schedule, make_optimizer
from gdn_jax.training.step import TrainState, make_batch, make_eval_step, make_train_step


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or Inf; the last good checkpoint is kept."""


def batch_seed(train_seed: int, step: int) -> int:
    """The data seed of one step: batches depend on (seed, step) alone, so a resumed run
    sees exactly the batches an uninterrupted one would."""
    return int(np.random.SeedSequence([train_seed, step]).generate_state(1)[0])


def _append_jsonl(path: Path, record: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def _truncate_jsonl(path: Path, last_step: int) -> None:
    """Drop records after ``last_step``: a resumed run rewrites them."""
    if path.exists():
        kept = [
            line for line in path.read_text().splitlines() if json.loads(line)["step"] <= last_step
        ]
        path.write_text("".join(line + "\n" for line in kept))


def plot_metrics(metrics_path: Path, out_path: Path) -> None:
    """Training loss, training and held-out accuracy against step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.5))
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], lw=0.8)
    ax_loss.set(xlabel="step", ylabel="train loss", yscale="log")
    ax_acc.plot([r["step"] for r in train], [r["accuracy"] for r in train], lw=0.8, label="train")
    ax_acc.plot([r["step"] for r in evals], [r["accuracy"] for r in evals], "o-", label="held-out")
    ax_acc.set(xlabel="step", ylabel="accuracy", ylim=(0, 1.02))
    ax_acc.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)


def run(config: Config, *, resume: bool = False, callbacks=()) -> dict:
    """Train ``config`` and return a summary (final step, held-out accuracy, wall time).

    Args:
      config: a validated ``Config``.
      resume: continue from the latest checkpoint in ``config.train.out_dir``.
      callbacks: functions ``callback(step, metrics)`` called after every step with the
        host-side metrics (a dict of floats).

    Raises:
      NonFiniteLossError: when a step's loss is NaN or Inf; no checkpoint is written after
        the last finite step.
    """
    train = config.train
    out_dir = Path(train.out_dir).absolute()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
    metrics_path = out_dir / "metrics.jsonl"

    devices = jax.devices()
    if train.batch_size % len(devices):
        raise ValueError(
            f"train.batch_size={train.batch_size} must divide by the {len(devices)} devices"
        )
    mesh = Mesh(np.array(devices), ("data",))
    replicated, by_example = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    model = LanguageModel(config.model, rngs=nnx.Rngs(train.seed))
    graphdef, params = nnx.split(model)
    optimizer = make_optimizer(train, params)
    pure = nnx.to_pure_dict(params)
    state = TrainState(jnp.zeros((), jnp.int32), pure, optimizer.init(pure))
    state = jax.device_put(state, replicated)

    checkpoints = ocp.CheckpointManager(
        out_dir / "checkpoints",
        options=ocp.CheckpointManagerOptions(max_to_keep=train.keep_checkpoints, create=True),
    )
    start = 0
    if resume and checkpoints.latest_step() is not None:
        start = checkpoints.latest_step()
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), state
        )
        state = checkpoints.restore(start, args=ocp.args.StandardRestore(abstract))
        _truncate_jsonl(metrics_path, start)
    else:  # a fresh run replaces what an earlier one left, or --resume would mix the two
        for step in checkpoints.all_steps():
            checkpoints.delete(step)
        metrics_path.unlink(missing_ok=True)

    schedule = learning_rate_schedule(train)
    train_step = jax.jit(
        make_train_step(graphdef, optimizer, schedule, logits_at_labels=train.logits_at_labels),
        in_shardings=(replicated, by_example),
        out_shardings=(replicated, replicated),
        donate_argnums=0,
    )
    eval_step = jax.jit(
        make_eval_step(graphdef, logits_at_labels=train.logits_at_labels),
        in_shardings=(replicated, by_example),
    )

    train_seed, test_seed = split_seeds(train.seed)
    eval_batches = math.ceil(train.eval_examples / train.batch_size)
    eval_inputs, eval_labels = make_mqar(
        config.data, num_examples=eval_batches * train.batch_size, seed=test_seed
    )

    # The held-out set is fixed: batch and place it once, not at every evaluation.
    eval_set = [
        jax.device_put(make_batch(eval_inputs[rows], eval_labels[rows]), by_example)
        for rows in (
            slice(i * train.batch_size, (i + 1) * train.batch_size) for i in range(eval_batches)
        )
    ]

    def evaluate(params):
        losses, accuracies = [], []
        for batch in eval_set:
            loss, per_example = eval_step(params, batch)
            losses.append(float(loss))
            accuracies.append(np.asarray(per_example))
        return float(np.mean(losses)), float(np.concatenate(accuracies).mean())

    def save(step):
        checkpoints.save(step, args=ocp.args.StandardSave(state))

    tokens_per_step = train.batch_size * config.data.seq_len
    bar = tqdm(total=train.steps, initial=start, disable=not train.progress, unit="step")
    summary = dict(start_step=start, eval_accuracy=None, eval_loss=None)
    began = time.perf_counter()
    step = start
    try:
        while step < train.steps:
            inputs, labels = make_mqar(
                config.data, num_examples=train.batch_size, seed=batch_seed(train_seed, step)
            )
            batch = jax.device_put(make_batch(inputs, labels), by_example)
            tick = time.perf_counter()
            state, metrics = train_step(state, batch)
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            step += 1
            if not math.isfinite(metrics["loss"]):
                raise NonFiniteLossError(
                    f"loss is {metrics['loss']} at step {step}; stopping. The last good "
                    f"checkpoint is step {checkpoints.latest_step()} in {out_dir / 'checkpoints'}"
                )
            metrics["tokens_per_s"] = tokens_per_step / (time.perf_counter() - tick)
            _append_jsonl(metrics_path, dict(kind="train", step=step, **metrics))
            for callback in callbacks:
                callback(step, metrics)

            done = step == train.steps
            if step % train.eval_every == 0 or done:
                eval_loss, eval_accuracy = evaluate(state.params)
                summary.update(eval_accuracy=eval_accuracy, eval_loss=eval_loss)
                _append_jsonl(
                    metrics_path,
                    dict(kind="eval", step=step, loss=eval_loss, accuracy=eval_accuracy,
                         elapsed_s=time.perf_counter() - began),
                )  # fmt: skip
                target = train.target_accuracy
                done = done or (target is not None and eval_accuracy >= target)
            if step % train.checkpoint_every == 0 or done:
                save(step)
            bar.update(1)
            bar.set_postfix(
                loss=f"{metrics['loss']:.3f}", acc=f"{metrics['accuracy']:.3f}",
                eval=f"{summary['eval_accuracy'] or 0:.3f}",
                tok_s=f"{metrics['tokens_per_s']:.0f}",
            )  # fmt: skip
            if done:
                break
    finally:
        bar.close()
        checkpoints.wait_until_finished()
        checkpoints.close()
    summary.update(final_step=step, wall_s=time.perf_counter() - began)
    if metrics_path.exists():
        plot_metrics(metrics_path, out_dir / "curves.png")
    return summary
