"""train.py and the training loop: configs, loss paths, resume, NaN stop (several devices:
test_mesh.py)."""

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.runs import REPO, TINY
from support.tolerance import assert_close

from gdn_jax.data.mqar import MQARConfig, make_batch, make_mqar
from gdn_jax.layers import NoWeightDecay
from gdn_jax.models import LanguageModel, ModelConfig
from gdn_jax.training.config import Config, MeshConfig, TrainConfig, load_config
from gdn_jax.training.config_paths import CONFIG_DIR
from gdn_jax.training.errors import NonFiniteLossError, RunError
from gdn_jax.training.loop import run
from gdn_jax.training.mesh import check_mesh
from gdn_jax.training.optim import weight_decay_mask
from gdn_jax.training.state import jit_steps
from gdn_jax.training.step import loss_and_accuracy


@pytest.fixture(autouse=True)
def standard_dtype_promotion():
    # optax's Adam bias correction mixes a Python float with its int32 step count, which the
    # strict promotion of conftest.py rejects; our own code stays checked by the other tests.
    with jax.numpy_dtype_promotion("standard"):
        yield


def tiny(tmp_path, *extra):
    return load_config(None, [*TINY, f"train.out_dir={tmp_path}", *extra])


def test_every_shipped_config_loads():
    names = sorted(p.stem for p in (REPO / "configs").glob("*.yaml"))
    assert {
        "mqar_gdn",
        "mqar_deltanet",
        "mqar_simple_gla",
        "mqar_gla",
        "mqar_linear",
        "mqar_attention",
    } <= set(names)
    for name in names:
        config = load_config(REPO / "configs" / f"{name}.yaml")
        assert isinstance(config, Config)
    default = load_config(REPO / "configs" / "mqar_gdn.yaml")
    assert default.data == MQARConfig(vocab_size=8192, seq_len=256, num_kv_pairs=16)
    assert default.model.mixers == ("gdn", "gdn")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.d_modle=3", r"unknown config key\(s\) \['model.d_modle'\]"),
        ("optim.lr=3", r"unknown config key\(s\) \['optim'\]"),
        ("train.steps=ten", r"train.steps='ten' must be of type int"),
        ("train.learning_rate=-1", r"train.learning_rate=-1.0 must be positive"),
        ("model.mixers=[gdn, rnn]", r"ModelConfig.mixers=.*unknown mixer 'rnn'"),
        ("data.seq_len=33", r"seq_len=33 must be even"),
        ("model.vocab_size=100", r"model.vocab_size=100 must equal data.vocab_size=64"),
        ("train.steps", r"must look like section.field=value"),
        # It wrote every run file into the working directory ("curves in /curves.png").
        ("train.out_dir=''", r"train.out_dir='' must name a directory for the run's files"),
        ("train.out_dir=' '", r"train.out_dir=' ' must name a directory"),
    ],
)
def test_bad_overrides_fail_at_start_up(tmp_path, override, message):
    with pytest.raises(ValueError, match=message):
        tiny(tmp_path, override)


def test_load_config_takes_a_packaged_name_from_any_directory(tmp_path, monkeypatch):
    """As train.py's --config does; from Python it was a FileNotFoundError outside the repo."""
    monkeypatch.chdir(tmp_path)
    packaged = load_config(CONFIG_DIR / "mqar_kda.yaml", [])
    assert load_config("mqar_kda.yaml", []) == packaged
    assert load_config(Path("mqar_kda.yaml")) == packaged
    (tmp_path / "mqar_kda.yaml").write_text("model:\n  d_model: 32\n")  # here first
    assert load_config("mqar_kda.yaml").model.d_model == 32
    with pytest.raises(ValueError, match=r"^load_config: path='nosuch.yaml': no such file, and "):
        load_config("nosuch.yaml")
    with pytest.raises(ValueError, match=r"^load_config: path='configs/mqar_kda.yaml': no such"):
        load_config("configs/mqar_kda.yaml")


@pytest.mark.parametrize(
    ("path", "overrides", "message"),
    [
        # A string was read letter by letter: "--set 't' must look like section.field=value".
        (None, "train.steps=5", r"overrides='train.steps=5' must be a list of 'section.field="),
        (None, ["train.steps=5", 5], r"overrides\[1\]=5 must be a 'section.field=value' string"),
        ({"model": {}}, [], r"path=\{'model': \{\}\} must be a file name, a Path or None"),
    ],
)
def test_load_config_checks_its_arguments(path, overrides, message):
    with pytest.raises(ValueError, match=rf"^load_config: {message}"):
        load_config(path, overrides)


def test_load_config_takes_none_as_no_overrides():
    """As None is no file: it was a TypeError."""
    assert load_config(None, None) == load_config(None, [])


