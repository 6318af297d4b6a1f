"""``python -m gdn_jax.sweep``: the command, its checks and the story of a sweep.

Every argument, every cell's config and the writability of ``--out`` and ``--runs`` are
checked before anything is created or trained; a bad one is one line, ``sweep: error: ...``,
with exit status 2. Then the sweep locks ``--out``, trains the cells without a record, and
writes the table and the plot. A stopped sweep (SIGINT, SIGTERM) records nothing for the runs
it stopped, says so in one line and exits 130 or 143; the same command goes on from there.
The same command with ``--table-only`` trains nothing and writes the table and the plot of
what is recorded so far.
"""

from __future__ import annotations

import functools
import math
import shlex
import signal
import sys
from pathlib import Path

from gdn_jax.models.mixers import MIXERS
from gdn_jax.sweep.cells import Plan, grid, refused_sets
from gdn_jax.sweep.results import FAILED, Results, SweepError
from gdn_jax.sweep.runner import TRAINERS, Job, Stop, Trainers, run_jobs
from gdn_jax.sweep.table import PLOT, TABLE, best_per_cell, check_outputs, write_plot, write_table
from gdn_jax.training.cli import (
    OneLineParser,
    missing_train_extra,
    report_error,
    run_command,
)
from gdn_jax.training.config_paths import resolve_config
from gdn_jax.training.errors import RunError
from gdn_jax.training.run_dir import RunLock, check_writable

PROG = "python -m gdn_jax.sweep"
# Each mixer's own config: the attention mixers' projections, Gated DeltaProduct's steps and
# eigenvalues and the recurrent mixers' gate laws are chosen per mixer (docs/benchmarks.md).
MIXER_CONFIG = "mqar_{mixer}.yaml"


def parse_args(argv):
    parser = OneLineParser(
        prog=PROG, description="Sweep MQAR recall over mixers, pairs and widths."
    )
    add = parser.add_argument
    add(
        "--config",
        default=MIXER_CONFIG,
        help="base config (path or packaged name); a {mixer} in it is each mixer's name, so "
        "that by default every mixer trains on its own packaged MQAR config",
    )
    add("--mixers", nargs="+", default=list(MIXERS), choices=list(MIXERS))
    add("--kv-pairs", nargs="+", type=int, default=[16, 32, 64])
    add("--d-models", nargs="+", type=int, default=[64])
    add("--learning-rates", nargs="+", type=float, default=[1e-3, 3e-3, 1e-2])
    add("--seeds", nargs="+", type=int, default=[0], help="train.seed of each run")
    add(
        "--best-rate-seeds",
        nargs="+",
        type=int,
        default=[],
        help="after the grid, train these seeds as well, each only at its cell's learning "
        "rate with the best mean over --seeds",
    )
    add("--layers", type=int, default=2)
    add("--steps", type=int, default=1300, help="step budget of every run")
    add("--set", action="append", default=[], help="extra override, repeatable")
    add("--jobs", type=int, default=1, help="training processes in parallel, one core each")
    add(
        "--batch-runs",
        type=int,
        default=8,
        help="at most this many runs of a cell that differ only in seed and learning rate "
        "train as one program in one process (1: a process per run)",
    )
    add("--retry-failed", action="store_true", help="train the failed runs again")
    add(
        "--table-only",
        action="store_true",
        help="train nothing: write the table and the plot from the runs recorded so far, "
        "those not trained yet counted as such (a sweep that spans several sittings)",
    )
    # Not docs/sweep, where the repository keeps the sweep it ships: run from a clone, a
    # default there rewrote the committed table and plot.
    add(
        "--out",
        default="runs/sweep",
        help="where results.jsonl, table.md and accuracy.png go (default %(default)s; the "
        "repository's own sweep is docs/sweep)",
    )
    add("--runs", default="runs/sweep", help="the runs' own directories")
    add(
        "--overwrite",
        action="store_true",
        help="replace a table.md or accuracy.png in --out that no sweep wrote",
    )
    return parser.parse_args(argv)


