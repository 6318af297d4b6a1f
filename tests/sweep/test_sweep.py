"""The recall sweep (``python -m gdn_jax.sweep``) as a user meets it: it resumes what it has
not finished, never records a run it did not finish or a failure as an accuracy, keeps runs
of other settings apart, and refuses bad arguments before it creates or trains anything.

The sweep runs in this process with a stand-in for the training commands
(``sweep_trainer.py``: one run, or several trained as one program), which writes what a run
writes in milliseconds; a Ctrl-C is sent to a sweep in a process group of its own, and one
sweep of the real batched command checks the stand-in's contract.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.runs import TINY
from sweep_trainer import accuracy, failure_line

import gdn_jax
from gdn_jax.sweep import cli
from gdn_jax.sweep.cells import SWEEP_FIELDS, Cell, Plan
from gdn_jax.sweep.runner import Trainers, batches
from gdn_jax.training import batched_cli
from gdn_jax.training.config import load_config

TRAINER = (sys.executable, str(Path(__file__).with_name("sweep_trainer.py")))
STAND_INS = Trainers(TRAINER, TRAINER)
GRID = ["--mixers", "gdn", "kda", "--kv-pairs", "4", "--d-models", "16", "--steps", "200"]
GRID += ["--learning-rates", "0.01", "0.03", "--seeds", "0", "1"]


@pytest.fixture
def sweep(tmp_path, monkeypatch, capsys):
    """``sweep(*args)`` runs the sweep into ``tmp_path`` with the stand-in trainer; returns
    ``(status, stdout, stderr, trained)``, ``trained`` the stand-in's log lines of this call."""
    log = tmp_path / "trained.log"
    monkeypatch.setenv("SWEEP_TRAINER_LOG", str(log))
    monkeypatch.chdir(tmp_path)

    def run(*args):
        before = log.read_text().splitlines() if log.exists() else []
        status = cli.main([*args], trainers=STAND_INS)
        out, err = capsys.readouterr()
        after = log.read_text().splitlines() if log.exists() else []
        return status, out, err, after[len(before) :]

    return run


def records(out="out"):
    return [json.loads(line) for line in Path(out, "results.jsonl").read_text().splitlines()]


def trained_config(job):
    """The config the training command would run ``job`` with."""
    sets = [job.args[i + 1] for i, a in enumerate(job.args) if a == "--set"]
    return load_config(job.args[1], sets)


def processes(tmp_path):
    """The runs of each call of the stand-in so far, by name."""
    return [line.split() for line in (tmp_path / "trained.log.processes").read_text().splitlines()]


def test_batches_keep_a_cell_together_and_give_every_worker_an_equal_share():
    """A process trains the runs of one table cell that all resume or all start afresh, at
    most --batch-runs of them; a batch is halved while the workers' shares are unequal."""
    args = cli.parse_args([*GRID, "--seeds", "0", "1", "2"])
    plan = cli.plan_jobs(args, args.seeds)  # 2 cells x 6 runs
    resume = [(job, False) for job in plan]

    def sizes(jobs, size, workers):
        found = batches(jobs, size, workers)
        assert [job for batch, _ in found for job in batch] == [job for job, _ in jobs]
        for batch, _ in found:
            assert len({job.cell.group for job in batch}) == 1
        return [len(batch) for batch, _ in found]

    assert sizes(resume, 8, 1) == [6, 6]
    assert sizes(resume, 4, 1) == [3, 3, 3, 3]
    assert sizes(resume, 8, 2) == [6, 6]
    assert sizes(resume, 8, 3) == [3, 3, 6]
    assert sizes(resume[:6], 8, 2) == [3, 3] and sizes(resume[:1], 8, 2) == [1]
    mixed = [(job, i % 2 == 0) for i, (job, _) in enumerate(resume[:6])]
    assert [(len(b), r) for b, r in batches(mixed, 8, 1)] == [(3, True), (3, False)]


