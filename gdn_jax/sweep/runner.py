"""Running a sweep's cells: each as the training command in a process of its own, or the
runs of one group (the cells that differ only in seed and learning rate) several to a process
as the batched command (``training/batched_cli.py``), which trains them as one program.

Several processes run side by side (``workers``). SIGINT or SIGTERM stops the sweep: no new
process starts, the running ones get the signal (a Ctrl-C reaches them anyway), save a
checkpoint of each run and stop, and none of their runs is recorded. The next sweep resumes
each from its checkpoint (``--resume``), so an interrupted sweep loses at most the steps
since a run's last checkpoint, and never records a run it did not finish.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gdn_jax.sweep.cells import Cell
from gdn_jax.sweep.results import FAILED, FINISHED, Results
from gdn_jax.training.batched_cli import failures
from gdn_jax.training.errors import RunError
from gdn_jax.training.metrics_log import MetricsLog
from gdn_jax.training.run_dir import METRICS, SUMMARY, checkpoint_steps, read_summary

TRAINER = (sys.executable, "-m", "gdn_jax.training.cli")
BATCHED_TRAINER = (sys.executable, "-m", "gdn_jax.training.batched_cli")
STOPPED = (130, 143, -signal.SIGINT, -signal.SIGTERM)  # how the commands end when stopped


@dataclasses.dataclass(frozen=True)
class Job:
    """One cell to train: its identity, run directory and the commands' arguments (without
    ``--resume`` or ``--overwrite``)."""

    cell: Cell
    key: str
    run_dir: Path
    args: tuple[str, ...]  # the training command's: --config and the --set items
    shared: tuple[str, ...]  # the batched command's, the same for every run of the group
    run: tuple[str, str, str]  # the batched command's --run: directory, seed, learning rate


@dataclasses.dataclass(frozen=True)
class Trainers:
    """The commands that train one run and several (the tests give stand-ins)."""

    alone: tuple[str, ...] = TRAINER
    batched: tuple[str, ...] = BATCHED_TRAINER


TRAINERS = Trainers()


class Stop:
    """The stop request: the first signal that arrived, and the live processes to pass it to."""

    def __init__(self):
        self.signum: int | None = None
        self._lock = threading.Lock()
        self._live: set[subprocess.Popen] = set()

    def request(self, signum: int, frame=None) -> None:
        with self._lock:
            self.signum = self.signum or signum
            for process in self._live:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signum)

    def start(self, command, env) -> subprocess.Popen | None:
        """The process of ``command``, or None once a stop was requested."""
        with self._lock:
            if self.signum is not None:
                return None
            process = subprocess.Popen(
                command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
            )
            self._live.add(process)
            return process

    def done(self, process: subprocess.Popen) -> None:
        with self._lock:
            self._live.discard(process)


@contextlib.contextmanager
def stop_on_signals(stop: Stop):
    """SIGINT and SIGTERM become ``stop.request`` while the runs go on (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for signum in previous:
        signal.signal(signum, stop.request)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@dataclasses.dataclass
class Tally:
    """What a sweep's runs came to."""

    finished: int = 0
    failed: int = 0
    interrupted: int = 0
    not_started: int = 0


def run_jobs(
    jobs: list[Job],
    workers: int,
    results: Results,
    stop: Stop,
    trainers: Trainers = TRAINERS,
    *,
    batch_runs: int = 1,
) -> Tally:
    """Train ``jobs``, ``workers`` processes at a time, at most ``batch_runs`` runs of a
    group to a process, recording each finished or failed run."""
    env = dict(os.environ)
    if workers > 1:  # small ops do not scale across cores; processes do
        flags = env.get("XLA_FLAGS", "")
        env["XLA_FLAGS"] = f"{flags} --xla_cpu_multi_thread_eigen=false".strip()
    tally, lock = Tally(), threading.Lock()

    def count(outcomes: list[str]) -> None:
        with lock:
            for outcome in outcomes:
                setattr(tally, outcome, getattr(tally, outcome) + 1)

    def one(batch: tuple[list[Job], bool]) -> None:
        jobs, resume = batch
        if len(jobs) == 1:
            count([_train(jobs[0], resume, env, results, stop, trainers.alone)])
        else:
            count(_train_together(jobs, resume, env, results, stop, trainers.batched))

    ready = []
    for job in jobs:
        try:
            ready.append((job, bool(checkpoint_steps(job.run_dir))))
        except RunError as error:
            count([_record_failure(job, results, str(error), 0.0)])
    with stop_on_signals(stop), ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, batches(ready, batch_runs, workers)))
    return tally


