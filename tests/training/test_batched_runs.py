"""Runs trained together (``training/batched.py`` and its command): each ends as it would
alone, to the bit (and as ``python train.py`` trains it), ends on its own (target, NaN), and a
stopped group resumes to the end it would have reached unstopped, also after one of its runs
went on alone.

One group of five tiny runs (``runs.TINY`` for 20 steps), trained once for the module: two
seeds at two learning rates, the two at the higher rate reaching the target accuracy at the
first evaluation (step 6) while the others train to step 20, and one run whose learning rate
of 1e30 makes its loss NaN. The four that train are compared with the same configs trained
alone by ``loop.run``. The command's tests run in this process, on the same group (its
programs are compiled once), with the session's float64 mode off as in a fresh interpreter.
"""

import json
import os
import re
import shutil
import signal

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import yaml
from support.runs import TINY, logged

from gdn_jax.training import batched, batched_cli, loop
from gdn_jax.training import checkpoints as ckpt
from gdn_jax.training import mesh as mesh_lib
from gdn_jax.training.config import load_config, to_dict
from gdn_jax.training.config_paths import DEFAULT_CONFIG, resolve_config
from gdn_jax.training.errors import Interrupted, NonFiniteLossError
from gdn_jax.training.state import train_setup

# 20 steps, a checkpoint at the end only (each save takes 0.3 s).
SETS = [*TINY, "train.steps=20", "train.checkpoint_every=20", "train.target_accuracy=0.03"]
# (seed, learning rate): at step 6 the runs at 3e-2 reach 0.062 and 0.047 of held-out
# accuracy; those at 1e-3 stay at 0 through step 20; the last run's loss is NaN at step 4.
RUNS = [(0, 1e-3), (1, 1e-3), (0, 3e-2), (1, 3e-2), (0, 1e30)]
TARGET, DIVERGES = (2, 3), 4


def configs(root):
    """The runs' configs as the command makes them, into directories below ``root``."""
    base = resolve_config(DEFAULT_CONFIG)
    return [
        load_config(base, [*SETS, f"train.seed={seed}", f"train.learning_rate={rate}",
                           f"train.out_dir={root}/seed{seed}_lr{rate:g}"])
        for seed, rate in RUNS
    ]  # fmt: skip


@pytest.fixture(autouse=True)
def as_a_fresh_interpreter():
    # optax's Adam bias correction mixes a Python float with its int32 step count, which the
    # strict promotion of conftest.py rejects.
    with jax.enable_x64(False), jax.numpy_dtype_promotion("standard"):
        yield


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """The group trained together, and the runs that train trained alone: ``(outcomes,
    together, alone)``, the last two the runs' directories."""
    root = tmp_path_factory.mktemp("batched")
    with jax.enable_x64(False), jax.numpy_dtype_promotion("standard"):
        outcomes = batched.run(configs(root / "together"))
        for config in configs(root / "alone")[:DIVERGES]:
            loop.run(config)
    together = [root / "together" / f"seed{s}_lr{r:g}" for s, r in RUNS]
    alone = [root / "alone" / f"seed{s}_lr{r:g}" for s, r in RUNS[:DIVERGES]]
    return outcomes, together, alone


def final_params(out_dir, abstract):
    """The step and parameters of the newest checkpoint in ``out_dir``, restored as
    ``abstract`` (a ``TrainState`` of shapes) places them."""
    manager = ckpt.manager(out_dir, 2)
    try:
        step = manager.latest_step()
        return step, manager.restore(step, args=ocp.args.StandardRestore(abstract)).params
    finally:
        manager.close()