def test_the_stand_in_fails_a_run_as_the_batched_command_does():
    assert failure_line("runs/a", "loss is nan") == batched_cli.failure_line(
        "runs/a", "loss is nan"
    )


@pytest.mark.parametrize(("batch", "calls"), [([], [4, 4]), (["--batch-runs", "1"], [1] * 8)])
def test_a_sweep_records_every_run_and_a_rerun_trains_nothing(sweep, tmp_path, batch, calls):
    """By default the four runs of each mixer (two learning rates, two seeds) train in one
    process; with --batch-runs 1, each in its own."""
    status, out, err, trained = sweep(*GRID, *batch, "--out", "out", "--runs", "runs")
    assert status == 0, err
    assert len(trained) == 8 and all(line.endswith("--overwrite") for line in trained)
    assert [len(names) for names in processes(tmp_path)] == calls
    rows = records()
    assert {(r["mixer"], r["learning_rate"], r["seed"]) for r in rows} == {
        (m, lr, s) for m in ("gdn", "kda") for lr in (0.01, 0.03) for s in (0, 1)
    }
    assert all(r["status"] == "finished" for r in rows)
    assert {r["accuracy"] for r in rows} == {accuracy(lr, s) for lr in (0.01, 0.03) for s in (0, 1)}
    table = Path("out", "table.md").read_text()
    assert table.startswith(
        f"Command: `python -m gdn_jax.sweep {' '.join([*GRID, *batch])} --out out --runs runs`"
    )
    mean = (accuracy(0.03, 0) + accuracy(0.03, 1)) / 2
    row = (
        f"| gdn | {mean:.3f} ({accuracy(0.03, 1):.3f}-{accuracy(0.03, 0):.3f}, 2 seeds) [lr 0.03] |"
    )
    assert row in table, table
    # Neither reached its target: seed 0's run ended flat, seed 1's gained 0.05 at the end.
    assert "| gdn | 1 plateau, 1 rising |" in table, table
    assert "| gdn | none of 2 runs |" in table, table
    assert rows[0]["reason"] == "steps" and rows[0]["final_step"] == 200
    assert [step for step, _ in rows[0]["evals"]] == [100, 200]
    assert Path("out", "accuracy.png").stat().st_size > 0
    # Every run has a directory of its own.
    assert len({r["key"] for r in rows}) == 8 and len(list(Path("runs").iterdir())) == 8

    status, out, err, trained = sweep(*GRID, *batch, "--out", "out", "--runs", "runs")
    assert status == 0 and trained == [] and "8 runs: 8 recorded, 0 to train" in out
    assert Path("out", "table.md").read_text() == table


def test_later_seeds_train_only_at_each_cells_best_rate_on_the_grid_seeds(sweep):
    """A grid on seed 0, then seeds 1 and 2 at each cell's best rate. Both rates give seed 0
    the stand-in's accuracy 1.0, so the smaller is chosen; the other rate's mean over all its
    seeds (seed 0 alone) would beat the chosen one's over three, and the table still shows
    the chosen rate, over its three seeds."""
    grid = [*GRID[: GRID.index("--learning-rates")], "--learning-rates", "0.05", "0.06"]
    grid += ["--seeds", "0", "--best-rate-seeds", "1", "2", "--out", "out"]
    status, out, err, trained = sweep(*grid)
    assert status == 0, err
    assert "4 runs: 0 recorded, 4 to train" in out and "--best-rate-seeds" in out
    names = sorted(line.split()[0].rsplit("_", 1)[0] for line in trained)  # less the key
    assert names == sorted(
        f"{m}_kv4_d16_lr{lr:g}_seed{s}"
        for m in ("gdn", "kda")
        for lr, s in [(0.05, 0), (0.06, 0), (0.05, 1), (0.05, 2)]
    )
    rows = records()
    assert sorted((r["learning_rate"], r["seed"]) for r in rows if r["mixer"] == "gdn") == [
        (0.05, 0), (0.05, 1), (0.05, 2), (0.06, 0)
    ]  # fmt: skip
    accuracies = [accuracy(0.05, s) for s in (0, 1, 2)]
    mean = sum(accuracies) / 3
    table = Path("out", "table.md").read_text()
    assert "best mean over seed(s) 0:" in table, table
    row = f"| gdn | {mean:.3f} ({min(accuracies):.3f}-{max(accuracies):.3f}, 3 seeds) [lr 0.05] |"
    assert row in table, table
    assert "| gdn | 1 plateau, 2 target |" in table, table  # 1.0 and 0.99 stop; 0.98 does not
    assert "| gdn | 200 (200-200), 2 of 3 runs |" in table, table  # the stand-in stops at the end

    status, out, err, trained = sweep(*grid)
    assert status == 0 and trained == [], err
    assert Path("out", "table.md").read_text() == table


