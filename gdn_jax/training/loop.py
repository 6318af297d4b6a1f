"""The MQAR training run: data stream, sharded jitted steps, evaluation, checkpoints, logs.

``run`` reads as the story of a run: check everything, claim the run directory, build the
state, restore or start, then the step loop. Nothing is written before every check has
passed, and a run directory belongs to one run (``run_dir.py``).
"""

from __future__ import annotations

import contextlib
import math
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from gdn_jax.data.mqar import make_batch, make_mqar, split_seeds
from gdn_jax.models import LanguageModel
from gdn_jax.training import mesh as mesh_lib
from gdn_jax.training import run_dir
from gdn_jax.training.config import Config, to_dict
from gdn_jax.training.files import write_whole
from gdn_jax.training.metrics_log import MetricsLog
from gdn_jax.training.optim import learning_rate_schedule, make_optimizer
from gdn_jax.training.run_dir import RunError
from gdn_jax.training.step import TrainState, make_eval_step, make_train_step


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or Inf; the last good checkpoint is kept."""


class SaveError(RuntimeError):
    """A checkpoint could not be written (a full disk, say); the earlier ones are kept."""


class OutOfMemory(RuntimeError):
    """Building, compiling or running the model ran out of memory (host or device)."""

    def __init__(self, config: Config, error: BaseException):
        model, data, train = config.model, config.data, config.train
        reason = str(error).splitlines()[0][:120] if str(error) else type(error).__name__
        super().__init__(
            f"out of memory ({reason}) with model.d_model={model.d_model}, "
            f"{len(model.mixers)} layers, data.seq_len={data.seq_len}, "
            f"train.batch_size={train.batch_size}, train.eval_examples={train.eval_examples}; "
            "shrink model.d_model, model.mixers, data.seq_len, train.batch_size or "
            "train.eval_examples"
        )


def _is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, MemoryError) or (
        isinstance(error, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(error)
    )


class Interrupted(RuntimeError):
    """SIGINT or SIGTERM stopped the run after a checkpoint at the current step."""

    def __init__(self, signum: int, step: int, out_dir: Path):
        self.signum, self.step, self.out_dir = signum, step, out_dir
        name = signal.Signals(signum).name
        super().__init__(f"{name} at step {step}; checkpoint saved in {out_dir}")


def batch_seed(train_seed: int, step: int) -> int:
    """The data seed of one step: batches depend on (seed, step) alone, so a resumed run
    sees exactly the batches an uninterrupted one would."""
    return int(np.random.SeedSequence([train_seed, step]).generate_state(1)[0])


def plot_metrics(log: MetricsLog, out_path: Path) -> None:
    """Training loss, training and held-out accuracy against step, as a PNG; written whole
    or not at all (a full disk leaves no empty or partial file)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, evals = log.read("train"), log.read("eval")
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.5))
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], lw=0.8)
    ax_loss.set(xlabel="step", ylabel="train loss", yscale="log")
    ax_acc.plot([r["step"] for r in train], [r["accuracy"] for r in train], lw=0.8, label="train")
    ax_acc.plot([r["step"] for r in evals], [r["accuracy"] for r in evals], "o-", label="held-out")
    ax_acc.set(xlabel="step", ylabel="accuracy", ylim=(0, 1.02))
    ax_acc.legend(loc="lower right")
    fig.tight_layout()
    try:
        write_whole(out_path, lambda partial: fig.savefig(partial, dpi=120, format="png"))
    finally:
        plt.close(fig)


def _plot_or_warn(log: MetricsLog, out_path: Path) -> None:
    """The plot at the end of a run, however it ends: a failure is a warning, so that it
    cannot hide the error that ended the run."""
    try:
        plot_metrics(log, out_path)
    except Exception as error:
        print(f"warning: could not plot {out_path} ({error})", file=sys.stderr)


def _is_primary() -> bool:
    return jax.process_index() == 0