def check_args(args) -> None:
    """Raise ``SweepError`` for the first bad argument."""
    for name in ("jobs", "batch_runs", "steps", "layers"):
        if getattr(args, name) < 1:
            option = name.replace("_", "-")
            raise SweepError(f"--{option}={getattr(args, name)} must be at least 1")
    lists = {
        "--mixers": args.mixers,
        "--kv-pairs": args.kv_pairs,
        "--d-models": args.d_models,
        "--learning-rates": args.learning_rates,
        "--seeds": args.seeds,
        "--best-rate-seeds": args.best_rate_seeds,
    }
    for option, values in lists.items():
        repeated = sorted({v for v in values if values.count(v) > 1})
        if repeated:
            raise SweepError(f"{option} names {', '.join(map(str, repeated))} more than once")
    for option, values in (("--kv-pairs", args.kv_pairs), ("--d-models", args.d_models)):
        if min(values) < 1:
            raise SweepError(f"{option} {' '.join(map(str, values))}: each must be at least 1")
    for rate in args.learning_rates:
        if not (math.isfinite(rate) and rate > 0):
            raise SweepError(f"--learning-rates {rate}: each must be a finite number > 0")
    for option, seeds in (("--seeds", args.seeds), ("--best-rate-seeds", args.best_rate_seeds)):
        for seed in seeds:
            if not 0 <= seed < 2**32:
                raise SweepError(f"{option} {seed}: each must be in [0, 2**32)")
    both = sorted(set(args.seeds) & set(args.best_rate_seeds))
    if both:
        raise SweepError(f"--seeds and --best-rate-seeds both name {', '.join(map(str, both))}")
    refused = refused_sets(args.set)
    if refused:
        raise SweepError(refused[0])


def plan_jobs(args, seeds):
    """The job of every cell of the grid over ``seeds``, each cell's config checked; raises
    ``SweepError``."""
    configs = {}
    for mixer in args.mixers:
        try:
            configs[mixer] = resolve_config(args.config.replace("{mixer}", mixer))
        except ValueError as error:
            where = f" (the config of mixer {mixer})" if "{mixer}" in args.config else ""
            raise SweepError(f"{error}{where}") from None
    plan = Plan(configs, tuple(args.set), args.steps, args.layers, Path(args.runs).expanduser())

    def command_args(cell, items) -> tuple[str, ...]:  # --config and the --set items
        config = ("--config", str(configs[cell.mixer]))
        return (*config, *(x for item in items for x in ("--set", item)))

    jobs = []
    for cell in grid(args.mixers, args.kv_pairs, args.d_models, args.learning_rates, seeds):
        try:
            key = plan.key(cell)
        except (ValueError, OSError) as error:
            raise SweepError(f"run {cell.name}: {error}") from None
        run_dir = plan.run_dir(cell, key)
        alone = command_args(cell, plan.overrides(cell, run_dir))
        shared = command_args(cell, plan.shared_overrides(cell))
        jobs.append(Job(cell, key, run_dir, alone, shared, plan.run_values(cell, run_dir)))
    return jobs


def main(argv=None, *, trainers: Trainers = TRAINERS) -> int:
    """The sweep of ``argv`` (``sys.argv[1:]`` when None); returns the exit status.
    ``trainers`` are the commands that train one run and several (the tests give
    stand-ins)."""
    # Before the runs take the signals over, a Ctrl-C has trained nothing.
    return run_command(PROG, lambda args: _main(args, trainers), argv, before="any run started")


