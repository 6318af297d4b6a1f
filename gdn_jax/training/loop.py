"""The training run: check, claim the run directory, build, restore or start, the steps.

``run`` reads as the story of a run. Nothing is written before every check has passed, and a
run directory belongs to one run (``run_dir.py``). The step loop keeps the device busy: each
step is dispatched before the previous step's metrics are read, so the host's work (the next
batch, the log, the progress bar) overlaps the device's. Where a step's state is needed (to
evaluate, checkpoint or stop) its metrics are read first, so a NaN loss stops the run at the
step it appeared and no checkpoint holds a state after it.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
import typing
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np
from tqdm.auto import tqdm

from gdn_jax.data.mqar import make_batch, split_seeds
from gdn_jax.data.tasks import TaskConfig, make_examples
from gdn_jax.training import checkpoints as ckpt
from gdn_jax.training import mesh as mesh_lib
from gdn_jax.training import run_dir
from gdn_jax.training.config import Config, to_dict
from gdn_jax.training.errors import Interrupted, OutOfMemory, is_out_of_memory
from gdn_jax.training.evaluation import evaluate, final_evaluation, held_out_set
from gdn_jax.training.run_state import RunBook, RunState, build, plot
from gdn_jax.training.state import trace_steps

Callback = Callable[[int, dict], None]  # (step, host-side metrics), after each step


def batch_seed(train_seed: int, step: int) -> int:
    """The data seed of one step: batches depend on (seed, step) alone, so a resumed run
    sees exactly the batches an uninterrupted one would."""
    return int(np.random.SeedSequence([train_seed, step]).generate_state(1)[0])


def train_batch(data: TaskConfig, batch_size: int, train_seed: int, step: int) -> dict:
    """The host batch of task ``data`` for the step after ``step`` (``make_batch``'s arrays,
    ``batch_size`` examples), of the stream of ``train_seed`` (``split_seeds``)."""
    inputs, labels = make_examples(data, num_examples=batch_size, seed=batch_seed(train_seed, step))
    return make_batch(inputs, labels)


def held_out_of(config: Config, batch_shardings) -> list[dict]:
    """The run's held-out batches, placed (``evaluation.held_out_set``)."""
    train = config.train
    return held_out_set(
        config.data,
        seed=train.seed,
        examples=train.eval_examples,
        batch_size=train.batch_size,
        batch_shardings=batch_shardings,
    )


@contextlib.contextmanager
def memory_named(config: Config):
    """Running out of memory (host or device) inside is ``OutOfMemory``, naming the settings
    of ``config`` that decide how much memory a run takes."""
    try:
        yield
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        model, train = config.model, config.train
        sizes = {
            "model.d_model": model.d_model,
            "model.mixers": f"[{', '.join(model.mixers)}]",
            "data.seq_len": config.data.seq_len,
            "train.batch_size": train.batch_size,
            "train.eval_examples": train.eval_examples,
        }
        raise OutOfMemory(error, sizes) from error


@contextlib.contextmanager
def stop_requests():
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


class _Steps:
    """The step loop's bookkeeping of one run from ``start``: its book, the progress bar and
    the callbacks."""

    def __init__(self, run: RunState, start: int, callbacks: Sequence[Callback]):
        self.run, self.callbacks = run, callbacks
        self.book = RunBook(run, start)
        train = run.config.train
        self.show = train.progress and ckpt.is_primary()
        self.bar = tqdm(total=train.steps, initial=start, disable=not self.show, unit="step")

    def read(self, step: int, metrics, tick: float) -> None:
        """Log step ``step``'s metrics (device arrays, dispatched at ``tick``): this waits
        for the step. A NaN or Inf loss raises ``NonFiniteLossError``."""
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        # The time from this step's dispatch to the host seeing its result.
        metrics = self.book.train(step, metrics, time.perf_counter() - tick)
        for callback in self.callbacks:
            callback(step, metrics)
        self.bar.update(1)
        held_out = self.book.summary["eval_accuracy"]
        self.bar.set_postfix(
            loss=f"{metrics['loss']:.3f}",
            acc=f"{metrics['accuracy']:.3f}",
            eval="-" if held_out is None else f"{held_out:.3f}",  # 0.000 would read as measured
            tok_s=f"{metrics['tokens_per_s']:.0f}",
        )

    def evaluate(self, step: int, held_out, *, last: bool) -> bool:
        """Evaluate and log; whether the target accuracy ends the run here."""
        run = self.run
        eval_loss, eval_accuracy = evaluate(run.eval_step, run.state.params, held_out)
        return self.book.evaluation(step, eval_loss, eval_accuracy, last=last)