def _sync(name: str) -> None:
    """Wait for every process (nothing to wait for in a one-process run)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def check_devices(config: Config, devices=None) -> Mesh:
    """The run's mesh over ``devices`` (every device of every process when None):
    ``train.mesh`` must fit them, and the batch, tokens and heads must split over its axes."""
    return mesh_lib.check_mesh(config, jax.devices() if devices is None else devices)


def claim_run_dir(config: Config, *, resume: bool, overwrite: bool) -> run_dir.RunLock:
    """Check ``out_dir`` against ``resume``/``overwrite`` and lock it; returns the held lock.

    Raises ``RunError`` before anything is written when the run must not start. With
    ``overwrite`` the earlier run's files are deleted (and named on stderr).
    """
    if resume and overwrite:
        raise RunError("--resume and --overwrite contradict each other; choose one")
    out_dir = Path(config.train.out_dir).absolute()
    run_dir.check_writable(out_dir)
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    lock = run_dir.RunLock(out_dir)
    try:
        lock.acquire()
        try:
            _check_run_dir(config, out_dir, resume=resume, overwrite=overwrite)
        except BaseException:
            lock.release()
            raise
    except BaseException:
        if created:  # leave no empty directory behind a refused run
            out_dir.rmdir()
        raise
    if lock.took_over:
        print(f"took over the stale lock of a run that died in {out_dir}", file=sys.stderr)
    return lock


def _check_run_dir(config: Config, out_dir: Path, *, resume: bool, overwrite: bool) -> None:
    earlier = run_dir.earlier_run(out_dir)
    stranded = bool(earlier) and run_dir.died_before_first_save(out_dir)
    if resume:
        _check_resumable(config, out_dir, earlier, stranded)
        return
    if stranded:
        print(
            f"replacing the run in {out_dir} that died before its first checkpoint "
            f"(deleted {', '.join(run_dir.clear(out_dir))})",
            file=sys.stderr,
        )
    elif earlier and not overwrite:
        resumable = run_dir.checkpoint_steps(out_dir)
        raise RunError(
            f"{out_dir} holds an earlier run ({', '.join(earlier)}); "
            + ("continue it with --resume or " if resumable else "it has no checkpoint; ")
            + "delete it with --overwrite"
        )
    elif earlier:
        print(
            f"--overwrite: deleted {', '.join(run_dir.clear(out_dir))} in {out_dir}",
            file=sys.stderr,
        )


def _check_resumable(config: Config, out_dir: Path, earlier: list[str], stranded: bool) -> None:
    """``--resume`` needs a checkpoint, a readable ``config.yaml`` that matches ``config``
    but for ``RESUMABLE_FIELDS``, and a readable ``metrics.jsonl``; nothing is written."""
    if not run_dir.checkpoint_steps(out_dir):
        if stranded:
            why = "its run died before its first checkpoint"
        elif earlier:
            why = f"it holds {', '.join(earlier)} but no checkpoint"
        else:
            why = "it holds no run"
        raise run_dir.NothingToResume(
            f"--resume: nothing to resume in {out_dir} ({why})",
            overwrite=bool(earlier) and not stranded,
        )
    differences = run_dir.resume_differences(run_dir.read_config(out_dir), to_dict(config))
    if differences:
        raise RunError(
            f"--resume would continue {out_dir} with a different setup "
            f"({'; '.join(differences)}); only {', '.join(run_dir.RESUMABLE_FIELDS)} may "
            "change"
        )
    MetricsLog(out_dir / run_dir.METRICS).read()


def _finished_summary(config: Config, out_dir: Path) -> dict | None:
    """With ``--resume``: the summary of a run with nothing left to do under ``config``, or
    None when it goes on. A run cannot go on to a ``train.steps`` below its newest checkpoint.
    """
    summary = run_dir.read_summary(out_dir)
    if run_dir.is_finished(summary, config.train.steps, config.train.target_accuracy):
        return dict(summary, already_finished=True)
    newest = max(run_dir.checkpoint_steps(out_dir), default=0)
    if config.train.steps < newest:
        raise RunError(
            f"--resume: train.steps={config.train.steps} is below step {newest} of the newest "
            f"checkpoint in {out_dir}; give train.steps >= {newest}"
        )
    return None


@dataclass
class RunState:
    """What the step loop needs: the jitted steps, shardings, state and where to write."""

    config: Config
    out_dir: Path
    log: MetricsLog
    checkpoints: ocp.CheckpointManager
    state: TrainState
    train_step: object
    eval_step: object
    batch_shardings: dict


def _on_mesh(mesh: Mesh, fn):
    """``fn`` called with ``mesh`` in context, so that the layers see its ``seq`` axis while
    ``jax.jit`` traces them."""

    def call(*args):
        with jax.set_mesh(mesh):
            return fn(*args)

    return call


@dataclass
class Steps:
    """The jitted steps of a run on its mesh and the shardings of what they take."""

    train_step: jax.stages.Wrapped  # (TrainState, batch) -> (TrainState, metrics); donates
    eval_step: jax.stages.Wrapped  # (params, batch) -> (loss, per-example accuracy)
    state_shardings: TrainState
    batch_shardings: dict


def jit_steps(config: Config, mesh: Mesh, graphdef, params: nnx.State, optimizer) -> Steps:
    """The train and eval steps of ``config`` jitted for ``mesh``: the batch placed by
    ``batch_shardings``, parameters and optimizer state by the layers' partitioning metadata
    (whole on every device when the mesh has only a data axis). ``params`` may be abstract
    (``nnx.eval_shape``); call the steps with ``mesh`` set (``jax.set_mesh``)."""
    train = config.train
    replicated = NamedSharding(mesh, P())
    param_shardings = mesh_lib.param_shardings(mesh, params)
    opt_state = jax.eval_shape(optimizer.init, nnx.to_pure_dict(params))
    state_shardings = TrainState(
        replicated,
        param_shardings,
        mesh_lib.opt_state_shardings(mesh, optimizer, opt_state, param_shardings),
    )
    batch_shardings = mesh_lib.batch_shardings(mesh)
    schedule = learning_rate_schedule(train)
    train_step = jax.jit(
        make_train_step(graphdef, optimizer, schedule, logits_at_labels=train.logits_at_labels),
        in_shardings=(state_shardings, batch_shardings),
        out_shardings=(state_shardings, replicated),
        donate_argnums=0,
    )
    eval_step = jax.jit(
        make_eval_step(graphdef, logits_at_labels=train.logits_at_labels),
        in_shardings=(state_shardings.params, batch_shardings),
        out_shardings=replicated,  # every process reads the whole per-example accuracy
    )
    return Steps(train_step, eval_step, state_shardings, batch_shardings)


def _init_state(config: Config, mesh: Mesh, out_dir: Path) -> RunState:
    """Model, optimizer, jitted steps (``jit_steps``) and the checkpoint manager, with the
    state placed on ``mesh``."""
    train = config.train
    model = LanguageModel(config.model, rngs=nnx.Rngs(train.seed))
    graphdef, params = nnx.split(model)
    optimizer = make_optimizer(train, params)
    steps = jit_steps(config, mesh, graphdef, params, optimizer)
    pure = nnx.to_pure_dict(params)
    state = TrainState(jnp.zeros((), jnp.int32), pure, optimizer.init(pure))
    checkpoints = ocp.CheckpointManager(
        out_dir / run_dir.CHECKPOINTS,
        options=ocp.CheckpointManagerOptions(max_to_keep=train.keep_checkpoints, create=True),
        item_handlers=ocp.StandardCheckpointHandler(),  # so that item_metadata reads shapes
    )
    return RunState(
        config,
        out_dir,
        MetricsLog(out_dir / run_dir.METRICS, writes=_is_primary()),
        checkpoints,
        jax.device_put(state, steps.state_shardings),
        _on_mesh(mesh, steps.train_step),
        _on_mesh(mesh, steps.eval_step),
        steps.batch_shardings,
    )


def _check_shapes(run: RunState, step: int) -> None:
    """Raise ``RunError`` when checkpoint ``step`` holds parameters of other names or shapes
    than ``run.config`` builds: a different model, not a damaged checkpoint. A checkpoint
    whose metadata cannot be read raises something else (damage)."""
    there = _shapes(run.checkpoints.item_metadata(step)["params"])
    here = _shapes(run.state.params)
    for name in sorted(set(there) | set(here)):
        if there.get(name) != here.get(name):
            raise RunError(
                f"--resume: checkpoint step {step} in {run.out_dir / run_dir.CHECKPOINTS} is "
                f"of another model than the config: params {name} is "
                f"{there.get(name, '(absent)')} there and {here.get(name, '(absent)')} here; "
                f"{run_dir.CONFIG} does not describe these checkpoints"
            )


def _shapes(tree) -> dict[str, tuple]:
    """``{'blocks.0.mixer.q_proj.kernel': (16, 16), ...}`` of arrays or their metadata."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(k, simple=True, separator="."): tuple(v.shape) for k, v in leaves}