def test_logits_at_labels_equal_full_logits():
    model = LanguageModel(
        ModelConfig(vocab_size=64, d_model=16, mixers=("gdn",), chunk_size=16), rngs=nnx.Rngs(0)
    )
    inputs, labels = make_mqar(
        MQARConfig(vocab_size=64, seq_len=32, num_kv_pairs=4), num_examples=5, seed=1
    )
    batch = make_batch(inputs, labels)
    both = nnx.jit(
        lambda model, batch: [
            loss_and_accuracy(model, batch, logits_at_labels=at_labels)
            for at_labels in (True, False)
        ]
    )
    (loss_a, acc_a), (loss_b, acc_b) = both(model, batch)
    assert_close(loss_a, loss_b, jnp.float32)
    np.testing.assert_array_equal(acc_a, acc_b)


def test_weight_decay_skips_gates_norms_and_vectors():
    model = LanguageModel(ModelConfig(vocab_size=64, d_model=16, mixers=("gdn",)), rngs=nnx.Rngs(0))
    _, params = nnx.split(model)
    mask = weight_decay_mask(params)
    mixer = mask["blocks"][0]["mixer"]
    assert mixer["q_proj"]["kernel"] and mixer["q_conv1d"]["weight"] and mask["embed"]["embedding"]
    assert not mixer["A_log"] and not mixer["dt_bias"] and not mixer["o_norm"]["scale"]
    assert not mask["norm"]["scale"] and not mask["blocks"][0]["mixer_norm"]["scale"]
    assert isinstance(model.blocks[0].mixer.A_log, NoWeightDecay)


@pytest.mark.costly(9)
def test_short_run_learns_writes_its_outputs_and_a_rerun_replaces_them(tmp_path, real_plots):
    summary = run(tiny(tmp_path, "train.steps=30", "train.learning_rate=1e-2"))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 31))
    assert np.mean([r["loss"] for r in train[-5:]]) < np.mean([r["loss"] for r in train[:5]])
    assert summary["final_step"] == 30 and 0 <= summary["eval_accuracy"] <= 1
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert (tmp_path / "config.yaml").exists()

    # A fresh run into the same out_dir refuses and leaves the earlier run as it was; with
    # overwrite it replaces it, or a later --resume would restore the wrong run.
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    # A Python caller is told the keyword arguments, the commands' users their flags.
    with pytest.raises(
        RunError,
        match=r"holds an earlier run \(config.yaml, metrics.jsonl, curves.png, summary.json, "
        r"checkpoints \(steps \d+, 30\)\); continue it with resume=True or delete it with "
        r"overwrite=True$",
    ) as refused:
        run(tiny(tmp_path, "train.steps=6", "train.seed=1"))
    assert refused.value.command_text.endswith(
        "continue it with --resume or delete it with --overwrite"
    )
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert run(tiny(tmp_path, "train.steps=6", "train.seed=1"), overwrite=True)["final_step"] == 6
    steps = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert steps[-1] <= 6, f"checkpoints of the earlier run survived: {steps}"
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records) == 6


@pytest.mark.parametrize("config", [{"train": {"steps": 5}}, "configs/mqar_gdn.yaml"])
def test_run_refuses_what_is_not_a_config(config):
    """It was an AttributeError from training/mesh.py."""
    with pytest.raises(
        ValueError,
        match=r"^run: config must be a Config, as load_config\(path, "
        r"overrides\) returns, got (dict|str) ",
    ):
        run(config)


def test_run_checks_a_config_built_by_hand(tmp_path):
    """Config(...) itself checks nothing; run took train.steps=0 and wrote a run directory."""
    config = Config(train=TrainConfig(steps=0, out_dir=str(tmp_path / "run")))
    with pytest.raises(ValueError, match=r"^train.steps=0 must be >= 1$"):
        run(config)
    assert not (tmp_path / "run").exists()


def test_run_names_its_keyword_arguments_where_the_command_names_its_flags(tmp_path):
    for resume, overwrite in ((True, True), (True, False)):
        with pytest.raises(RunError) as refused:
            run(tiny(tmp_path), resume=resume, overwrite=overwrite)
        assert "--" not in str(refused.value) and "resume=True" in str(refused.value)
        assert refused.value.command_text.startswith("--resume")
    assert str(refused.value).startswith("resume=True: nothing to resume in ")
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    config = tiny(
        tmp_path, "train.learning_rate=1e30", "train.warmup_steps=0", "train.grad_clip=1e30"
    )
    with pytest.raises(
        NonFiniteLossError,
        match=r"loss is (nan|inf) at step \d+; (the last good checkpoint is step \d+ in |no "
        r"checkpoint was saved yet)",
    ):
        run(config)
    steps = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(np.isfinite(r["loss"]) for r in records)
    assert not steps or steps[-1] <= records[-1]["step"]