def test_table_only_trains_nothing_and_counts_the_runs_not_trained_yet(sweep):
    """A sweep that spans sittings: ``--table-only`` writes the table and the plot from the
    runs recorded so far, under the command that trains them, each cell's runs still to
    train counted, and trains nothing."""
    grid = [*GRID[: GRID.index("--seeds")], "--mixers", "gdn", "--out", "out"]
    status, _, err, trained = sweep(*grid, "--seeds", "0")
    assert status == 0 and len(trained) == 2, err
    for made in ("table.md", "accuracy.png"):
        Path("out", made).unlink()
    full = [*grid, "--seeds", "0", "--best-rate-seeds", "1", "2"]
    status, out, err, trained = sweep(*full, "--table-only")
    assert status == 0 and trained == [], err
    assert len(records()) == 2 and Path("out", "accuracy.png").exists()
    table = Path("out", "table.md").read_text()
    assert table.startswith(f"Command: `python -m gdn_jax.sweep {' '.join(full)}`"), table
    best = max((0.01, 0.03), key=lambda lr: (accuracy(lr, 0), -lr))
    row = f"| gdn | {accuracy(best, 0):.3f} [lr {best:g}] (2 not run yet) |"
    assert row in table, table
    status, _, err, trained = sweep(*full, "--table-o")  # argparse's abbreviation of it
    assert status == 0 and trained == [], err
    assert Path("out", "table.md").read_text() == table


def test_the_default_out_is_no_folder_of_the_repository(sweep, tmp_path):
    """--out was docs/sweep: from a clone, --table-only rewrote the committed table.md and
    accuracy.png, and every sweep read the shipped results.jsonl."""
    status, out, err, trained = sweep("--table-only", *GRID)
    assert status == 0 and not trained, err
    assert sorted(os.listdir(tmp_path)) == ["runs"]  # the stand-in's log aside: none yet
    assert {"table.md", "accuracy.png"} <= set(os.listdir(tmp_path / "runs" / "sweep"))


def test_a_table_or_plot_the_sweep_did_not_write_is_refused_unless_overwrite(sweep):
    """``--out`` may be a folder of the user's: a table.md or accuracy.png there that no
    sweep wrote is one line and kept; the sweep's own it replaces on every run."""
    Path("out").mkdir()
    Path("out", "table.md").write_text("MINE\n")
    Path("plot.png").write_bytes(b"mine")
    Path("out", "accuracy.png").symlink_to(Path("plot.png").absolute())
    args = ["--table-only", *GRID, "--out", "out"]
    status, out, err, trained = sweep(*args)
    assert (status, out, trained) == (2, "", [])
    assert err == (
        "python -m gdn_jax.sweep: error: --out out holds table.md, accuracy.png, which no "
        "sweep wrote there (no record in out/.gdn_jax-sweep); move it away, or replace it "
        "with --overwrite\n"
    )
    assert sorted(os.listdir("out")) == ["accuracy.png", "table.md"]
    assert Path("out", "table.md").read_text() == "MINE\n"
    assert Path("plot.png").read_bytes() == b"mine"

    status, _, err, _ = sweep(*args, "--overwrite")
    assert status == 0, err
    table = Path("out", "table.md").read_text()
    assert table.startswith(f"Command: `python -m gdn_jax.sweep {' '.join(GRID)} --out out`")
    assert Path("plot.png").read_bytes() == b"mine"  # the link was replaced, not its target
    status, _, err, _ = sweep(*args)  # its own table and plot: replaced without a word
    assert (status, err) == (0, "")