def _restore_or_start(run: RunState, resume: bool) -> int:
    """Restore the newest checkpoint that restores (with ``resume``) and return its step;
    a checkpoint that fails is moved aside to ``broken_checkpoints/`` with a warning, and
    one of another model stops the resume (``_check_shapes``)."""
    primary = _is_primary()
    if not resume:
        if primary:
            run_dir.write_config(run.out_dir, to_dict(run.config))
        return 0
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), run.state
    )
    for step in sorted(run.checkpoints.all_steps(), reverse=True):
        try:
            _check_shapes(run, step)
            run.state = run.checkpoints.restore(step, args=ocp.args.StandardRestore(abstract))
        except Exception as error:  # any other failure to restore means: not this one
            if isinstance(error, RunError) or _is_out_of_memory(error):
                raise
            aside = run.out_dir / "broken_checkpoints" / str(step)
            if primary:
                aside.parent.mkdir(exist_ok=True)
                (run.out_dir / run_dir.CHECKPOINTS / str(step)).rename(aside)
            _sync("broken checkpoint moved aside")
            run.checkpoints.reload()
            reason = str(error).splitlines()[0][:120] if str(error) else type(error).__name__
            print(
                f"warning: checkpoint step {step} does not restore ({reason}); moved it to "
                f"{aside} and trying the one before",
                file=sys.stderr,
            )
            continue
        if primary and run.log.torn_tail():
            print(
                f"warning: dropping the torn last line of {run.log.path} (a crash mid-write); "
                f"the checkpoint at step {step} is where the run resumes",
                file=sys.stderr,
            )
        run.log.truncate(step)
        if primary:
            (run.out_dir / run_dir.SUMMARY).unlink(missing_ok=True)  # the run goes on
            run_dir.write_config(run.out_dir, to_dict(run.config))
        return step
    raise RunError(f"--resume: no checkpoint in {run.out_dir / run_dir.CHECKPOINTS} restores")


