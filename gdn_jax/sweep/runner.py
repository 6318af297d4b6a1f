"""Running a sweep's cells, each as the training command in a process of its own.

Several run side by side (``jobs``), one core each. SIGINT or SIGTERM stops the sweep: no
new run starts, the running ones get the signal (a Ctrl-C reaches them anyway), save a
checkpoint and stop, and none of them is recorded. The next sweep resumes each from its
checkpoint (``--resume``), so an interrupted sweep loses at most the steps since a run's last
checkpoint, and never records a run it did not finish.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
from gdn_jax.training.errors import RunError
from gdn_jax.training.metrics_log import MetricsLog
from gdn_jax.training.run_dir import METRICS, checkpoint_steps

TRAINER = (sys.executable, "-m", "gdn_jax.training.cli")
STOPPED = (130, 143, -signal.SIGINT, -signal.SIGTERM)  # how the command ends when stopped


@dataclasses.dataclass(frozen=True)
class Job:
    """One cell to train: its identity, run directory and the command's arguments."""

    cell: Cell
    key: str
    run_dir: Path
    args: tuple[str, ...]  # --config and the --set items, without --resume or --overwrite


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


def run_jobs(jobs: list[Job], workers: int, results: Results, stop: Stop, trainer=TRAINER) -> Tally:
    """Train ``jobs``, ``workers`` at a time, recording each finished or failed run."""
    env = dict(os.environ)
    if workers > 1:  # small ops do not scale across cores; processes do
        flags = env.get("XLA_FLAGS", "")
        env["XLA_FLAGS"] = f"{flags} --xla_cpu_multi_thread_eigen=false".strip()
    tally, lock = Tally(), threading.Lock()

    def one(job: Job) -> None:
        outcome = _train(job, env, results, stop, trainer)
        with lock:
            setattr(tally, outcome, getattr(tally, outcome) + 1)

    with stop_on_signals(stop), ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, jobs))
    return tally


def _train(job: Job, env, results: Results, stop: Stop, trainer) -> str:
    """Run one job; returns the ``Tally`` field it counts in."""
    try:
        resume = bool(checkpoint_steps(job.run_dir))
    except RunError as error:
        return _record_failure(job, results, str(error), 0.0)
    command = [*trainer, *job.args, "--resume" if resume else "--overwrite"]
    began = time.perf_counter()
    process = stop.start(command, env)
    if process is None:
        return "not_started"
    try:
        _, stderr = process.communicate()
    finally:
        stop.done(process)
    wall_s = round(time.perf_counter() - began, 1)
    if process.returncode in STOPPED:
        print(f"{job.cell.name}: stopped; it resumes on the next run", flush=True)
        return "interrupted"
    if process.returncode != 0:
        lines = stderr.strip().splitlines()
        return _record_failure(job, results, lines[-1] if lines else "", wall_s, process)
    evals = MetricsLog(job.run_dir / METRICS, writes=False).read("eval")
    if not evals:
        return _record_failure(job, results, "the run logged no held-out evaluation", wall_s)
    best = max(evals, key=lambda r: r["accuracy"])
    record = _record(job, FINISHED, wall_s, accuracy=best["accuracy"], best_step=best["step"])
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