def test_a_tilde_in_the_sweeps_paths_is_the_home(sweep, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    status, _, err, trained = sweep(*GRID, "--out", "~/out", "--runs", "~/runs")
    assert status == 0 and len(trained) == 8, err
    assert {"results.jsonl", "table.md"} <= set(os.listdir(tmp_path / "home" / "out"))
    assert (tmp_path / "home" / "runs").is_dir() and not (tmp_path / "~").exists()


def test_other_settings_train_their_own_runs_and_the_table_shows_them(sweep):
    assert sweep(*GRID, "--out", "out")[0] == 0
    status, _, err, trained = sweep(*GRID, "--out", "out", "--set", "train.eval_every=4")
    assert status == 0, err and len(trained) == 8
    grid = [*GRID[: GRID.index("--steps")], "--steps", "300", *GRID[GRID.index("--steps") + 2 :]]
    status, _, err, trained = sweep(*grid, "--out", "out")
    assert status == 0, err and len(trained) == 8
    rows = records()
    assert len(rows) == 24 and len({r["key"] for r in rows}) == 24
    assert (
        Path("out", "table.md")
        .read_text()
        .startswith(f"Command: `python -m gdn_jax.sweep {' '.join(grid)} --out out`")
    )


def test_each_mixer_trains_on_its_own_config_unless_one_is_named():
    """By default ``--config mqar_{mixer}.yaml``: the attention mixer keeps its own
    projections' init and Gated DeltaProduct its two steps with negative eigenvalues; a
    config without ``{mixer}`` is every mixer's base."""
    mixers = ["gdn", "attention", "gated_deltaproduct"]
    args = cli.parse_args(["--mixers", *mixers, "--kv-pairs", "4", "--d-models", "16"])
    jobs = {job.cell.mixer: job for job in cli.plan_jobs(args, args.seeds)}
    for mixer, job in jobs.items():
        assert job.args[:2] == ("--config", str(cli.resolve_config(f"mqar_{mixer}.yaml")))
    model = {m: trained_config(job).model for m, job in jobs.items()}
    assert model["attention"].mixer_init_std is None and model["gdn"].mixer_init_std == 0.02
    assert model["gated_deltaproduct"].allow_neg_eigval is True
    one = cli.parse_args(["--mixers", *mixers, "--config", "mqar_gdn.yaml"])
    for job in cli.plan_jobs(one, one.seeds):
        assert job.args[:2] == ("--config", str(cli.resolve_config("mqar_gdn.yaml")))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--jobs", "0"], r"--jobs=0 must be at least 1"),
        (["--jobs", "-1"], r"--jobs=-1 must be at least 1"),
        (["--batch-runs", "0"], r"--batch-runs=0 must be at least 1"),
        (["--steps", "0"], r"--steps=0 must be at least 1"),
        (["--layers", "0"], r"--layers=0 must be at least 1"),
        (["--kv-pairs", "0"], r"--kv-pairs 0: each must be at least 1"),
        (["--kv-pairs", "4", "4"], r"--kv-pairs names 4 more than once"),
        (["--learning-rates", "-1"], r"--learning-rates -1.0: each must be a finite number > 0"),
        (["--learning-rates", "nan"], r"--learning-rates nan: each must be a finite number > 0"),
        (["--steps", "x"], r"argument --steps: invalid int value: 'x'"),
        (["--kv-pairs", "100"], r"run gdn_kv100_d64_lr0.001_seed0: num_kv_pairs=100 needs"),
        (
            ["--set", "train.learning_rate=0.5"],
            r"--set train.learning_rate=0.5: the sweep sets train.learning_rate \(from "
            r"--learning-rates\)",
        ),
        (["--set", "train.out_dir=runs/x"], r"the sweep sets train.out_dir \(from --runs\)"),
        (["--set", "train.seed=3"], r"the sweep sets train.seed \(from --seeds\)"),
        (["--best-rate-seeds", "0"], r"--seeds and --best-rate-seeds both name 0"),
        (["--best-rate-seeds", "-1"], r"--best-rate-seeds -1: each must be in \[0, 2\*\*32\)"),
        (
            ["--config", "nosuch_{mixer}.yaml"],
            r"--config nosuch_gdn.yaml: no such file, .*\(the config of mixer gdn\)$",
        ),
    ],
)
def test_bad_arguments_are_one_line_before_anything_is_made(sweep, tmp_path, args, message):
    status, out, err, trained = sweep("--mixers", "gdn", *args, "--out", "out")
    assert status == 2 and trained == [] and out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("python -m gdn_jax.sweep: error: ") and re.search(message, err), err
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists()