def batches(
    jobs: list[tuple[Job, bool]], size: int, workers: int = 1
) -> list[tuple[list[Job], bool]]:
    """``(job, resume)`` pairs as the batches of at most ``size`` runs that one process
    trains, in the order of ``jobs``: the runs of one group that all resume or all start
    afresh, split as evenly as ``size`` allows, then the largest batch halved while the
    workers cannot take an equal share of batches, so that no core idles while another
    trains a batch alone (with several workers, a process trains on one core)."""
    groups: dict[tuple, list[Job]] = {}
    for job, resume in jobs:
        groups.setdefault((job.shared, resume), []).append(job)
    found = []
    for (_, resume), group in groups.items():
        per = math.ceil(len(group) / math.ceil(len(group) / size))
        found += [(group[i : i + per], resume) for i in range(0, len(group), per)]
    while len(found) % workers:
        i = max(range(len(found)), key=lambda i: len(found[i][0]))
        (batch, resume), half = found[i], math.ceil(len(found[i][0]) / 2)
        if len(batch) == 1:
            break
        found[i : i + 1] = [(batch[:half], resume), (batch[half:], resume)]
    return found


def _train(job: Job, resume: bool, env, results: Results, stop: Stop, trainer) -> str:
    """Run one job; returns the ``Tally`` field it counts in."""
    command = [*trainer, *job.args, "--resume" if resume else "--overwrite"]
    ran = _run_process(command, env, stop)
    if ran is None:
        return "not_started"
    process, stderr, wall_s = ran
    if process.returncode in STOPPED:
        print(f"{job.cell.name}: stopped; it resumes on the next run", flush=True)
        return "interrupted"
    if process.returncode != 0:
        lines = stderr.strip().splitlines()
        return _record_failure(job, results, lines[-1] if lines else "", wall_s, process)
    return _record_finished(job, results, wall_s)


def _train_together(jobs: list[Job], resume: bool, env, results, stop, trainer) -> list[str]:
    """Run ``jobs`` in one process of the batched command; returns each one's ``Tally``
    field. A run is finished when its summary is there, failed with its own line of the
    command's stderr, or else with the command's last line."""
    runs = [x for job in jobs for x in ("--run", *job.run)]
    command = [*trainer, *jobs[0].shared, *runs, "--resume" if resume else "--overwrite"]
    ran = _run_process(command, env, stop)
    if ran is None:
        return ["not_started"] * len(jobs)
    process, stderr, wall_s = ran
    if process.returncode in STOPPED:
        for job in jobs:
            print(f"{job.cell.name}: stopped; it resumes on the next run", flush=True)
        return ["interrupted"] * len(jobs)
    failed = failures(stderr, [job.run[0] for job in jobs])
    lines = stderr.strip().splitlines()
    outcomes = []
    for job in jobs:
        if job.run[0] in failed:
            outcomes.append(_record_failure(job, results, failed[job.run[0]], wall_s))
        elif (job.run_dir / SUMMARY).exists():
            outcomes.append(_record_finished(job, results, wall_s, runs_in_process=len(jobs)))
        else:
            error = lines[-1] if lines else ""
            outcomes.append(_record_failure(job, results, error, wall_s, process))
    return outcomes


def _run_process(command, env, stop: Stop) -> tuple[subprocess.Popen, str, float] | None:
    """``command`` run to its end: the process, its stderr and its wall time in seconds;
    None once a stop was requested."""
    began = time.perf_counter()
    process = stop.start(command, env)
    if process is None:
        return None
    try:
        _, stderr = process.communicate()
    finally:
        stop.done(process)
    return process, stderr, round(time.perf_counter() - began, 1)


def _record_finished(job: Job, results: Results, wall_s: float, **values) -> str:
    """Record ``job``'s run with its best held-out accuracy (a failure if it logged none)."""
    evals = MetricsLog(job.run_dir / METRICS, writes=False).read("eval")
    if not evals:
        return _record_failure(job, results, "the run logged no held-out evaluation", wall_s)
    best = max(evals, key=lambda r: r["accuracy"])
    summary = read_summary(job.run_dir) or {}
    record = _record(
        job,
        FINISHED,
        wall_s,
        accuracy=best["accuracy"],
        best_step=best["step"],
        # How it ended ("target": early stop; "steps": the budget) and its held-out curve,
        # so that the table can tell a plateau from a run cut off while it still rose.
        reason=summary.get("reason"),
        final_step=summary.get("final_step"),
        evals=[[r["step"], round(r["accuracy"], 5)] for r in evals],
        **values,
    )
    results.append(record)
    print(f"{job.cell.name}: {best['accuracy']:.4f} in {wall_s:.0f} s", flush=True)
    return "finished"


def _record(job: Job, status: str, wall_s: float, **values) -> dict:
    return dict(key=job.key, status=status, **dataclasses.asdict(job.cell), wall_s=wall_s, **values)


def _record_failure(job, results, error, wall_s, process=None) -> str:
    if process is not None and process.returncode < 0:
        error = f"killed by {signal.Signals(-process.returncode).name}; {error}".rstrip("; ")
    results.append(_record(job, FAILED, wall_s, error=error or "no message"))
    print(f"{job.cell.name}: failed: {error}", flush=True)
    return "failed"