def _step_loop(run: RunState, start: int, held_out, callbacks, stop_requests) -> dict:
    """Train from ``start`` until the step budget, the target accuracy or a stop request.

    Step ``n + 1`` is dispatched before step ``n``'s metrics are read, except where the
    state after step ``n`` is needed first: to evaluate, to save, to stop, and with
    ``callbacks`` (each may stop the run at its own step)."""
    train = run.config.train
    train_seed, _ = split_seeds(train.seed)
    steps = _Steps(run, start, callbacks)
    step, pending = start, None  # pending: (step, metrics, tick) dispatched, not yet read
    if start == train.steps:  # stopped after its last checkpoint, before its summary
        steps.book.summary.update(
            final_evaluation(run.log, start, run.eval_step, run.state.params, held_out)
        )
    try:
        while step < train.steps:
            host = train_batch(run.config.data, train.batch_size, train_seed, step)
            batch = mesh_lib.place(host, run.batch_shardings)
            tick = time.perf_counter()
            run.state, metrics = run.train_step(run.state, batch)
            step += 1
            if pending is not None:
                steps.read(*pending)
            pending = (step, metrics, tick)
            done = step == train.steps
            evaluates = step % train.eval_every == 0 or done
            saves = step % train.checkpoint_every == 0 or done
            if not (evaluates or saves or callbacks or stop_requests):
                continue  # the next step goes to the device before this one is read
            steps.read(*pending)
            pending = None
            if evaluates and steps.evaluate(step, held_out, last=done):
                done = True
            if saves or done:
                ckpt.save(run.checkpoints, step, run.state, run.out_dir)
            if done:
                break
            if stop_requests:
                ckpt.save(run.checkpoints, step, run.state, run.out_dir)
                raise Interrupted(stop_requests[0], step, run.out_dir)
        end_bar(steps.bar, step)
    finally:
        steps.bar.close()
    return steps.book.end(step)


def end_bar(bar: tqdm, step: int) -> None:
    """Show a run that ended at ``step``, before its last (its target accuracy reached), as
    complete: the bar stayed at, say, 400/700."""
    if step < bar.total:
        bar.total = step
        bar.refresh()


def check_run_arguments(fn: str, *, resume, overwrite, callbacks, devices, on_start) -> None:
    """``run``'s arguments beside the config (and ``batched.run``'s), each refused with a
    ``TypeError`` or ``ValueError`` naming it before any work (``devices=[]`` was a
    ZeroDivisionError in mesh.py, ``overwrite=1`` passed as True)."""
    for name, flag in (("resume", resume), ("overwrite", overwrite)):
        if not isinstance(flag, bool):
            raise TypeError(f"{fn}: {name}={flag!r:.60} must be True or False")
    listed = isinstance(callbacks, Sequence) and not isinstance(callbacks, str)
    if not (listed and all(callable(c) for c in callbacks)):
        raise TypeError(
            f"{fn}: callbacks={callbacks!r:.60} must be a list of functions callback(step, metrics)"
        )
    if on_start is not None and not callable(on_start):
        raise TypeError(f"{fn}: on_start={on_start!r:.60} must be a function or None")
    if devices is not None and not (
        isinstance(devices, Sequence)
        and devices
        and all(isinstance(device, jax.Device) for device in devices)
    ):
        raise ValueError(
            f"{fn}: devices={devices!r:.60} must be a non-empty list of jax.Device, e.g. "
            "jax.devices()[:2], or None for all of them"
        )