def test_an_out_that_is_a_file_or_not_writable_is_refused(sweep, tmp_path, monkeypatch):
    Path("taken").write_text("mine")
    status, _, err, _ = sweep(*GRID, "--out", "taken")
    assert status == 2 and "--out=" in err and "exists and is not a directory" in err
    assert Path("taken").read_text() == "mine"
    # Root ignores permission bits: the check writes a probe file, which a read-only
    # filesystem refuses (simulated for the directory "ro").
    import tempfile

    real = tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):
        if Path(dir).name == "ro":
            raise OSError(30, "Read-only file system")
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    Path("ro").mkdir()
    for option, other in (("--out", "--runs"), ("--runs", "--out")):
        status, _, err, trained = sweep(*GRID, option, "ro/x", other, "fine")
        assert status == 2 and trained == [], err
        assert f"{option}=" in err and "is not writable: Read-only file system" in err
    assert not (tmp_path / "fine").exists() and list(Path("ro").iterdir()) == []


def test_failed_runs_are_recorded_as_failures_and_shown_as_failed(sweep):
    grid = ["--mixers", "gdn", "linear", "--kv-pairs", "4", "--d-models", "16", "--steps", "200"]
    grid += ["--learning-rates", "0.01", "--out", "out"]
    status, _, err, trained = sweep(*grid)
    assert status == 0 and len(trained) == 2
    assert "1 run(s) failed" in err
    failed = [r for r in records() if r["mixer"] == "linear"]
    assert failed == [dict(failed[0], status="failed", error=failed[0]["error"])]
    assert "accuracy" not in failed[0]
    assert (
        failed[0]["error"] == "train.py: error: loss is nan at step 2; no checkpoint was saved yet"
    )
    assert "| linear | failed |" in Path("out", "table.md").read_text()
    assert sweep(*grid)[3] == []  # a failure is a result
    assert sweep(*grid, "--retry-failed")[3] == [trained[1]]


def test_a_run_that_fails_among_batched_runs_is_recorded_alone_as_failed(sweep, tmp_path):
    """The stand-in's runs above a learning rate of 0.5 diverge; the others of their process
    finish, and --retry-failed trains only the failed ones again, together."""
    grid = ["--mixers", "gdn", "--kv-pairs", "4", "--d-models", "16", "--steps", "200"]
    grid += ["--learning-rates", "0.01", "0.9", "--seeds", "0", "1", "--out", "out"]
    status, _, err, trained = sweep(*grid)
    assert status == 0 and len(trained) == 4 and "2 run(s) failed" in err
    assert [len(names) for names in processes(tmp_path)] == [4]
    rows = {(r["learning_rate"], r["seed"]): r for r in records()}
    for seed in (0, 1):
        assert rows[0.01, seed]["status"] == "finished"
        assert rows[0.01, seed]["accuracy"] == accuracy(0.01, seed)
        assert rows[0.01, seed]["runs_in_process"] == 4 and rows[0.01, seed]["wall_s"] >= 0
        failed = rows[0.9, seed]
        assert failed["status"] == "failed" and "accuracy" not in failed
        run_dir = next(Path("runs/sweep").glob(f"gdn_kv4_d16_lr0.9_seed{seed}_*"))
        assert failed["error"] == failure_line(
            str(run_dir), "loss is nan at step 3; no checkpoint was saved yet"
        )
    assert "| gdn | 0.595 (0.590-0.600, 2 seeds) [lr 0.01] |" in Path("out", "table.md").read_text()
    assert sweep(*grid)[3] == []  # a failure is a result
    retried = sweep(*grid, "--retry-failed")[3]
    assert sorted(retried) == sorted(t for t in trained if "lr0.9" in t)
    assert processes(tmp_path)[-1] == [line.split()[0] for line in retried]