def test_each_run_ends_as_it_would_alone(group):
    """Losses, metrics, evaluations and parameters of every run trained with the others
    equal the run's own, to the bit; its directory holds what a run's does."""
    outcomes, together, alone = group
    runs = configs(together[0].parent)
    _, abstract = train_setup(
        runs[0], mesh_lib.check_mesh(runs[0], jax.devices()[:1]), abstract=True
    )
    for i, config in enumerate(runs[:DIVERGES]):
        assert logged(together[i]) == logged(alone[i]), together[i].name
        step, params = final_params(together[i], abstract)
        step_alone, params_alone = final_params(alone[i], abstract)
        assert step == step_alone == outcomes[i]["final_step"]
        for a, e in zip(jax.tree.leaves(params), jax.tree.leaves(params_alone), strict=True):
            np.testing.assert_array_equal(a, e)
        summary = json.loads((alone[i] / "summary.json").read_text())
        assert json.loads((together[i] / "summary.json").read_text()).keys() == summary.keys()
        assert {k: outcomes[i][k] for k in ("start_step", "final_step", "reason")} == {
            k: summary[k] for k in ("start_step", "final_step", "reason")
        }
        assert outcomes[i]["eval_accuracy"] == summary["eval_accuracy"]
        assert sorted(p.name for p in together[i].iterdir()) == sorted(
            p.name for p in alone[i].iterdir() if not p.name.startswith(".")
        )
        saved = yaml.safe_load((together[i] / "config.yaml").read_text())
        assert saved == to_dict(config)


def test_a_run_that_reaches_its_target_stops_while_the_others_go_on(group):
    outcomes, together, _ = group
    assert [o["reason"] for o in outcomes[:DIVERGES]] == ["steps", "steps", "target", "target"]
    assert [o["final_step"] for o in outcomes[:DIVERGES]] == [20, 20, 6, 6]
    for i in TARGET:
        assert max(r["step"] for r in logged(together[i])) == 6
        assert sorted(int(p.name) for p in (together[i] / "checkpoints").iterdir()) == [6]


def test_a_nan_loss_ends_its_run_alone_with_no_checkpoint_after_its_last_finite_step(group):
    outcomes, together, _ = group
    error = outcomes[DIVERGES]
    assert isinstance(error, NonFiniteLossError), error
    assert re.fullmatch(r"loss is (nan|inf) at step \d+; no checkpoint was saved yet", str(error))
    records = logged(together[DIVERGES])
    assert records and all(np.isfinite(r["loss"]) for r in records)
    assert not (together[DIVERGES] / "checkpoints").exists() or not any(
        (together[DIVERGES] / "checkpoints").iterdir()
    )
    assert not (together[DIVERGES] / "summary.json").exists()
    assert (together[DIVERGES] / "curves.png").exists()
    assert all(isinstance(o, dict) for o in outcomes[:DIVERGES])  # the others went on


@pytest.fixture
def command(monkeypatch, capsys):
    """``command(*args, signal=(signum, step))``: the batched command in this process,
    ``signum`` sent to this process after that step; ``(status, stdout, stderr)``."""
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main appends to it

    def run(*args, signal=None):
        with monkeypatch.context() as patch:
            if signal is not None:
                original = batched.run
                patch.setattr(
                    batched, "run", lambda *a, **k: original(*a, callbacks=[sender(*signal)], **k)
                )
            status = batched_cli.main(args)
        out, err = capsys.readouterr()
        return status, out, err

    return run


def sender(signum, at_step):
    """A callback that sends ``signum`` to this process after step ``at_step``, as a user's
    Ctrl-C or a scheduler's SIGTERM arrives."""

    def send(step, metrics):
        if step == at_step:
            os.kill(os.getpid(), signum)

    return send


def run_args(root):
    args = [x for item in SETS for x in ("--set", item)]
    for seed, rate in RUNS:
        args += ["--run", str(root / f"seed{seed}_lr{rate:g}"), str(seed), repr(rate)]
    return args


def test_a_stopped_group_resumes_to_the_end_it_had_unstopped(group, tmp_path, command):
    """SIGINT at step 2 saves every run there. One run then goes on alone (``train.py
    --resume``) to step 4. Resumed together, the others train from step 2 while it waits at
    4, the one that diverges fails again at step 4 with its checkpoint at 2 kept, and every
    run ends as there, to the bit."""
    _, together, _ = group
    args = run_args(tmp_path)
    status, _, err = command(*args, signal=(signal.SIGINT, 2))
    assert status == 130, err
    (line,) = err.strip().splitlines()
    assert line.startswith(
        f"{batched_cli.PROG}: stopped by SIGINT at step 2; checkpoints of its 5 runs saved in "
        f"{tmp_path}; continue with: {batched_cli.PROG} "
    ) and line.endswith(" --resume")
    for name in (p.name for p in together):
        assert os.listdir(tmp_path / name / "checkpoints") == ["2"]
        assert not (tmp_path / name / "summary.json").exists()

    ahead = 1
    with pytest.raises(Interrupted, match="SIGINT at step 4"):
        loop.run(configs(tmp_path)[ahead], resume=True, callbacks=[sender(signal.SIGINT, 4)])

    status, out, err = command(*args, "--resume")
    assert status == 1, err
    (line,) = err.strip().splitlines()
    diverged = tmp_path / together[DIVERGES].name
    assert line.startswith(f"{batched_cli.PROG}: error: {diverged}: ")
    assert line.endswith(f"the last good checkpoint is step 2 in {diverged / 'checkpoints'}")
    assert os.listdir(diverged / "checkpoints") == ["2"]
    for run in together[:DIVERGES]:
        assert f"{tmp_path / run.name}: step " in out
        assert logged(tmp_path / run.name) == logged(run), run.name


