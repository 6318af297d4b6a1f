"""The training command as a user meets it: nothing a user made is lost or mixed.

Each test drives the command with a tiny config and checks the exit status, the one-line
message (never a traceback) and the files left behind. The command runs in this process
(the ``command`` fixture), as ``python train.py`` would run it: refusals on fake run
directories (``fake_run``), trainings, resumes and signals (sent to this process while the
loop holds them) on real ones. A subprocess is kept for what needs a fresh interpreter: a
device count, the script's own name.
"""

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
from support.runs import INTERRUPTED, REPO, TINY, command_args, logged, train


def one_line_error(result, pattern, status=2):
    """The command failed with ``status`` and exactly one line on stderr matching ``pattern``;
    a refusal (status 2) prints nothing else, the header lines included."""
    assert result.returncode == status, result.stderr
    assert "Traceback" not in result.stderr
    if status == 2:
        assert result.stdout == "", result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("train.py: error: "), lines[0]
    assert re.search(pattern, lines[0]), lines[0]


@pytest.fixture
def command(monkeypatch, capsys):
    """The command on the tiny config into ``out_dir`` (``None``: the arguments alone, on the
    default config), run in this process like
    ``runs.train`` runs it in a subprocess, with the same result fields and numbers (the
    session's float64 mode is off, as in a fresh interpreter): for the cases that need no
    fresh interpreter, where a subprocess would cost an interpreter start, a JAX import and a
    trace of the train step, and test nothing more. ``signal=(signum, step)`` sends
    ``signum`` to this process after that step, as a user's Ctrl-C or a scheduler's SIGTERM
    arrives."""
    import jax

    from gdn_jax.training import cli, loop

    monkeypatch.setattr(sys, "argv", ["train.py"])
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main appends to it
    for name in (
        "TPU_ACCELERATOR_TYPE",
        "TPU_WORKER_HOSTNAMES",
        "TPU_LOG_DIR",
    ):  # --compile-only sets them
        # setenv records the variable as it was, set or not, for the undo; delenv then
        # leaves it as it was until the command runs.
        monkeypatch.setenv(name, os.environ.get(name, ""))
        if not os.environ[name]:
            monkeypatch.delenv(name)

    def run(out_dir, *extra, sets=(), signal=None):
        argv = command_args(out_dir, *extra, sets=sets) if out_dir else [*extra]
        with monkeypatch.context() as patch, jax.enable_x64(False):
            if signal is not None:
                signum, at_step = signal

                def send(step, metrics):
                    if step == at_step:
                        os.kill(os.getpid(), signum)

                original = loop.run
                patch.setattr(loop, "run", lambda *a, **k: original(*a, callbacks=[send], **k))
            with jax.numpy_dtype_promotion("standard"):  # optax mixes float and int32 in Adam
                status = cli.main(argv)
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["train.py", *argv], status, out, err)

    return run