def _held_out_set(config: Config, batch_shardings) -> list[dict]:
    """The fixed held-out batches, from the test seed, batched and placed once."""
    train = config.train
    _, test_seed = split_seeds(train.seed)
    num_batches = math.ceil(train.eval_examples / train.batch_size)
    inputs, labels = make_mqar(
        config.data, num_examples=num_batches * train.batch_size, seed=test_seed
    )
    rows = (slice(i * train.batch_size, (i + 1) * train.batch_size) for i in range(num_batches))
    return [mesh_lib.place(make_batch(inputs[r], labels[r]), batch_shardings) for r in rows]


def _evaluate(run: RunState, held_out: list[dict]) -> tuple[float, float]:
    losses, accuracies = [], []
    for batch in held_out:
        loss, per_example = run.eval_step(run.state.params, batch)
        losses.append(float(loss))
        accuracies.append(np.asarray(per_example))
    return float(np.mean(losses)), float(np.concatenate(accuracies).mean())


def _final_evaluation(run: RunState, step: int, held_out) -> dict:
    """The held-out loss and accuracy at ``step``: as logged, or evaluated and logged now."""
    logged = [r for r in run.log.read("eval") if r["step"] == step]
    if logged:
        return dict(eval_loss=logged[-1]["loss"], eval_accuracy=logged[-1]["accuracy"])
    eval_loss, eval_accuracy = _evaluate(run, held_out)
    run.log.append("eval", step, loss=eval_loss, accuracy=eval_accuracy, elapsed_s=0.0)
    return dict(eval_loss=eval_loss, eval_accuracy=eval_accuracy)


def _save(run: RunState, step: int) -> None:
    """Save and wait: a save that fails stops the run here, not some steps later."""
    try:
        if step not in run.checkpoints.all_steps():
            run.checkpoints.save(step, args=ocp.args.StandardSave(run.state))
        run.checkpoints.wait_until_finished()
    except Exception as error:
        latest = run.checkpoints.latest_step()
        kept = f"step {latest} is the latest kept" if latest is not None else "none was saved"
        raise SaveError(
            f"could not save checkpoint step {step} in {run.out_dir / run_dir.CHECKPOINTS} "
            f"({error}); {kept}"
        ) from error