def test_a_run_trained_with_another_is_train_py_s_run_to_the_bit(finished_run, tmp_path, command):
    """The batched command (what the sweep runs for a cell's runs) trains a run exactly as
    ``python train.py`` does: the suite's finished run of ``train.py``, trained again beside
    a run of another seed and learning rate, logs the same numbers to the bit."""
    train = yaml.safe_load((finished_run / "config.yaml").read_text())["train"]
    sets = [x for item in TINY for x in ("--set", item)]
    runs = ["--run", str(tmp_path / "same"), str(train["seed"]), repr(train["learning_rate"])]
    runs += ["--run", str(tmp_path / "other"), "1", "3e-3"]
    status, _, err = command(*sets, *runs)
    assert status == 0, err
    assert logged(tmp_path / "same") == logged(finished_run)
    assert logged(tmp_path / "other") != logged(finished_run)


def test_a_finished_group_resumes_to_its_summaries_untrained(group, tmp_path, command):
    _, together, _ = group
    for run in together[:DIVERGES]:
        shutil.copytree(run, tmp_path / run.name)
    args = run_args(tmp_path)
    args = args[: args.index("--run") + 4 * DIVERGES]  # without the run that diverged
    before = {p.name: logged(p) for p in together[:DIVERGES]}
    status, out, err = command(*args, "--resume")
    assert status == 0, err
    assert out.count("has finished (step ") == DIVERGES
    assert {p.name: logged(tmp_path / p.name) for p in together[:DIVERGES]} == before


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], r"the following arguments are required: --run"),
        (["--run", "a", "0"], r"argument --run: expected 3 arguments"),
        (["--run", "a", "x", "0.01"], r"--run a x 0.01: train.seed='x' must be of type int"),
        (["--run", "a", "0", "-1"], r"--run a 0 -1: train.learning_rate=-1.0 must be positive"),
        (["--run", "a", "0", "0.01", "--run", "a", "1", "0.01"], r"train.out_dir=\S+/a is given to more than one run"),
        (["--set", "train.seed=3", "--run", "a", "0", "0.01"], r"--set train.seed=3: each --run gives its own train.seed"),
        (["--run", "a", "0", "0.01", "--resume"], r"--resume: nothing to resume in \S+/a \(it holds no run\)"),
        (["--run", "a", "0", "0.01", "--resume", "--overwrite"], r"argument --overwrite: not allowed with argument --resume"),
        (["--run", "a", "0", "0.01", "--run", "earlier", "1", "0.01"], r"\S+/earlier holds an earlier run \(config.yaml"),
    ],
)  # fmt: skip
def test_bad_arguments_are_one_line_before_anything_is_written(
    tmp_path, monkeypatch, command, args, message
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "earlier").mkdir()
    (tmp_path / "earlier" / "config.yaml").write_text("mine")
    (tmp_path / "earlier" / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    sets = [x for item in TINY for x in ("--set", item)]
    status, out, err = command(*sets, *args)
    assert status == 2, err
    assert out == ""  # every refusal comes before the header line
    (line,) = err.strip().splitlines()
    assert line.startswith(f"{batched_cli.PROG}: error: ") and re.search(message, line), line
    assert sorted(os.listdir(tmp_path)) == ["earlier"]
    assert sorted(os.listdir(tmp_path / "earlier")) == ["config.yaml", "metrics.jsonl"]