def test_the_progress_bar_shows_no_held_out_accuracy_before_the_first_evaluation(tmp_path, capsys):
    """It showed eval=0.000 until step 6's evaluation, which reads as a measured 0%."""
    run(tiny(tmp_path, "train.progress=true"))
    drawn = [
        re.search(r"(\d+)/12 .*eval=([^,\]]+)", bar) for bar in capsys.readouterr().err.split("\r")
    ]
    shown = dict(bar.groups() for bar in drawn if bar)  # each step's bar as last drawn
    assert list(shown) == [str(step) for step in range(1, 13)]
    for step, held_out in shown.items():
        # Step 6's bar is drawn when its metrics are read, before its evaluation.
        assert (held_out == "-") == (int(step) <= 6), (step, held_out)
        assert held_out == "-" or re.fullmatch(r"[01]\.\d{3}", held_out)


def test_a_run_that_stops_at_its_target_ends_its_progress_bar_full(tmp_path, monkeypatch, capsys):
    """It stayed at 6/12 when the target accuracy stopped the run at step 6."""
    from gdn_jax.training import loop

    monkeypatch.setattr(loop, "evaluate", lambda *args: (0.5, 1.0))  # the target at step 6
    summary = run(tiny(tmp_path, "train.progress=true", "train.target_accuracy=0.99"))
    assert summary["final_step"] == 6 and summary["reason"] == "target"
    last = capsys.readouterr().err.split("\r")[-1]
    assert re.search(r"100%\|\S+\| 6/6 ", last), last


def test_train_config_defaults_are_valid():
    Config(train=TrainConfig()).validate()
    assert jax.devices()  # the loop runs on whatever JAX finds


def test_runs_that_differ_only_in_seed_and_directory_share_their_jitted_steps(tmp_path):
    """What a step computes comes from the model and the optimiser's settings; the seed
    and the directory enter no step, so a process's runs compile each program once."""
    config = tiny(tmp_path / "a")
    mesh = check_mesh(config, jax.devices()[:1])
    steps = jit_steps(config, mesh)
    assert jit_steps(tiny(tmp_path / "b", "train.seed=3"), mesh) is steps
    assert jit_steps(tiny(tmp_path / "a", "train.learning_rate=1e-2"), mesh) is not steps
    assert jit_steps(tiny(tmp_path / "a", "model.d_model=32"), mesh) is not steps


@pytest.mark.parametrize(
    ("config", "message"),
    [
        # A string learning rate failed inside optax; out_dir=3 as an AttributeError.
        (Config(train=TrainConfig(learning_rate="3e-3")), r"^train.learning_rate='3e-3' must be of type float$"),
        (Config(train=TrainConfig(steps="5")), r"^train.steps='5' must be of type int$"),
        (Config(train=TrainConfig(steps=True)), r"^train.steps=True must be of type int$"),
        (Config(train=TrainConfig(progress="no")), r"^train.progress='no' must be of type bool$"),
        (Config(train=TrainConfig(out_dir=3)), r"^train.out_dir=3 must be of type str$"),
        (Config(train=TrainConfig(target_accuracy="0.9")), r"^train.target_accuracy='0.9' must be of type"),
        (Config(train=TrainConfig(mesh={"data": 1})), r"^train.mesh=\{'data': 1\} must be a MeshConfig$"),
        (Config(train=TrainConfig(mesh=MeshConfig(seq=2.0))), r"^train.mesh.seq=2.0 must be of type int$"),
        (Config(model={"d_model": 16}), r"^model=\{'d_model': 16\} must be a ModelConfig$"),
        (Config(data={"seq_len": 8}), r"^data=dict is not the config of a task"),
        (Config(data=MQARConfig(seq_len="8")), r"^seq_len='8' must be an integer$"),
    ],
)  # fmt: skip
def test_a_config_built_by_hand_names_a_value_of_the_wrong_type(config, message):
    with pytest.raises(ValueError, match=message):
        config.validate()


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        # devices=[] was a ZeroDivisionError in mesh.py; overwrite=1 passed as True.
        (dict(devices=[]), ValueError, r"^run: devices=\[\] must be a non-empty list of jax.Device"),
        (dict(devices="cpu"), ValueError, r"^run: devices='cpu' must be a non-empty list"),
        (dict(overwrite=1), TypeError, r"^run: overwrite=1 must be True or False$"),
        (dict(resume="yes"), TypeError, r"^run: resume='yes' must be True or False$"),
        (dict(callbacks=print), TypeError, r"^run: callbacks=<built-in function print> must be a list"),
        (dict(callbacks=[1]), TypeError, r"^run: callbacks=\[1\] must be a list of functions"),
        (dict(on_start=3), TypeError, r"^run: on_start=3 must be a function or None$"),
    ],
)  # fmt: skip
def test_run_names_a_bad_argument_before_any_work(tmp_path, options, error, message):
    with pytest.raises(error, match=message):
        run(tiny(tmp_path / "run"), **options)
    assert not (tmp_path / "run").exists()