def snapshot(directory):
    return {p.relative_to(directory): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


def fake_run(out_dir, *, steps=(4,), summary=None, **config_changes):
    """A run directory as a finished or interrupted run leaves it, without training: the
    refusals under test read only its names, config.yaml and summary.json."""
    from gdn_jax.training.config import load_config, to_dict
    from gdn_jax.training.run_dir import write_config

    config = to_dict(
        load_config(REPO / "configs" / "mqar_gdn.yaml", [*TINY, f"train.out_dir={out_dir}"])
    )
    for dotted, value in config_changes.items():
        section, field = dotted.split("__")
        config[section][field] = value
    out_dir.mkdir(parents=True)
    write_config(out_dir, config)
    (out_dir / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 4.0}\n')
    for step in steps:
        (out_dir / "checkpoints" / str(step)).mkdir(parents=True)
        (out_dir / "checkpoints" / str(step) / "_CHECKPOINT_METADATA").write_text("{}")
    if summary is not None:
        (out_dir / "summary.json").write_text(json.dumps(summary))
    return snapshot(out_dir)


@pytest.mark.parametrize(
    ("sets", "pattern"),
    [
        (["model.d_modle=3"], r"unknown config key\(s\) \['model.d_modle'\]"),
        (["train.seed=-1"], r"train.seed=-1 must be in \[0, 2\*\*32\)"),
        (["train.learning_rate=.inf"], r"train.learning_rate=inf must be finite"),
        (["train.steps=[1"], r"--set 'train.steps=\[1': malformed YAML at line 1, column 3"),
        (
            ["model.param_dtype=float16"],
            r"model.param_dtype=float16 cannot be trained: AdamW keeps its moments in the "
            r"parameters' dtype, .* use bfloat16",
        ),
        (  # the command runs as a fresh interpreter does, with 64-bit mode off
            ["model.dtype=float64"],
            r"ModelConfig.dtype='float64': needs JAX's 64-bit mode, which is off",
        ),
        (
            ["data.num_kv_pairs=2"],
            r"holds an earlier run \(config.yaml, metrics.jsonl, "
            r"checkpoints \(steps 4\)\); continue it with --resume or delete it with --overwrite",
        ),
    ],
)
def test_a_refused_run_leaves_the_earlier_run_untouched(tmp_path, command, sets, pattern):
    before = fake_run(tmp_path / "run")
    one_line_error(command(tmp_path / "run", sets=sets), pattern)
    assert snapshot(tmp_path / "run") == before


def test_malformed_yaml_config_names_line_and_column(tmp_path, command):
    config = tmp_path / "bad.yaml"
    config.write_text("model:\n  d_model: 64\n   heads: [2\n")
    result = command(tmp_path / "run", "--config", str(config))
    one_line_error(result, r"bad.yaml: malformed YAML at line 3, column 9")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("text", ["", "# nothing yet\n\n"])
def test_an_empty_config_file_is_refused_not_trained_as_the_defaults(tmp_path, command, text):
    config = tmp_path / "empty.yaml"
    config.write_text(text)
    result = command(tmp_path / "run", "--config", str(config))
    one_line_error(
        result, r"empty.yaml: the file holds no settings \(it is empty or only comments\)"
    )
    assert not (tmp_path / "run").exists()


def test_a_users_own_config_yaml_in_out_dir_is_refused_and_kept(tmp_path, command):
    """It was deleted as what a run leaves when it dies before its first checkpoint: that
    rule read the file names only."""
    out = tmp_path / "proj"
    out.mkdir()
    (out / "config.yaml").write_text("my_setting: 42\n")
    (out / "notes.txt").write_text("mine too")
    before = snapshot(out)
    one_line_error(
        command(out),
        r"proj/config.yaml does not begin with the line a run writes first \('# gdn_jax run: "
        r".*so it may be a file of your own; move it away, or delete it with --overwrite$",
    )
    assert snapshot(out) == before


def test_an_error_that_tracing_the_model_raises_comes_before_any_write(tmp_path, command):
    """Config.validate passes it; tracing the model raised it after the run directory, its
    config.yaml and checkpoints/ were made, as a 57-line traceback."""
    # The kernel takes chunks of 64 only (with a JAX older than 0.11 it runs not at all).
    result = command(tmp_path / "run", sets=["model.impl=mosaic_gpu", "model.chunk_size=32"])
    one_line_error(
        result, r"gated_delta_rule: impl='mosaic_gpu' cannot take these inputs: .*runs chunks of 64"
    )
    assert not (tmp_path / "run").exists()


def test_an_error_that_building_the_model_raises_comes_before_any_write(
    tmp_path, monkeypatch, command
):
    from gdn_jax.training import state

    def refuses(*args, **kwargs):
        raise TypeError("GatedDeltaNet: rngs=0 must be an nnx.Rngs")

    monkeypatch.setattr(state, "LanguageModel", refuses)
    one_line_error(command(tmp_path / "run"), r"GatedDeltaNet: rngs=0 must be an nnx.Rngs$")
    assert not (tmp_path / "run").exists()


def test_a_tilde_in_out_dir_and_config_is_the_home(tmp_path, monkeypatch, command):
    """``~`` was kept literally: the run wrote into a folder named ``~`` in the working
    directory while printing ``out: ~/x``, and ``--config ~/my.yaml`` was no such file."""
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    fake_run(home / "x")  # an earlier run there: the refusal names where the run looked
    one_line_error(command("~/x"), rf"error: {home}/x holds an earlier run")
    fake_run(home / "y")
    (home / "my.yaml").write_text("train:\n  out_dir: ~/y\n")
    tiny = [x for item in TINY for x in ("--set", item)]
    one_line_error(
        command(None, "--config", "~/my.yaml", *tiny), rf"error: {home}/y holds an earlier run"
    )
    assert os.listdir(work) == []


def test_out_dir_problems_are_one_line(tmp_path, command):
    # YAML reads the empty value as null: that was "None must be of type str".
    one_line_error(
        command(None, "--set", "train.out_dir="), r"train.out_dir='' must name a directory"
    )
    (tmp_path / "file").write_text("mine")
    one_line_error(command(tmp_path / "file"), r"exists and is not a directory")
    one_line_error(command(tmp_path / "file" / "run"), r"is not a directory")
    assert (tmp_path / "file").read_text() == "mine"


def test_a_read_only_out_dir_is_caught_before_anything_is_written(tmp_path, monkeypatch):
    # Root ignores permission bits, so the check writes a probe file; simulate the
    # read-only filesystem that makes it fail.
    import tempfile

    from gdn_jax.training.errors import RunError
    from gdn_jax.training.run_dir import check_writable

    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    with pytest.raises(RunError, match=r"run is not writable: Read-only file system"):
        check_writable(tmp_path / "run")


def test_a_batch_that_does_not_split_over_the_devices_writes_nothing(tmp_path, subprocess_env):
    result = train(
        subprocess_env, tmp_path / "run", XLA_FLAGS="--xla_force_host_platform_device_count=3"
    )
    one_line_error(result, r"train.batch_size=8 does not divide over the 3 devices")
    assert not (tmp_path / "run").exists()


def test_resume_refuses_a_different_setup_with_a_one_line_diff(tmp_path, command):
    before = fake_run(tmp_path / "run")
    result = command(
        tmp_path / "run",
        "--resume",
        sets=["data.num_kv_pairs=2", "train.seed=3", "train.steps=20"],
    )
    one_line_error(
        result, r"different setup \(data.num_kv_pairs: 4 -> 2; train.seed: 0 -> 3\); only "
    )
    assert snapshot(tmp_path / "run") == before


def test_resume_with_nothing_to_resume_and_of_a_finished_run(tmp_path, command):
    one_line_error(
        command(tmp_path / "none", "--resume"),
        r"nothing to resume in \S+ \(it holds no run\); start it afresh",
    )
    assert not (tmp_path / "none").exists()
    summary = dict(final_step=12, eval_accuracy=0.5, eval_loss=1.0, reason="steps")
    before = fake_run(tmp_path / "done", steps=(8, 12), summary=summary)
    result = command(tmp_path / "done", "--resume")
    assert result.returncode == 0, result.stderr
    assert "has finished (step 12, held-out accuracy 0.5000); nothing to resume" in result.stdout
    assert snapshot(tmp_path / "done") == before


def test_a_live_run_keeps_a_second_writer_out_and_a_stale_lock_is_taken_over(tmp_path, command):
    out = tmp_path / "run"
    out.mkdir()
    with (out / ".lock").open("w") as held:  # a live run: a lock of another open file
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("4242\n")
        held.flush()
        one_line_error(command(out), r"in use by a live run \(pid 4242\)")
    # The lock file outlived its holder, as after a SIGKILL: the next run takes it over.
    result = command(out)
    assert result.returncode == 0, result.stderr
    assert "took over the stale lock" in result.stderr
    assert not (out / ".lock").exists()

    before = snapshot(out)
    result = command(out, "--overwrite", sets=["train.steps=6"])
    assert result.returncode == 0, result.stderr
    # The keyword's name without the flag's dashes: run(overwrite=True) prints it too.
    assert result.stderr.startswith(
        "overwrite: deleted config.yaml, metrics.jsonl, curves.png, summary.json, "
    ), result.stderr
    assert max(r["step"] for r in logged(out)) == 6 and snapshot(out) != before


def test_interrupt_and_a_broken_checkpoint_resume_bit_for_bit(tmp_path, command, finished_run):
    # SIGINT after step 6: a checkpoint at step 6, the plot, one line telling how to resume.
    interrupted = command(tmp_path / "run", signal=(signal.SIGINT, 6))
    assert interrupted.returncode == 130, interrupted.stderr
    assert "Traceback" not in interrupted.stderr
    (message,) = interrupted.stderr.strip().splitlines()
    assert "stopped by SIGINT at step 6" in message and message.endswith("--resume")
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["4", "6"]
    assert (tmp_path / "run" / "curves.png").exists()

    # A copy whose latest checkpoint is damaged falls back to step 4. Both end as the run
    # that was never stopped (trained in a fresh interpreter) ended, to the bit.
    shutil.copytree(tmp_path / "run", tmp_path / "broken")
    (tmp_path / "broken" / "checkpoints" / "6" / "default" / "_METADATA").write_text("")
    for name in ("run", "broken"):
        resumed = command(tmp_path / name, "--resume")
        assert resumed.returncode == 0, resumed.stderr
        assert logged(tmp_path / name) == logged(finished_run), name
    warnings = [line for line in resumed.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "checkpoint step 6 does not restore" in warnings[0]
    assert (tmp_path / "broken" / "broken_checkpoints" / "6").is_dir()

    # When no checkpoint restores, one error line after one warning per checkpoint.
    for step in ("8", "12"):
        (tmp_path / "broken" / "checkpoints" / step / "default" / "_METADATA").write_text("")
    (tmp_path / "broken" / "summary.json").unlink()  # as if the run had been interrupted
    result = command(tmp_path / "broken", "--resume")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    *warnings, error = result.stderr.strip().splitlines()
    assert [w.split(" does not")[0] for w in warnings] == [
        "warning: checkpoint step 12",
        "warning: checkpoint step 8",
    ]
    assert error.startswith("train.py: error: --resume: no checkpoint in ") and "restores" in error


def test_killed_run_resumes_bit_for_bit(tmp_path, subprocess_env, command, finished_run):
    # SIGKILL after step 10: no clean-up at all, so the run is a process of its own.
    out = tmp_path / "run"
    killed = train(subprocess_env, out, prefix=("-c", INTERRUPTED, str(int(signal.SIGKILL)), "10"))
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = command(out, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads((out / "summary.json").read_text())
    # The loop waits for each save, so step 8's checkpoint was complete before the kill.
    assert summary["start_step"] == 8 and summary["final_step"] == 12
    assert logged(out) == logged(finished_run)
    straight = json.loads((finished_run / "summary.json").read_text())
    assert summary["eval_accuracy"] == straight["eval_accuracy"]


def test_sigterm_saves_and_exits_143(tmp_path, command):
    result = command(tmp_path / "run", signal=(signal.SIGTERM, 2))
    assert result.returncode == 143, result.stderr
    assert "stopped by SIGTERM at step 2" in result.stderr
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["2"]


def test_a_failed_save_stops_at_once_and_keeps_the_earlier_checkpoints(
    tmp_path, monkeypatch, command
):
    """On a full disk orbax's threads also report the failure, about 100 lines of it before
    the error line: absl records, tracebacks printed on sys.stderr by threads with no caller
    (``Event loop is closed``), and asyncio's records of exceptions never retrieved from its
    tasks, some when they are collected, at exit. The fake below does the same."""
    import logging
    import threading
    import traceback

    import orbax.checkpoint as ocp

    save = ocp.CheckpointManager.save
    # An exception raised in orbax's code: a function compiled under its module's file name.
    scope = {}
    exec(
        compile("def write(): raise ValueError('RESOURCE_EXHAUSTED')", ocp.__file__, "exec"), scope
    )
    try:
        scope["write"]()
    except ValueError as error:
        in_orbax = error

    def unretrieved():
        logging.getLogger("asyncio").error(
            "Task exception was never retrieved",
            exc_info=(ValueError, in_orbax, in_orbax.__traceback__),
        )

    def disk_full_at_8(self, step, *args, **kwargs):
        if step == 8:
            error = OSError(28, "No space left on device")
            logging.getLogger("absl").error("_SignalingThread.run() raised", exc_info=error)
            printer = threading.Thread(
                target=lambda: traceback.print_exception(error, file=sys.stderr)
            )
            printer.start()
            printer.join()
            unretrieved()
            raise error
        return save(self, step, *args, **kwargs)

    reached = []
    handler = logging.Handler()
    handler.emit = reached.append
    monkeypatch.setattr(ocp.CheckpointManager, "save", disk_full_at_8)
    logging.getLogger().addHandler(handler)
    try:
        result = command(tmp_path / "run")
        unretrieved()  # as at exit, after the command
    finally:
        logging.getLogger().removeHandler(handler)
    assert not [r for r in reached if r.name in ("absl", "asyncio")], reached
    (message,) = result.stderr.strip().splitlines()
    assert result.returncode == 1
    assert message.startswith("train.py: error: could not save checkpoint step 8")
    assert "No space left on device" in message and "step 4 is the latest kept" in message
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["4"]
    assert max(r["step"] for r in logged(tmp_path / "run")) == 8


@pytest.mark.parametrize(
    ("name", "damage", "pattern"),
    [
        ("config.yaml", None, r"config.yaml cannot be read: it is missing, so --resume cannot"),
        ("config.yaml", "", r"config.yaml cannot be read: it is empty, so --resume cannot"),
        ("config.yaml", "model: [gdn\n", r"config.yaml cannot be read: malformed YAML at line 2"),
        ("config.yaml", "- model\n", r"config.yaml cannot be read: it is not a mapping"),
        ("metrics.jsonl", '{"kind"\n{"kind": "train", "step": 1}\n', r"metrics.jsonl cannot be "
         r"read: line 1 is not JSON"),
        ("summary.json", '{"final_step": 1', r"summary.json cannot be read: not JSON"),
        ("checkpoints", "not a directory", r"run holds, where a run keeps its files, what no run "
         r"makes: checkpoints; move it away first"),
    ],
)  # fmt: skip
def test_resume_refuses_an_unreadable_run_file_in_one_line_and_touches_nothing(
    tmp_path, command, name, damage, pattern
):
    out = tmp_path / "run"
    fake_run(out)
    path = out / name
    shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    if damage is not None:
        path.write_text(damage)
    before = snapshot(out)
    # The run was made with 4 pairs: without its config.yaml it must not become an 8-pair run.
    changed = ["data.num_kv_pairs=8"] if name == "config.yaml" else []
    one_line_error(command(out, "--resume", sets=changed), pattern)
    assert snapshot(out) == before


def resumable_copy(finished_run, out_dir):
    """A copy of the finished run as a SIGKILL after its last checkpoint leaves it."""
    shutil.copytree(finished_run, out_dir)
    (out_dir / "summary.json").unlink()
    return out_dir


def test_a_checkpoint_of_another_model_is_a_config_mismatch_not_damage(
    tmp_path, command, finished_run
):
    out = resumable_copy(finished_run, tmp_path / "run")
    config = out / "config.yaml"
    config.write_text(config.read_text().replace("d_model: 16", "d_model: 32"))
    before = snapshot(out)
    one_line_error(
        command(out, "--resume", sets=["model.d_model=32"]),
        r"checkpoint step 12 .* is of another model than the config: params \S+ is "
        r"\(16, \d+\) there and \(32, \d+\) here",
    )  # fmt: skip
    assert snapshot(out) == before and not (out / "broken_checkpoints").exists()


def test_a_run_saved_before_model_schedule_existed_resumes_under_another_schedule(
    tmp_path, command, finished_run
):
    out = resumable_copy(finished_run, tmp_path / "run")
    config = out / "config.yaml"
    assert "  schedule: auto\n" in config.read_text()
    config.write_text(config.read_text().replace("  schedule: auto\n", ""))
    result = command(out, "--resume", sets=["model.schedule=hoisted"])
    assert result.returncode == 0, result.stderr
    assert logged(out) == logged(finished_run)


def test_resume_refuses_train_steps_below_the_newest_checkpoint(tmp_path, command):
    before = fake_run(tmp_path / "run", steps=(4, 8))  # stopped at step 8, no summary
    result = command(tmp_path / "run", "--resume", sets=["train.steps=7"])
    one_line_error(result, r"train.steps=7 is below step 8 of the newest checkpoint")
    assert snapshot(tmp_path / "run") == before


def test_a_run_killed_after_its_last_checkpoint_resumes_to_its_summary_past_a_torn_line(
    tmp_path, command, finished_run
):
    out = resumable_copy(finished_run, tmp_path / "run")
    with (out / "metrics.jsonl").open("a") as log:
        log.write('{"kind": "train", "st')  # the crash hit mid-write
    result = command(out, "--resume")
    assert result.returncode == 0, result.stderr
    (warning,) = result.stderr.strip().splitlines()
    assert warning.startswith("warning: dropping the torn last line of ") and "step 12" in warning
    assert logged(out) == logged(finished_run)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_accuracy"] == logged(finished_run)[-1]["accuracy"]


def test_a_run_that_died_before_its_first_checkpoint_is_replaced_by_a_fresh_start(
    tmp_path, monkeypatch, command
):
    import jax

    from gdn_jax.training import loop

    out = tmp_path / "run"
    fake_run(out, steps=())
    (out / "metrics.jsonl").write_text("")  # it died compiling its first step
    before = snapshot(out)
    result = command(out, "--resume")
    assert snapshot(out) == before
    one_line_error(
        result,
        r"nothing to resume in \S+ \(its run died before its first checkpoint\); start it "
        r"afresh with: python train.py --set (?!.*--resume).*train.out_dir=\S+/run$",
    )  # fmt: skip

    def too_big(*args, **kwargs):  # stop the fresh start just after it took the directory
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 4e12 B")

    monkeypatch.setattr(loop, "build", too_big)
    result = command(out)
    replaced, error = result.stderr.strip().splitlines()
    assert replaced.startswith("replacing the run in ") and "config.yaml, metrics.jsonl" in replaced
    assert result.returncode == 1
    assert error.startswith("train.py: error: out of memory (RESOURCE_EXHAUSTED")
    assert "model.d_model=16" in error and "shrink model.d_model" in error


def test_a_run_with_logged_steps_but_no_checkpoint_names_the_one_way_out(tmp_path, command):
    out = tmp_path / "run"
    before = fake_run(out, steps=())  # a NaN at step 2: step 1 is logged, nothing saved
    one_line_error(command(out), r"holds an earlier run \(config.yaml, metrics.jsonl\); it has no "
                         r"checkpoint; delete it with --overwrite$")  # fmt: skip
    one_line_error(
        command(out, "--resume"),
        r"nothing to resume .* start it afresh with: python train.py .*--overwrite$",
    )
    assert snapshot(out) == before


def test_out_of_memory_is_one_line_and_the_directory_stays_usable(tmp_path, monkeypatch, command):
    from gdn_jax.training import evaluation

    def held_out_too_big(config, *, num_examples, seed):
        raise MemoryError

    monkeypatch.setattr(evaluation, "make_examples", held_out_too_big)
    out = tmp_path / "run"
    out.mkdir()  # the user's: the run did not create it, so it keeps what the run wrote
    (out / "notes.txt").write_text("mine")
    one_line_error(
        command(out),
        r"out of memory \(MemoryError\) with .*train.eval_examples=16; shrink ",
        status=1,
    )
    one_line_error(
        command(out, "--resume"),
        r"its run died before its first checkpoint\); start it afresh with",
    )
    assert (out / "notes.txt").read_text() == "mine"


def users_things(checkpoints):
    """A user's file, folder and links (one named like a step) inside ``checkpoints/``."""
    checkpoints.mkdir(parents=True, exist_ok=True)
    (checkpoints / "model.pt").write_text("weights")
    (checkpoints / "mine").mkdir()
    (checkpoints / "mine" / "notes.txt").write_text("notes")
    (checkpoints / "latest").symlink_to(checkpoints / "mine")
    (checkpoints / "8").symlink_to(checkpoints / "mine")


@pytest.mark.parametrize(
    ("earlier", "flags"),
    [
        ("died before its first checkpoint", ()),  # a plain run used to replace it
        ("checkpoint at step 4", ("--overwrite",)),
        ("checkpoint at step 4", ("--resume",)),
        ("nothing", ()),
    ],
)
def test_a_checkpoints_folder_with_what_no_run_makes_is_refused_and_kept(
    tmp_path, command, earlier, flags
):
    out = tmp_path / "run"
    if earlier == "died before its first checkpoint":
        fake_run(out, steps=())
        (out / "metrics.jsonl").write_text("")
    elif earlier == "checkpoint at step 4":
        fake_run(out, steps=(4,))
    users_things(out / "checkpoints")
    before = snapshot(out)
    one_line_error(
        command(out, *flags),
        r"run holds, where a run keeps its files, what no run makes: checkpoints/8, "
        r"checkpoints/latest, checkpoints/mine, checkpoints/model.pt; move it away first",
    )
    assert snapshot(out) == before
    assert (out / "checkpoints" / "latest").is_symlink() and (
        out / "checkpoints" / "8"
    ).is_symlink()


def test_overwrite_names_every_path_it_deletes_and_nothing_else(tmp_path, monkeypatch, command):
    import jax

    from gdn_jax.training import loop

    out = tmp_path / "run"
    fake_run(out, steps=(4, 8))
    (out / "checkpoints" / "12.orbax-checkpoint-tmp-1796522850").mkdir()  # a save cut short
    (out / "notes.txt").write_text("mine")

    def too_big(*args, **kwargs):  # stop the run just after it took the directory
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 4e12 B")

    monkeypatch.setattr(loop, "build", too_big)
    deleted, _ = command(out, "--overwrite").stderr.strip().splitlines()
    assert deleted == (
        "overwrite: deleted config.yaml, metrics.jsonl, checkpoints/12.orbax-checkpoint-tmp-"
        f"1796522850, checkpoints/4, checkpoints/8, checkpoints in {out}"
    )
    assert sorted(os.listdir(out)) == ["notes.txt"]


@pytest.mark.parametrize("ending", ["out of memory", "Ctrl-C"])
def test_a_run_that_ends_before_its_first_step_removes_the_directory_it_created(
    tmp_path, monkeypatch, command, ending
):
    import jax

    from gdn_jax.training import loop

    def start_up(*args, **kwargs):  # compiling the first step, a few seconds in
        if ending == "Ctrl-C":
            raise KeyboardInterrupt  # what Python's own SIGINT handler raises
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 4e12 B")

    monkeypatch.setattr(loop, "build", start_up)
    result = command(tmp_path / "run")
    if ending == "Ctrl-C":
        assert (result.returncode, result.stderr) == (
            130,
            "train.py: interrupted before training began\n",
        )
    else:
        one_line_error(result, r"^train.py: error: out of memory \(RESOURCE_EXHAUSTED", status=1)
    assert os.listdir(tmp_path) == []


def test_a_plot_that_fails_in_the_finally_block_does_not_hide_the_error(
    tmp_path, monkeypatch, command, real_plots
):
    import matplotlib.figure
    import orbax.checkpoint as ocp

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    def partial_then_disk_full(self, path, *args, **kwargs):
        open(path, "wb").close()
        disk_full()

    monkeypatch.setattr(ocp.CheckpointManager, "save", disk_full)
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", partial_then_disk_full)
    out = tmp_path / "run"
    result = command(out)
    warning, error = result.stderr.strip().splitlines()
    assert warning.startswith("warning: could not plot ") and "No space left" in warning
    assert result.returncode == 1 and error.startswith(
        "train.py: error: could not save checkpoint step 4"
    )
    assert sorted(os.listdir(out)) == ["checkpoints", "config.yaml", "metrics.jsonl"]


def test_a_config_path_must_exist_and_its_keys_be_unique(tmp_path):
    from gdn_jax.training.config import load_config
    from gdn_jax.training.config_paths import CONFIG_DIR, resolve_config

    with pytest.raises(ValueError, match=r"^--config /nonexistent/mqar_linear.yaml: no such file$"):
        resolve_config("/nonexistent/mqar_linear.yaml")
    assert resolve_config("mqar_gdn.yaml") == CONFIG_DIR / "mqar_gdn.yaml"
    config = tmp_path / "twice.yaml"
    config.write_text("model:\n  d_model: 64\n  d_model: 32\n")
    with pytest.raises(
        ValueError, match=r"twice.yaml: .* line 3, column 3: duplicate key 'd_model'"
    ):
        load_config(config)
    with pytest.raises(ValueError, match=r"duplicate key 'd_model'"):
        load_config(None, ["model={d_model: 64, d_model: 32}"])


def test_a_config_that_is_no_yaml_file_is_named(tmp_path, command):
    """A binary file was "'utf-8' codec can't decode byte ..." with no file named; a folder
    was "no such file"."""
    (tmp_path / "model.pt").write_bytes(b"\x80\x02weights")
    one_line_error(
        command(tmp_path / "run", "--config", str(tmp_path / "model.pt")),
        r"error: \S+/model.pt: not a YAML text file \(byte 0 is not utf-8\)$",
    )
    one_line_error(
        command(tmp_path / "run", "--config", str(tmp_path)),
        r"error: --config \S+: is a directory; give a YAML file in it$",
    )
    assert os.listdir(tmp_path) == ["model.pt"]


def test_help_names_the_gpu_targets_of_compile_only(capsys):
    from gdn_jax.training import cli

    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "libtpu (TPUs) or JAX's CUDA plugin (GPUs)" in text
    assert "or GPUs of one host, h100 or h200 with an optional count, e.g. h200:8" in text


def test_a_damaged_checkpoint_metadata_file_is_one_warning_not_orbaxs_log(
    tmp_path, command, finished_run, caplog
):
    """orbax logged "Failed to json parse Metadata file" with the file's content, twice for
    the newest step, before the resume's own warning."""
    out = resumable_copy(finished_run, tmp_path / "run")
    for step in ("8", "12"):
        (out / "checkpoints" / step / "_CHECKPOINT_METADATA").write_text("garbage{")
    resumed = command(out, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    # One warning a damaged file, in the order orbax lists the steps (not the test's).
    assert sorted(line.split(" (")[0] for line in resumed.stderr.splitlines()) == [
        f"warning: orbax cannot read {out}/checkpoints/{step}/_CHECKPOINT_METADATA"
        for step in ("12", "8")
    ]
    assert not [r for r in caplog.records if "Metadata file" in r.getMessage()]


def test_a_dangling_link_as_out_dir_is_one_line(tmp_path):
    from gdn_jax.training.errors import RunError
    from gdn_jax.training.run_dir import check_writable

    (tmp_path / "run").symlink_to(tmp_path / "gone")
    with pytest.raises(RunError, match=r"run is a link to \S+/gone, which does not exist"):
        check_writable(tmp_path / "run")


def compile_only(command, tmp_path, topology="v5e:2x2", sets=()):
    """``--compile-only`` as users run it: without the test session's float64, which a TPU
    would emulate at twice the compile time."""
    import jax

    with jax.enable_x64(False):
        return command(tmp_path / "run", "--compile-only", "--topology", topology, sets=sets)


def documented_compile_only_output():
    """What docs/training.md shows the README's ``--compile-only`` command printing."""
    text = (REPO / "docs" / "training.md").read_text()
    sample = re.search(
        r"```\n\$ python train.py --compile-only --topology v5e:2x2\n(.*?)```", text, re.S
    )
    assert sample, "docs/training.md has no sample of --compile-only --topology v5e:2x2"
    return sample.group(1)


@pytest.mark.slow
@pytest.mark.costly(20)
def test_compile_only_prints_the_memory_per_chip_and_whether_it_fits(tmp_path, command):
    pytest.importorskip("libtpu", reason='--compile-only needs libtpu: pip install -e ".[test]"')
    # The README's command itself, on the default config: its output is docs/training.md's.
    result = command(None, "--compile-only", "--topology", "v5e:2x2")
    assert result.returncode == 0, result.stderr
    assert result.stdout == documented_compile_only_output(), "docs/training.md's sample"
    lines = result.stdout.splitlines()
    assert "for TPU v5e:2x2 (4 chips, mesh data=4 x model=1 x seq=1)" in lines[0]
    assert lines[1] == "per chip, MiB (HBM 16 GiB):"
    rows = {line[:32].strip(): float(line[32:]) for line in lines[2:6]}
    assert list(rows) == ["parameters + optimizer state", "batch", "temp", "total"]
    assert 0 < rows["parameters + optimizer state"] < rows["total"] < 16 * 1024
    assert re.fullmatch(r"compiled FLOPs per step per chip: \S+e\+\d+ \(.*\)", lines[6])
    assert re.fullmatch(r"fits: [\d.]+ MiB of 16 GiB per chip \([\d.]+%\) on v5e:2x2", lines[7])

    # Embeddings and their Adam moments alone, 2**20 x 1024 floats three times, pass 12 GiB.
    big = ["model.vocab_size=1048576", "data.vocab_size=1048576", "model.d_model=1024"]
    result = compile_only(command, tmp_path, sets=big)
    assert result.returncode == 1, result.stderr
    *_, verdict = result.stdout.splitlines()
    assert verdict.startswith("does NOT fit: the TPU compiler ran out of HBM: "), verdict
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("args", "sets", "pattern"),
    [
        (["--topology", "v5e:2x2"], [], r"--topology is for --compile-only$"),
        (
            ["--compile-only"],
            [],
            r"--compile-only needs --topology, e.g. --topology v5e:2x4 or h200:8$",
        ),
        (
            ["--compile-only", "--topology", "h200:0"],
            [],
            r"error: GPU target 'h200:0': the GPU count must be at least 1, e.g. h200:8$",
        ),
        (
            ["--compile-only", "--topology", "v7:2x2"],
            [],
            r"topology 'v7:2x2' must be <generation>:<chips per axis, joined by x> with a "
            r"generation of v4, v5e, v5p, v6e, e.g. v5e:2x4; or GPUs of one host: h100, "
            r"h200\[:count\]$",
        ),
        (
            ["--compile-only", "--topology", "v5e:3x3"],
            [],
            r"topology 'v5e:3x3': Topology layout \"v5e:3x3\" is not divisible",
        ),
        (
            ["--compile-only", "--topology", "v5e:2x2"],
            ["train.mesh.data=3"],
            r"train.mesh \{'data': 3, 'model': 1, 'seq': 1\} does not fit the 4 devices",
        ),
    ],
)
def test_compile_only_refuses_bad_input_in_one_line(tmp_path, command, args, sets, pattern):
    if "--compile-only" in args and "--topology" in args:
        pytest.importorskip(
            "libtpu", reason='--compile-only needs libtpu: pip install -e ".[test]"'
        )
    one_line_error(command(tmp_path / "run", *args, sets=sets), pattern)
    assert not (tmp_path / "run").exists()


@pytest.mark.costly(15)
def test_compile_only_for_gpus_prints_the_memory_per_gpu(tmp_path, command):
    pytest.importorskip(
        "jax_plugins.xla_cuda13", reason='needs the CUDA plugin: pip install -e ".[test]"'
    )
    result = compile_only(command, tmp_path, topology="h200:2")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].endswith("for 2 x H200 (mesh data=2 x model=1 x seq=1)")
    assert lines[1] == "per GPU, MiB (HBM 139.7 GiB):"
    rows = {line[:32].strip(): float(line[32:]) for line in lines[2:6]}
    assert 0 < rows["parameters + optimizer state"] < rows["total"] < 1024
    assert lines[6] == "compiled FLOPs per step per GPU: not estimated without the device"
    assert re.fullmatch(r"fits: [\d.]+ MiB of 139.7 GiB per GPU \([\d.]+%\) on h200:2", lines[7])
    assert not (tmp_path / "run").exists()


def test_compile_only_without_libtpu_names_the_install_command(tmp_path, monkeypatch, command):
    from gdn_jax import tpu_compile

    monkeypatch.setattr(tpu_compile, "libtpu_installed", lambda: False)
    one_line_error(
        compile_only(command, tmp_path),
        r"compiling for TPU needs libtpu; install it with: pip install \"libtpu==0.0.52\"$",
    )


def test_compile_only_with_a_tpu_platform_this_host_lacks_is_one_line(
    tmp_path, monkeypatch, command
):
    """``JAX_PLATFORMS=tpu`` on a host without TPUs: JAX's own error, as it raises it when
    the backend starts (this process's backends are up already, so it is raised for them)."""
    pytest.importorskip("libtpu", reason='--compile-only needs libtpu: pip install -e ".[test]"')
    import jax

    def no_tpu(*args, **kwargs):
        raise RuntimeError(
            "Unable to initialize backend 'tpu': NOT_FOUND: TPU initialization failed: No "
            "jellyfish device found. (set JAX_PLATFORMS='' to automatically choose an "
            "available backend)"
        )

    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    monkeypatch.setattr(jax, "devices", no_tpu)
    for args in (["--compile-only", "--topology", "v5e:2x2"], []):
        one_line_error(
            command(tmp_path / "run", *args),
            r"JAX_PLATFORMS=tpu: Unable to initialize backend 'tpu': NOT_FOUND: TPU "
            r"initialization failed: No jellyfish device found\.(; --compile-only compiles "
            r"on this host and needs no accelerator of its own: unset JAX_PLATFORMS or set "
            r"JAX_PLATFORMS=cpu)?$",
        )
        assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("platform", "error", "reason"),
    [
        # JAX skips cuda on a host without a visible NVIDIA GPU, then asserts that some
        # backend started: a bare AssertionError, after a 25-line traceback.
        ("cuda", AssertionError(), r"no backend of these platforms can start on this host"),
        (
            "rocm",
            RuntimeError(
                "Unable to initialize backend 'rocm': Backend 'rocm' is not in the list of "
                "known backends: ['cpu', 'tpu']. (set JAX_PLATFORMS='' to automatically "
                "choose an available backend)"
            ),
            r"Unable to initialize backend 'rocm': Backend 'rocm' is not in the list",
        ),
    ],
)
def test_a_gpu_platform_this_host_lacks_is_one_line(
    tmp_path, monkeypatch, command, platform, error, reason
):
    import jax

    def no_gpu(*args, **kwargs):
        raise error

    monkeypatch.setenv("JAX_PLATFORMS", platform)
    monkeypatch.setattr(jax, "devices", no_gpu)
    result = command(tmp_path / "run")
    one_line_error(result, rf"^train.py: error: JAX_PLATFORMS={platform}: {reason}")
    assert result.stdout == ""
    assert not (tmp_path / "run").exists()


def test_a_users_training_run_on_a_cpu_host_prints_nothing_on_stderr(finished_run):
    """The shared finished run trained with JAX_PLATFORMS unset, libtpu installed (the test
    extra brings it) and no TPU here: JAX was kept off libtpu, whose warnings and
    INVALID_ARGUMENT error on stderr read as a broken install (``platforms.py``)."""
    stderr = (finished_run.parent / "finished-run.stderr").read_text()
    assert stderr == "", stderr
