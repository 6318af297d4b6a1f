"""Several runs of one config trained as one program: one step over their stacked states.

Runs whose resolved configs differ only in ``VARYING`` (seed, learning rate, run directory)
share the model's graph, the shapes of every batch and the steps at which they evaluate and
save. ``jax.vmap`` of the run's own ``make_train_step`` over states with a leading run axis R
trains them all in one process, with one compile and one dispatch a step: what R runs save
is R - 1 process starts and compiles (on 2 CPU cores the step of ``configs/mqar_gdn.yaml``
costs as much per run in a program of six lanes as alone: its work, not its dispatch, grows
with R; docs/benchmarks.md has the figures). Each run keeps what it would have alone: its parameters from its seed, its batches (``loop.train_batch`` of its seed), its
held-out set, its learning rate (a traced peak, ``optim.learning_rate_schedule``) and its run
directory, claimed, logged, checkpointed, plotted and summarised as ``loop.run`` does it, so
that ``train.py --resume`` continues any of them alone.

A run that ends (its step budget, its target accuracy, a NaN loss, a failed save) stops
changing: the step keeps the state of a lane whose ``active`` flag is off (``jnp.where``),
so the program keeps its shape. An ended lane costs as much as a live one, though, so once
the steps left for the ended lanes would take longer than a compile, as measured in the run,
they are dropped and the program compiled for the others. Resumed runs may stand at
different steps: they train in one lockstep from the earliest, each lane active from its own
step on, so that the runs behind catch up while the others wait.
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
from gdn_jax.training import loop, run_dir
from gdn_jax.training import mesh as mesh_lib
from gdn_jax.training.config import Config, to_dict
from gdn_jax.training.errors import (
    Interrupted,
    NonFiniteLossError,
    OutOfMemory,
    RunError,
    SaveError,
    is_out_of_memory,
)
from gdn_jax.training.evaluation import (
    evaluate_runs,
    final_evaluation,
    held_out_batches,
    held_out_set,
)
from gdn_jax.training.state import stacked_steps

# The resolved-config fields in which the runs of one program may differ.
VARYING = ("train.seed", "train.learning_rate", "train.out_dir")
# (step, each training run's host metrics or None where it took no step), after each step.
Callback = Callable[[int, list], None]
Outcome = dict | Exception  # a run's summary, or the error that ended it


def check_group(configs: Sequence[Config]) -> None:
    """Raise ``RunError`` unless ``configs`` can train as one program: the same but for
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
    """Train ``configs`` as one program; returns each run's outcome, in order: its summary
    (as ``loop.run`` returns it), or the ``NonFiniteLossError`` or ``SaveError`` that ended
    it while the others went on.

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
    check_group(configs)
    device = (jax.devices() if devices is None else devices)[0]
    mesh = mesh_lib.check_mesh(configs[0], [device])
    locks = run_dir.claim_all(list(configs), resume=resume, overwrite=overwrite)
    try:
        out_dirs = [lock.path.parent for lock in locks]
        outcomes = [
            run_dir.finished_summary(config, out_dir) if resume else None
            for config, out_dir in zip(configs, out_dirs, strict=True)
        ]
        todo = [i for i, outcome in enumerate(outcomes) if outcome is None]
        chosen = [configs[i] for i in todo], [out_dirs[i] for i in todo]
        try:
            trained = _train(*chosen, mesh, device, resume, callbacks, on_start)
        except Exception as error:
            if is_out_of_memory(error):
                raise OutOfMemory(configs[0], error) from error
            raise
        for i, outcome in zip(todo, trained, strict=True):
            outcomes[i] = outcome
        return outcomes
    finally:
        for lock in locks:
            lock.release()


@dataclasses.dataclass(eq=False)  # a member is itself, not its fields
class _Member:
    """One run of the program: its directory and single-run steps, where it starts, its book
    and, once it has ended, its outcome."""

    run: loop.RunState
    start: int
    book: loop.RunBook
    outcome: Outcome | None = None

    def __post_init__(self):
        self.train_seed, _ = split_seeds(self.run.config.train.seed)
        self.shardings = jax.tree.map(lambda x: x.sharding, self.run.state)
        self.held_out = held_out_batches(self.run.config)  # on the host

    def takes(self, step: int) -> bool:
        """Whether the run takes the step after ``step`` (it is at ``step`` and training)."""
        return self.outcome is None and self.start <= step

    def end(self, step: int) -> None:
        self.outcome = self.book.end(step)
        loop.plot(self.run)
        run_dir.write_summary(self.run.out_dir, self.outcome)

    def fail(self, error: Exception) -> None:
        self.outcome = error
        loop.plot(self.run)


def _train(configs, out_dirs, mesh, device, resume, callbacks, on_start) -> list[Outcome]:
    """Build, restore or start every run, train them together; the plots whatever happens."""
    runs, members = [], []
    try:
        for config, out_dir in zip(configs, out_dirs, strict=True):
            runs.append(loop.build(config, mesh, out_dir))
            run = runs[-1]
            run.state, start = ckpt.restore_or_start(
                config, out_dir, run.checkpoints, run.log, run.state, resume
            )
            members.append(_Member(run, start, loop.RunBook(run, start)))
            if start == config.train.steps:  # stopped after its last checkpoint
                _final_evaluation(members[-1])
        lanes = [member for member in members if member.outcome is None]
        if on_start is not None:
            on_start()
        if lanes:
            with loop.stop_requests() as requests:
                _Lockstep(lanes, device, callbacks, requests).run()
        return [member.outcome for member in members]
    finally:
        for member in members:
            if member.outcome is None:  # stopped, or something failed them all
                loop.plot(member.run)
        for run in runs:
            run.checkpoints.close()


def _final_evaluation(member: _Member) -> None:
    run = member.run
    held_out = held_out_set(run.config, run.batch_shardings)
    member.book.summary.update(
        final_evaluation(run.log, member.start, run.eval_step, run.state.params, held_out)
    )
    member.end(member.start)


def _stack(trees: list, device) -> object:
    """Host pytrees of one structure stacked on a new leading axis, on ``device``."""
    return jax.device_put(jax.tree.map(lambda *xs: np.stack(xs), *trees), device)


class _Lockstep:
    """The step loop of the members, as ``loop``'s for one run: step ``n + 1`` is dispatched
    before step ``n``'s metrics are read, except where the states after step ``n`` are
    needed first (to evaluate, save or stop) and with callbacks.

    The program's lanes are the members still in it. A member that ends keeps its lane (the
    step leaves it as it is) until the steps its lane would still cost the others outweigh a
    compile, measured: each lane costs as much as a run of its own, so the ended ones are
    then dropped and the program compiled for the others.
    """

    def __init__(self, members: list[_Member], device, callbacks, requests):
        self.callbacks, self.requests, self.device = callbacks, requests, device
        config = members[0].run.config
        self.train = config.train
        self.steps = stacked_steps(config)
        self.out_root = Path(os.path.commonpath([str(m.run.out_dir) for m in members]))
        self._place(members, [jax.device_get(m.run.state) for m in members])
        # The batch of a lane that takes no step: any batch of the right shapes will do.
        first = loop.train_batch(config, members[0].train_seed, 0)
        self.idle_batch = {name: np.zeros_like(x) for name, x in first.items()}
        show = self.train.progress and ckpt.is_primary()
        start = min(m.start for m in members)
        self.bar = tqdm(total=self.train.steps, initial=start, disable=not show, unit="step")

    def _place(self, lanes: list[_Member], states: list) -> None:
        """The program's lanes: ``lanes``, their states (host pytrees), learning rates and
        held-out sets stacked on the device; the next step compiles (and is timed)."""
        self.lanes, self.compile_s, self.since = lanes, None, None
        self.state = _stack(states, self.device)
        peaks = [m.run.config.train.learning_rate for m in lanes]
        self.peaks = jax.device_put(np.asarray(peaks, np.float32), self.device)
        held_out = zip(*(m.held_out for m in lanes), strict=True)
        self.held_out = [_stack(list(batches), self.device) for batches in held_out]

    def run(self) -> None:
        """Train until every member has an outcome, or raise ``Interrupted``."""
        train = self.train
        step = min(m.start for m in self.lanes)
        pending = None  # (step, metrics, tick, takes) dispatched, not yet read
        try:
            while any(m.outcome is None for m in self.lanes):
                takes = [m.takes(step) for m in self.lanes]
                batch = self._batch(step, takes)
                tick = time.perf_counter()
                self.state, metrics = self.steps.train_step(
                    self.state, batch, self.peaks, np.asarray(takes)
                )
                if self.compile_s is None:  # the call compiled the program first
                    self.compile_s, self.since = time.perf_counter() - tick, (tick, step)
                step += 1
                if pending is not None:
                    self._read(*pending)
                pending = (step, metrics, tick, takes)
                done = step == train.steps
                evaluates = step % train.eval_every == 0 or done
                saves = step % train.checkpoint_every == 0 or done
                if not (evaluates or saves or self.callbacks or self.requests):
                    continue  # the next step goes to the device before this one is read
                self._read(*pending)
                pending = None
                self._after(step, takes, done, evaluates, saves)
        finally:
            self.bar.close()

    def _after(self, step: int, takes: list[bool], done: bool, evaluates: bool, saves: bool):
        """Evaluate, save, end the runs that end at ``step``, stop on request, drop the lanes
        of ended runs when that pays."""
        stepped = [
            m for m, took in zip(self.lanes, takes, strict=True) if took and m.outcome is None
        ]
        ending = set(stepped) if done else set()
        if evaluates:
            ending |= self._evaluate(step, done)
        saving = stepped if saves or done or self.requests else [m for m in stepped if m in ending]
        self._save(step, saving)
        for member in stepped:
            if member in ending and member.outcome is None:
                member.end(step)
        training = [m for m in self.lanes if m.outcome is None]
        if self.requests and training:
            raise Interrupted(self.requests[0], step, self.out_root, len(training))
        if training and len(training) < len(self.lanes) and self._drop_pays(step):
            host = jax.device_get(self.state)
            kept = [i for i, m in enumerate(self.lanes) if m.outcome is None]
            self._place(training, [jax.tree.map(lambda x, i=i: x[i], host) for i in kept])

    def _drop_pays(self, step: int) -> bool:
        """Whether the steps left for the lanes of ended runs take longer than a compile,
        at the time per lane and step measured since the last compile."""
        (began, first), lanes = self.since, len(self.lanes)
        per_lane = (time.perf_counter() - began - self.compile_s) / (step - first) / lanes
        ended = sum(m.outcome is not None for m in self.lanes)
        return ended * (self.train.steps - step) * per_lane > self.compile_s

    def _batch(self, step: int, takes: list[bool]) -> dict:
        lanes = [
            loop.train_batch(m.run.config, m.train_seed, step) if took else self.idle_batch
            for m, took in zip(self.lanes, takes, strict=True)
        ]
        return {name: np.stack([lane[name] for lane in lanes]) for name in self.idle_batch}

    def _read(self, step: int, metrics, tick: float, takes: list[bool]) -> None:
        """Log step ``step``'s metrics of the runs that took it: this waits for the step. A
        NaN or Inf loss ends its run."""
        host = jax.device_get(metrics)
        seconds = time.perf_counter() - tick
        records = []
        for i, (member, took) in enumerate(zip(self.lanes, takes, strict=True)):
            record = None
            if took and member.outcome is None:
                try:
                    record = member.book.train(
                        step, {k: float(v[i]) for k, v in host.items()}, seconds
                    )
                except NonFiniteLossError as error:
                    member.fail(error)
            records.append(record)
        for callback in self.callbacks:
            callback(step, records)
        losses = [r["loss"] for r in records if r is not None]
        self.bar.update(1)
        self.bar.set_postfix(runs=len(losses), loss=f"{np.mean(losses) if losses else 0:.3f}")

    def _evaluate(self, step: int, last: bool) -> set[_Member]:
        """Evaluate every lane and log the runs at ``step``; returns those that reached their
        target accuracy."""
        losses, accuracies = evaluate_runs(self.steps.eval_step, self.state.params, self.held_out)
        return {
            m
            for i, m in enumerate(self.lanes)
            if m.takes(step - 1)
            and m.book.evaluation(step, float(losses[i]), float(accuracies[i]), last=last)
        }

    def _save(self, step: int, members: list[_Member]) -> None:
        """A checkpoint at ``step`` of each of ``members``, its lane placed as the single run
        places its state; a failed save ends its run."""
        if not members:
            return
        host = jax.device_get(self.state)
        for member in members:
            i = self.lanes.index(member)
            lane = jax.device_put(jax.tree.map(lambda x, i=i: x[i], host), member.shardings)
            try:
                ckpt.save(member.run.checkpoints, step, lane, member.run.out_dir)
            except SaveError as error:
                member.fail(error)
