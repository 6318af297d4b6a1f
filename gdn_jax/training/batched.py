"""Several runs of one config trained in one process, in lockstep, each by its own program.

Runs whose resolved configs differ only in ``VARYING`` (seed, learning rate, run directory)
share the model's graph, the shapes of every batch and the steps at which they evaluate and
save. Each run trains here exactly as ``train.py`` trains it: its own jitted step (the
program ``train.py`` compiles for its config, shared by the runs at one learning rate), its
parameters from its seed, its batches (``loop.train_batch`` of its seed), its held-out set
and its run directory, claimed, logged, checkpointed, plotted and summarised as ``loop.run``
does it; so its losses equal a standalone ``train.py`` run's to the bit, and ``train.py
--resume`` continues any of them alone. What one process of several runs saves is their
process starts, imports and the compiles of the runs that share a learning rate.

A step dispatches every training run's step before the previous step's metrics are read
(``loop``'s overlap of host and device), and a run that ends (its step budget, its target
accuracy, a NaN loss, a failed save) simply takes no more steps. Resumed runs may stand at
different steps: they train in one lockstep from the earliest, each from its own step on, so
that the runs behind catch up while the others wait.

Stacking the runs on a leading axis under ``jax.vmap`` compiled one program for all of them,
but a vmapped step rounds differently from a single run's (the losses parted by a float unit
from step 3 on), and on 2 CPU cores it cost as much a run as the runs' own steps
(docs/benchmarks.md); so a run's step is the single run's.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np
from tqdm.auto import tqdm

from gdn_jax.data.mqar import split_seeds
from gdn_jax.training import checkpoints as ckpt
from gdn_jax.training import loop, run_dir, run_state
from gdn_jax.training import mesh as mesh_lib
from gdn_jax.training.config import Config, to_dict
from gdn_jax.training.errors import (
    Interrupted,
    NonFiniteLossError,
    RunError,
    SaveError,
)
from gdn_jax.training.evaluation import evaluate, final_evaluation
from gdn_jax.training.state import trace_steps

# The resolved-config fields in which the runs of one process may differ.
VARYING = ("train.seed", "train.learning_rate", "train.out_dir")
# (step, each training run's host metrics or None where it took no step), after each step.
Callback = Callable[[int, list], None]
Outcome = dict | Exception  # a run's summary, or the error that ended it


def check_group(configs: Sequence[Config]) -> None:
    """Raise ``RunError`` unless ``configs`` can train together: the same but for
    ``VARYING``, each in a directory of its own, in one process."""
    if not configs:
        raise RunError("no runs to train")
    first = _shared(configs[0])
    for config in configs[1:]:
        other = _shared(config)
        differing = sorted(
            name for name in first.keys() | other.keys() if first.get(name) != other.get(name)
        )
        if differing:
            raise RunError(
                f"runs trained together may differ only in {', '.join(VARYING)}; "
                f"{config.train.out_dir} differs from {configs[0].train.out_dir} in "
                f"{', '.join(differing)}"
            )
    out_dirs = [Path(config.train.out_dir).absolute() for config in configs]
    for out_dir in out_dirs:
        if out_dirs.count(out_dir) > 1:
            raise RunError(f"train.out_dir={out_dir} is given to more than one run")
    if jax.process_count() > 1:
        raise RunError("runs trained together take one process; train each with train.py")


def _shared(config: Config) -> dict:
    flat = run_dir.flatten(to_dict(config))
    return {name: value for name, value in flat.items() if name not in VARYING}


def run(
    configs: Sequence[Config],
    *,
    resume: bool = False,
    overwrite: bool = False,
    callbacks: Sequence[Callback] = (),
    devices=None,
    on_start: Callable[[], None] | None = None,
) -> list[Outcome]:
    """Train ``configs`` together in this process; returns each run's outcome, in order:
    its summary (as ``loop.run`` returns it), or the ``NonFiniteLossError`` or ``SaveError``
    that ended it while the others went on.

    Args:
      configs: validated configs that differ only in ``VARYING``.
      resume, overwrite: as ``loop.run``'s, for every run; a resumed run that has ended
        returns its summary untrained.
      callbacks: functions ``callback(step, metrics)`` called after every step with a list,
        one entry for each run being trained: its host metrics, or None where it took no step.
      devices: the runs share the first of them (of ``jax.devices()`` when None).
      on_start: as ``loop.run``'s: called once every run is built or restored, before the
        first step.

    Raises:
      RunError: the runs must not start (checked before anything is written).
      OutOfMemory: the runs, their batches or held-out sets do not fit in memory together.
      Interrupted: SIGINT or SIGTERM arrived; every run still training saved a checkpoint.
    """
    options = dict(resume=resume, overwrite=overwrite, callbacks=callbacks, on_start=on_start)
    loop.check_run_arguments("batched.run", devices=devices, **options)
    check_group(configs)
    device = (jax.devices() if devices is None else devices)[0]
    mesh = mesh_lib.check_mesh(configs[0], [device])
    with loop.memory_named(configs[0]):
        trace_steps(configs[0], mesh)  # the runs share their model: one trace checks them all
    resolved = [to_dict(config) for config in configs]
    claims = [(c.train.out_dir, r) for c, r in zip(configs, resolved, strict=True)]
    locks = run_dir.claim_all(claims, resume=resume, overwrite=overwrite)
    with run_dir.held(locks):
        out_dirs = [lock.path.parent for lock in locks]
        outcomes = [
            run_dir.finished_summary(out_dir, c.train.steps, c.train.target_accuracy)
            if resume
            else None
            for c, out_dir in zip(configs, out_dirs, strict=True)
        ]
        todo = [i for i, outcome in enumerate(outcomes) if outcome is None]
        chosen = [(configs[i], resolved[i], out_dirs[i]) for i in todo]
        with loop.memory_named(configs[0]):
            trained = _train(chosen, mesh, resume, callbacks, on_start)
        for i, outcome in zip(todo, trained, strict=True):
            outcomes[i] = outcome
        return outcomes


@dataclasses.dataclass(eq=False)  # a member is itself, not its fields
class _Member:
    """One run of the process: its directory, state and single-run steps, where it starts,
    its book and, once it has ended, its outcome."""

    run: run_state.RunState
    start: int
    book: run_state.RunBook
    outcome: Outcome | None = None

    def __post_init__(self):
        self.train_seed, _ = split_seeds(self.run.config.train.seed)
        self.held_out = loop.held_out_of(self.run.config, self.run.batch_shardings)

    def takes(self, step: int) -> bool:
        """Whether the run takes the step after ``step`` (it is at ``step`` and training)."""
        return self.outcome is None and self.start <= step

    def dispatch(self, step: int):
        """Dispatch the step after ``step`` as ``loop`` does; returns its metrics (device
        arrays)."""
        run, config = self.run, self.run.config
        host = loop.train_batch(config.data, config.train.batch_size, self.train_seed, step)
        batch = mesh_lib.place(host, run.batch_shardings)
        run.state, metrics = run.train_step(run.state, batch)
        return metrics

    def end(self, step: int) -> None:
        self.outcome = self.book.end(step)
        run_state.plot(self.run)
        run_dir.write_summary(self.run.out_dir, self.outcome)

    def fail(self, error: Exception) -> None:
        self.outcome = error
        run_state.plot(self.run)


def _train(chosen, mesh, resume, callbacks, on_start) -> list[Outcome]:
    """Build, restore or start every run of ``chosen`` (``(config, resolved, out_dir)``s),
    train them together; the plots whatever happens."""
    runs, members = [], []
    try:
        for config, resolved, out_dir in chosen:
            runs.append(run_state.build(config, mesh, out_dir))
            run = runs[-1]
            run.state, start = ckpt.restore_or_start(
                resolved, out_dir, run.checkpoints, run.log, run.state, resume
            )
            members.append(_Member(run, start, run_state.RunBook(run, start)))
            if start == config.train.steps:  # stopped after its last checkpoint
                _final_evaluation(members[-1])
        training = [member for member in members if member.outcome is None]
        if on_start is not None:
            on_start()
        if training:
            with loop.stop_requests() as requests:
                _Lockstep(training, callbacks, requests).run()
        return [member.outcome for member in members]
    finally:
        for member in members:
            if member.outcome is None:  # stopped, or something failed them all
                run_state.plot(member.run)
        for run in runs:
            run.checkpoints.close()


def _final_evaluation(member: _Member) -> None:
    run = member.run
    member.book.summary.update(
        final_evaluation(run.log, member.start, run.eval_step, run.state.params, member.held_out)
    )
    member.end(member.start)


class _Lockstep:
    """The step loop of the members, as ``loop``'s for one run: step ``n + 1`` of every
    training member is dispatched before step ``n``'s metrics are read, except where the
    states after step ``n`` are needed first (to evaluate, save or stop) and with callbacks.
    """

    def __init__(self, members: list[_Member], callbacks, requests):
        self.members, self.callbacks, self.requests = members, callbacks, requests
        self.train = members[0].run.config.train
        self.out_root = Path(os.path.commonpath([str(m.run.out_dir) for m in members]))
        show = self.train.progress and ckpt.is_primary()
        start = min(m.start for m in members)
        self.bar = tqdm(total=self.train.steps, initial=start, disable=not show, unit="step")

    def run(self) -> None:
        """Train until every member has an outcome, or raise ``Interrupted``."""
        train = self.train
        step = min(m.start for m in self.members)
        pending = None  # (step, {member: metrics}, tick) dispatched, not yet read
        try:
            while any(m.outcome is None for m in self.members):
                tick = time.perf_counter()
                stepped = {m: m.dispatch(step) for m in self.members if m.takes(step)}
                step += 1
                if pending is not None:
                    self._read(*pending)
                pending = (step, stepped, tick)
                done = step == train.steps
                evaluates = step % train.eval_every == 0 or done
                saves = step % train.checkpoint_every == 0 or done
                if not (evaluates or saves or self.callbacks or self.requests):
                    continue  # the next step goes to the device before this one is read
                self._read(*pending)
                pending = None
                self._after(step, list(stepped), done, evaluates, saves)
            loop.end_bar(self.bar, step)
        finally:
            self.bar.close()

    def _after(self, step: int, stepped: list[_Member], done: bool, evaluates: bool, saves: bool):
        """Evaluate, save, end the runs that end at ``step``, stop on request."""
        stepped = [m for m in stepped if m.outcome is None]  # a NaN loss failed the others
        ending = set(stepped) if done else set()
        if evaluates:
            ending |= self._evaluate(step, stepped, done)
        saving = stepped if saves or done or self.requests else [m for m in stepped if m in ending]
        for member in saving:
            try:
                ckpt.save(member.run.checkpoints, step, member.run.state, member.run.out_dir)
            except SaveError as error:
                member.fail(error)
        for member in stepped:
            if member in ending and member.outcome is None:
                member.end(step)
        training = [m for m in self.members if m.outcome is None]
        if self.requests and training:
            raise Interrupted(self.requests[0], step, self.out_root, len(training))

    def _read(self, step: int, stepped: dict, tick: float) -> None:
        """Log step ``step``'s metrics of the runs that took it: this waits for the step. A
        NaN or Inf loss ends its run. The callbacks get an entry for each member: its
        record, or None where it took no step."""
        host = dict(zip(stepped, jax.device_get(list(stepped.values())), strict=True))
        seconds = time.perf_counter() - tick
        records = []
        for member in self.members:
            record = None
            if member in host and member.outcome is None:
                try:
                    metrics = {k: float(v) for k, v in host[member].items()}
                    record = member.book.train(step, metrics, seconds)
                except NonFiniteLossError as error:
                    member.fail(error)
            records.append(record)
        for callback in self.callbacks:
            callback(step, records)
        losses = [r["loss"] for r in records if r is not None]
        self.bar.update(1)
        self.bar.set_postfix(runs=len(losses), loss=f"{np.mean(losses) if losses else 0:.3f}")

    def _evaluate(self, step: int, stepped: list[_Member], last: bool) -> set[_Member]:
        """Evaluate and log the runs that took step ``step``, as ``loop`` does; returns
        those that reached their target accuracy."""
        ended = set()
        for member in stepped:
            run = member.run
            loss, accuracy = evaluate(run.eval_step, run.state.params, member.held_out)
            if member.book.evaluation(step, loss, accuracy, last=last):
                ended.add(member)
        return ended