def _main(argv, trainers) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as done:  # --help, or an argument argparse refused (one line)
        return done.code

    fail = functools.partial(report_error, PROG)
    if (missing := missing_train_extra()) is not None:
        return fail(missing)

    try:
        check_args(args)
        out, runs = Path(args.out).expanduser(), Path(args.runs).expanduser()
        check_writable(out.absolute(), "--out")
        check_writable(runs.absolute(), "--runs")
        check_outputs(out, args.overwrite)
        # The later seeds' jobs at every rate too, so that each is checked before anything
        # trains; the grid is the jobs of --seeds.
        jobs = plan_jobs(args, [*args.seeds, *args.best_rate_seeds])
        later = [job for job in jobs if job.cell.seed in args.best_rate_seeds]
        grid_jobs = [job for job in jobs if job.cell.seed not in args.best_rate_seeds]
    except (SweepError, RunError) as error:
        return fail(error)
    out.mkdir(parents=True, exist_ok=True)
    try:
        with RunLock(out.absolute()):
            return _sweep(args, argv, (grid_jobs, later), out, trainers)
    except (SweepError, RunError) as error:
        return fail(error)


def _sweep(args, argv, phases, out: Path, trainers) -> int:
    """Train the grid's jobs, then those of ``--best-rate-seeds`` at each cell's best rate
    on the grid's seeds, then write the table and the plot."""
    grid_jobs, later = phases
    results = Results(out / "results.jsonl")
    warning = results.drop_torn_tail()
    if warning:
        print(warning, file=sys.stderr)
    if results.foreign:
        print(
            f"warning: {results.foreign} record(s) of {results.path} have no key (an older "
            "sweep wrote them): they are kept, and not shown",
            file=sys.stderr,
        )
    train = _train_phase if not args.table_only else lambda *_: None
    status = train(args, grid_jobs, results, trainers)
    if status is not None:
        return status
    grid_seeds = set(args.seeds)
    jobs = list(grid_jobs)
    if later:
        best = best_per_cell([(job.cell, results.records.get(job.key)) for job in grid_jobs])
        chosen = [job for job in later if job.cell.learning_rate == _rate(best, job)]
        print(f"--best-rate-seeds at each cell's best rate on --seeds: {len(chosen)} runs")
        status = train(args, chosen, results, trainers)
        if status is not None:
            return status
        jobs += chosen
    command = f"{PROG} {shlex.join(_training_argv(argv))}".strip()
    runs = [(job.cell, results.records.get(job.key)) for job in jobs]
    table = write_table(out / TABLE, runs, command, grid_seeds if later else None)
    write_plot(out / PLOT, table)
    print((out / TABLE).read_text())
    failed = sum(1 for _, r in runs if r is not None and r["status"] == FAILED)
    if failed:
        print(f"{failed} run(s) failed: see their errors in {results.path}", file=sys.stderr)
    return 0


def _training_argv(argv) -> list[str]:
    """``argv`` less ``--table-only`` and ``--overwrite``, however abbreviated (argparse
    takes any unique prefix of either): the command that trains the runs the table shows."""
    flags = ("--table-only", "--overwrite")
    return [a for a in argv if not (len(a) > 3 and any(f.startswith(a) for f in flags))]


def _rate(best: dict, job) -> float | None:
    """The learning rate ``best_per_cell`` chose for ``job``'s cell (None: no finished run)."""
    summary = best.get(job.cell.group)
    return summary["learning_rate"] if summary and summary["accuracies"] else None


def _train_phase(args, jobs, results, trainers) -> int | None:
    """Train the ``jobs`` without a record (or with a failed one, under ``--retry-failed``);
    the exit status when a signal stopped them, else None."""

    def to_train(job):
        record = results.records.get(job.key)
        return record is None or (args.retry_failed and record["status"] == FAILED)

    todo = [job for job in jobs if to_train(job)]
    print(f"{len(jobs)} runs: {len(jobs) - len(todo)} recorded, {len(todo)} to train", flush=True)
    stop = Stop()
    tally = run_jobs(todo, args.jobs, results, stop, trainers, batch_runs=args.batch_runs)
    if stop.signum is None:
        return None
    name = signal.Signals(stop.signum).name
    print(
        f"{PROG}: stopped by {name}: {tally.finished + tally.failed} run(s) recorded, "
        f"{tally.interrupted} stopped (each resumes from its checkpoint) and "
        f"{tally.not_started} not started; the same command goes on from there",
        file=sys.stderr,
    )
    return 128 + stop.signum