def test_a_torn_last_line_is_dropped_with_one_warning_and_its_run_trained_again(sweep):
    grid = [*GRID[:12], "--seeds", "0", "--out", "out"]  # 4 runs
    assert sweep(*grid)[0] == 0
    lines = Path("out", "results.jsonl").read_text().splitlines()
    Path("out", "results.jsonl").write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])
    status, _, err, trained = sweep(*grid)
    assert status == 0 and len(trained) == 1
    (warning,) = err.strip().splitlines()
    assert warning.startswith("warning: dropped the torn last line of out/results.jsonl")
    assert len(records()) == 4


def test_a_record_damaged_before_the_last_line_stops_the_sweep_in_one_line(sweep):
    Path("out").mkdir()
    Path("out", "results.jsonl").write_text("{oops\n{}\n")
    status, _, err, trained = sweep(*GRID, "--out", "out")
    assert status == 2 and trained == []
    assert "out/results.jsonl cannot be read: line 1 is not JSON" in err


@pytest.mark.parametrize(
    ("field", "problem"),
    [
        ('"accuracy": "high"', "accuracy='high', not a number in [0, 1]"),
        ('"accuracy": 1.5', "accuracy=1.5, not a number in [0, 1]"),
        ('"status": "done"', "status='done', not 'finished' or 'failed'"),
    ],
)
def test_a_record_with_a_bad_field_stops_the_sweep_in_one_line(sweep, field, problem):
    """A finished run's accuracy of "high" was a raw TypeError from statistics.fmean."""
    Path("out").mkdir()
    record = {"key": "k", "status": "finished", "accuracy": 0.5}
    record.update(json.loads("{" + field + "}"))
    Path("out", "results.jsonl").write_text(json.dumps(record) + "\n")
    status, _, err, trained = sweep(*GRID, "--out", "out", "--table-only")
    assert status == 2 and trained == []
    (line,) = err.strip().splitlines()
    assert line == f"{cli.PROG}: error: out/results.jsonl cannot be read: line 1 has {problem}"


def test_table_only_before_any_run_writes_an_empty_plot_that_says_so(sweep):
    """Matplotlib warned "No artists with labels found to put in legend"."""
    status, _, err, trained = sweep(*GRID, "--out", "out", "--table-only")
    assert status == 0 and trained == [] and err == "", err
    assert Path("out", "accuracy.png").stat().st_size > 0