@typing.no_type_check  # a public entry point: it names a bad argument itself
def run(
    config: Config,
    *,
    resume: bool = False,
    overwrite: bool = False,
    callbacks: Sequence[Callback] = (),
    devices=None,
    on_start: Callable[[], None] | None = None,
) -> dict:
    """Train ``config`` and return a summary (final step, held-out accuracy, wall time).

    Args:
      config: a ``Config``, validated here again (as ``load_config`` does) before any work.
      resume: continue from the newest checkpoint in ``config.train.out_dir`` that restores;
        refused when the model, data or seed differ from the saved config.yaml (see
        ``run_dir.RESUMABLE_FIELDS``). A run that has already ended returns its summary.
      overwrite: delete an earlier run in ``out_dir`` first (a fresh run refuses otherwise).
      callbacks: functions ``callback(step, metrics)`` called after every step with the
        host-side metrics (a dict of floats), before the next step is dispatched.
      devices: the devices ``train.mesh`` arranges; all of them (``jax.devices()``) when None.
      on_start: called once every check has passed and the state is built or restored, just
        before the first step (the command prints its header there, so that a refusal is
        the only thing it prints); not called for a run that has already ended.

    Raises:
      ValueError: ``config`` is not a ``Config``, or one of its values is out of range.
      RunError: the run must not start (checked before anything is written); it names
        ``resume=True`` and ``overwrite=True`` where the commands name their flags.
      NonFiniteLossError: a step's loss is NaN or Inf; no checkpoint is written after the
        last finite step.
      SaveError: a checkpoint could not be written; the earlier ones are kept.
      OutOfMemory: the model, a batch or the held-out set does not fit in memory.
      Interrupted: SIGINT or SIGTERM arrived; a checkpoint at the current step was saved.
    """
    if not isinstance(config, Config):
        raise ValueError(
            f"run: config must be a Config, as load_config(path, overrides) returns, got "
            f"{type(config).__name__} {config!r:.60}"
        )
    config.validate()  # a Config built by hand has not been through load_config's checks
    options = dict(resume=resume, overwrite=overwrite, callbacks=callbacks, on_start=on_start)
    check_run_arguments("run", devices=devices, **options)
    mesh = mesh_lib.check_mesh(config, jax.devices() if devices is None else devices)
    with memory_named(config):
        trace_steps(config, mesh)  # what building the model or tracing a step raises, first
    resolved, train = to_dict(config), config.train
    # With several processes, process 0 alone owns the run directory (lock, config, metrics,
    # plot, summary); every process writes its shards of each checkpoint.
    primary = ckpt.is_primary()
    claim = dict(resume=resume, overwrite=overwrite)
    lock = run_dir.claim(train.out_dir, resolved, **claim) if primary else None
    ckpt.sync("run directory claimed")
    out_dir = Path(train.out_dir).absolute() if lock is None else lock.path.parent
    with run_dir.held([] if lock is None else [lock]):
        if resume:
            finished = run_dir.finished_summary(out_dir, train.steps, train.target_accuracy)
            if finished is not None:
                return finished
        with memory_named(config):
            return _train(config, resolved, mesh, out_dir, resume, callbacks, on_start)


def _train(config: Config, resolved, mesh, out_dir: Path, resume, callbacks, on_start) -> dict:
    """Build the state, restore or start, run the steps; the plot whatever happens."""
    run = build(config, mesh, out_dir)
    try:
        run.state, start = ckpt.restore_or_start(
            resolved, out_dir, run.checkpoints, run.log, run.state, resume
        )
        if on_start is not None:
            on_start()
        held_out = held_out_of(config, run.batch_shardings)
        with stop_requests() as requests:
            try:
                summary = _step_loop(run, start, held_out, callbacks, requests)
            finally:
                plot(run)
        if ckpt.is_primary():
            run_dir.write_summary(out_dir, summary)
        return summary
    finally:
        run.checkpoints.close()