@contextlib.contextmanager
def _stop_requests():
    """Turn SIGINT and SIGTERM into a request the loop sees after its current step."""
    requested = []
    if threading.current_thread() is not threading.main_thread():
        yield requested
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for signum in previous:
        signal.signal(signum, lambda signum, frame: requested.append(signum))
    try:
        yield requested
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _step_loop(run: RunState, start: int, held_out, callbacks, stop_requests) -> dict:
    """Train from ``start`` until the step budget, the target accuracy or a stop request."""
    config, train = run.config, run.config.train
    train_seed, _ = split_seeds(train.seed)
    tokens_per_step = train.batch_size * config.data.seq_len
    show = train.progress and _is_primary()
    bar = tqdm(total=train.steps, initial=start, disable=not show, unit="step")
    summary = dict(start_step=start, eval_accuracy=None, eval_loss=None, reason="steps")
    began = time.perf_counter()
    step = start
    if start == train.steps:  # stopped after its last checkpoint, before its summary
        summary.update(_final_evaluation(run, start, held_out))
    try:
        while step < train.steps:
            inputs, labels = make_mqar(
                config.data, num_examples=train.batch_size, seed=batch_seed(train_seed, step)
            )
            batch = mesh_lib.place(make_batch(inputs, labels), run.batch_shardings)
            tick = time.perf_counter()
            run.state, metrics = run.train_step(run.state, batch)
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            step += 1
            if not math.isfinite(metrics["loss"]):
                latest = run.checkpoints.latest_step()
                kept = (
                    "no checkpoint was saved yet"
                    if latest is None
                    else (
                        f"the last good checkpoint is step {latest} in "
                        f"{run.out_dir / run_dir.CHECKPOINTS}"
                    )
                )
                raise NonFiniteLossError(f"loss is {metrics['loss']} at step {step}; {kept}")
            metrics["tokens_per_s"] = tokens_per_step / (time.perf_counter() - tick)
            run.log.append("train", step, **metrics)
            for callback in callbacks:
                callback(step, metrics)

            done = step == train.steps
            if step % train.eval_every == 0 or done:
                eval_loss, eval_accuracy = _evaluate(run, held_out)
                summary.update(eval_accuracy=eval_accuracy, eval_loss=eval_loss)
                run.log.append(
                    "eval",
                    step,
                    loss=eval_loss,
                    accuracy=eval_accuracy,
                    elapsed_s=time.perf_counter() - began,
                )
                target = train.target_accuracy
                if target is not None and eval_accuracy >= target and not done:
                    done, summary["reason"] = True, "target"
            if step % train.checkpoint_every == 0 or done:
                _save(run, step)
            bar.update(1)
            bar.set_postfix(
                loss=f"{metrics['loss']:.3f}",
                acc=f"{metrics['accuracy']:.3f}",
                eval=f"{summary['eval_accuracy'] or 0:.3f}",
                tok_s=f"{metrics['tokens_per_s']:.0f}",
            )
            if done:
                break
            if stop_requests:
                _save(run, step)
                raise Interrupted(stop_requests[0], step, run.out_dir)
    finally:
        bar.close()
    summary.update(final_step=step, wall_s=time.perf_counter() - began)
    return summary


def run(
    config: Config,
    *,
    resume: bool = False,
    overwrite: bool = False,
    callbacks=(),
    devices=None,
) -> dict:
    """Train ``config`` and return a summary (final step, held-out accuracy, wall time).

    Args:
      config: a validated ``Config``.
      resume: continue from the newest checkpoint in ``config.train.out_dir`` that restores;
        refused when the model, data or seed differ from the saved config.yaml (see
        ``run_dir.RESUMABLE_FIELDS``). A run that has already ended returns its summary.
      overwrite: delete an earlier run in ``out_dir`` first (a fresh run refuses otherwise).
      callbacks: functions ``callback(step, metrics)`` called after every step with the
        host-side metrics (a dict of floats).
      devices: the devices ``train.mesh`` arranges; all of them (``jax.devices()``) when None.

    Raises:
      RunError: the run must not start (checked before anything is written).
      NonFiniteLossError: a step's loss is NaN or Inf; no checkpoint is written after the
        last finite step.
      SaveError: a checkpoint could not be written; the earlier ones are kept.
      OutOfMemory: the model, a batch or the held-out set does not fit in memory.
      Interrupted: SIGINT or SIGTERM arrived; a checkpoint at the current step was saved.
    """
    mesh = check_devices(config, devices)
    # With several processes, process 0 alone owns the run directory (lock, config, metrics,
    # plot, summary); every process writes its shards of each checkpoint.
    primary = _is_primary()
    lock = claim_run_dir(config, resume=resume, overwrite=overwrite) if primary else None
    _sync("run directory claimed")
    out_dir = Path(config.train.out_dir).absolute() if lock is None else lock.path.parent
    try:
        finished = _finished_summary(config, out_dir) if resume else None
        if finished is not None:
            return finished
        try:
            return _train(config, mesh, out_dir, resume, callbacks)
        except Exception as error:
            if _is_out_of_memory(error):
                raise OutOfMemory(config, error) from error
            raise
    finally:
        if lock is not None:
            lock.release()


def _train(config: Config, mesh: Mesh, out_dir: Path, resume: bool, callbacks) -> dict:
    """Build the state, restore or start, run the steps; the plot whatever happens."""
    primary = _is_primary()
    state = _init_state(config, mesh, out_dir)
    try:
        start = _restore_or_start(state, resume)
        held_out = _held_out_set(config, state.batch_shardings)
        with _stop_requests() as stop_requests:
            try:
                summary = _step_loop(state, start, held_out, callbacks, stop_requests)
            finally:
                if primary and state.log.path.exists():
                    _plot_or_warn(state.log, out_dir / run_dir.PLOT)
        if primary:
            run_dir.write_summary(out_dir, summary)
        return summary
    finally:
        state.checkpoints.close()