@pytest.mark.costly(7)
def test_ctrl_c_stops_the_sweep_records_nothing_it_stopped_and_a_rerun_resumes(tmp_path):
    """SIGINT to the sweep's process group, as a terminal's Ctrl-C sends it, while two
    processes (two jobs) train the two runs of a mixer each and two more mixers' wait: exit
    130, one line, no record; the same command then resumes the stopped runs from their
    checkpoints and trains the rest."""
    started = 4
    log = tmp_path / "trained.log"
    env = dict(os.environ, SWEEP_TRAINER_LOG=str(log), SWEEP_TRAINER_SLOW="60")
    code = "import sys; from gdn_jax.sweep import cli, runner; sys.exit(cli.main(sys.argv[2:], trainers=runner.Trainers(*eval(sys.argv[1]))))"
    args = ["--mixers", "gdn", "kda", "deltanet", "simple_gla", *GRID[3:12], "--seeds", "0"]
    args += ["--jobs", "2"]
    args += ["--out", "out", "--runs", "runs"]
    command = [sys.executable, "-c", code, repr((TRAINER, TRAINER)), *args]
    sweep = subprocess.Popen(
        command, cwd=tmp_path, env=env, start_new_session=True, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (log.exists() and len(log.read_text().splitlines()) == started):
            assert time.monotonic() < deadline and sweep.poll() is None, sweep.communicate()
            time.sleep(0.05)
        os.killpg(sweep.pid, signal.SIGINT)
        out, err = sweep.communicate(timeout=60)  # a guard against a hang
    finally:
        sweep.kill()
    assert sweep.returncode == 130, err
    (line,) = err.strip().splitlines()
    assert line == (
        f"python -m gdn_jax.sweep: stopped by SIGINT: 0 run(s) recorded, {started} stopped (each "
        "resumes from its checkpoint) and 4 not started; the same command goes on from there"
    )
    assert not (tmp_path / "out" / "results.jsonl").exists()
    assert not (tmp_path / "out" / "table.md").exists()
    env["SWEEP_TRAINER_SLOW"] = "0"
    rerun = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert rerun.returncode == 0, rerun.stderr
    trained = log.read_text().splitlines()
    stopped = trained[:started]
    assert sorted(trained[started:]) == sorted(
        [line.replace("--overwrite", "--resume") for line in stopped]
        + [line for line in trained[started:] if line.endswith("--overwrite")]
    )
    assert sum(line.endswith("--resume") for line in trained[started:]) == started
    assert len(records(tmp_path / "out")) == 8
    assert [len(names) for names in processes(tmp_path)] == [2] * 6  # 2 stopped, 4 to the end


@pytest.mark.slow
@pytest.mark.costly(12)
def test_runs_of_the_real_command_are_recorded(sweep):
    """The stand-in's contract, kept by the batched command itself: two tiny runs in one
    process."""
    sets = [item for item in TINY if item.split("=")[0] not in SWEEP_FIELDS]
    args = ["--mixers", "gdn", "--kv-pairs", "4", "--d-models", "16"]
    args += ["--learning-rates", "0.01", "0.03", "--steps", "12", "--layers", "1", "--out", "out"]
    for item in sets:
        args += ["--set", item]
    status = cli.main(args)  # the real commands
    assert status == 0
    rows = records()
    assert [row["learning_rate"] for row in rows] == [0.01, 0.03]
    for row in rows:
        assert row["status"] == "finished" and row["runs_in_process"] == 2
        assert 0 <= row["accuracy"] <= 1 and row["best_step"] in (6, 12)
        assert row["reason"] in ("target", "steps") and row["final_step"] in (6, 12)
        assert max(accuracy for _, accuracy in row["evals"]) == pytest.approx(row["accuracy"])


def test_a_field_added_later_keeps_the_recorded_runs_keys(tmp_path):
    """``ModelConfig.low_rank_gates`` came after runs were recorded: at the value they all had
    it stays out of the key (their records and directories still match); set otherwise, it
    is a run of its own."""
    configs = {"kda": Path(gdn_jax.__file__).parent / "configs" / "mqar_kda.yaml"}
    cell = Cell(mixer="kda", kv_pairs=16, d_model=64, learning_rate=3e-3, seed=0)

    def plan(*sets):
        return Plan(configs=configs, sets=sets, steps=200, layers=2, runs=tmp_path)

    assert "low_rank_gates" not in plan().resolved(cell)["model"]
    assert plan("model.low_rank_gates=true").key(cell) == plan().key(cell)
    assert plan("model.low_rank_gates=false").key(cell) != plan().key(cell)
