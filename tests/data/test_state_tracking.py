"""State tracking: labels against permutations composed one by one in plain Python, the
config's checks, its YAML round trip and a tiny run of the training command on it."""

import itertools
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from gdn_jax.data.state_tracking import (
    GROUPS,
    StateTrackingConfig,
    make_state_tracking,
    running_composition,
    token_accuracy,
)
from gdn_jax.training.config import load_config, to_dict

CONFIGS = Path(__file__).resolve().parents[2] / "gdn_jax" / "configs"


def composed_one_by_one(tokens, n):
    """The label ids of ``tokens`` ``[B, T]``: each permutation of ``S_n`` applied in turn to
    the running one, as tuples (the ids index ``itertools.permutations``, as the task's)."""
    perms = list(itertools.permutations(range(n)))
    labels = []
    for row in tokens.tolist():
        state, out = tuple(range(n)), []
        for token in row:
            state = tuple(perms[token][state[j]] for j in range(n))  # state first, then token
            out.append(perms.index(state))
        labels.append(out)
    return np.array(labels)


@pytest.mark.parametrize("group", GROUPS)
def test_labels_are_the_running_composition(group):
    config = StateTrackingConfig(group=group, seq_len=37)  # not a power of two: a ragged scan
    inputs, labels = make_state_tracking(config, num_examples=6, seed=3)
    assert inputs.shape == labels.shape == (6, 37)
    assert inputs.dtype == labels.dtype == np.int32
    assert 0 <= inputs.min() and inputs.max() < config.vocab_size
    np.testing.assert_array_equal(labels, composed_one_by_one(inputs, config.degree))


def test_the_later_permutation_is_applied_last():
    # S3 ids: 1 is [0, 2, 1] (swaps 1 and 2), 2 is [1, 0, 2] (swaps 0 and 1). Swapping 1, 2
    # and then 0, 1 sends 0 -> 1, 1 -> 2, 2 -> 0: [1, 2, 0], id 3; the other order is id 4.
    np.testing.assert_array_equal(
        running_composition(np.array([[1, 2], [2, 1]]), 3), [[1, 3], [2, 4]]
    )


def test_s2_is_parity():
    inputs, labels = make_state_tracking(
        StateTrackingConfig(group="S2", seq_len=50), num_examples=4, seed=0
    )
    np.testing.assert_array_equal(labels, np.cumsum(inputs, axis=1) % 2)


def test_examples_depend_on_the_seed_alone():
    config = StateTrackingConfig(seq_len=16)
    first, again = (make_state_tracking(config, num_examples=8, seed=5) for _ in range(2))
    other = make_state_tracking(config, num_examples=8, seed=6)
    np.testing.assert_array_equal(first[0], again[0])
    assert not np.array_equal(first[0], other[0])
    assert make_state_tracking(config, num_examples=0, seed=0)[0].shape == (0, 16)


@pytest.mark.parametrize(
    ("config", "num_examples", "message"),
    [
        (StateTrackingConfig(group="S6"), 1, r"group='S6' is not a group; allowed: \('S2'"),
        (StateTrackingConfig(seq_len=0), 1, r"seq_len=0 must be positive"),
        (StateTrackingConfig(seq_len=4.0), 1, r"seq_len=4.0 must be an integer"),
        (
            StateTrackingConfig(),
            -1,
            r"^make_state_tracking: num_examples=-1 must be an integer >= 0$",
        ),
    ],
)
def test_bad_config_names_the_field(config, num_examples, message):
    with pytest.raises(ValueError, match=message):
        make_state_tracking(config, num_examples=num_examples, seed=0)


def test_token_accuracy_counts_every_position():
    labels = np.array([[0, 1, 2, 3], [4, 5, 0, 1]])
    predictions = labels.copy()
    predictions[0, 1] = predictions[1, 3] = 5
    assert token_accuracy(predictions, labels) == 6 / 8
    with pytest.raises(ValueError, match=r"predictions.shape=\(2, 3\) and labels.shape=\(2, 4\)"):
        token_accuracy(predictions[:, :3], labels)


@pytest.mark.parametrize("name", ["s3_gdn", "s3_gated_deltaproduct"])
def test_shipped_config_round_trips_through_yaml(tmp_path, name):
    config = load_config(CONFIGS / f"{name}.yaml")
    assert config.data == StateTrackingConfig(group="S3", seq_len=config.data.seq_len)
    resolved = to_dict(config)
    assert list(resolved["data"]) == ["task", "group", "seq_len"]
    assert resolved["data"]["task"] == "state_tracking"
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(resolved, sort_keys=False))
    assert load_config(path) == config


def test_the_two_configs_differ_only_in_the_mixer():
    gdn, product = (
        to_dict(load_config(CONFIGS / f"{name}.yaml"))
        for name in ("s3_gdn", "s3_gated_deltaproduct")
    )
    assert gdn["model"].pop("mixers") == ["gdn"]
    assert product["model"].pop("mixers") == ["gated_deltaproduct"]
    assert gdn["model"]["allow_neg_eigval"] and gdn["model"]["num_householder"] == 2
    del gdn["train"]["out_dir"], product["train"]["out_dir"]
    assert gdn == product


@pytest.fixture
def command(monkeypatch):
    """``cli.main`` in this process, as ``python train.py`` runs it."""
    import jax

    from gdn_jax.training import cli

    monkeypatch.setattr(sys, "argv", ["train.py"])
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main appends to it
    with jax.numpy_dtype_promotion("standard"):  # optax mixes a float with its int32 count
        yield cli.main


def test_a_bad_task_is_one_line_naming_the_field(command, capsys, tmp_path):
    status = command(["--set", "data.task=sorting", "--set", f"train.out_dir={tmp_path / 'r'}"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(lines) == 1, lines
    assert lines[0] == (
        "train.py: error: data.task='sorting' is not a task; allowed: ('mqar', 'state_tracking')"
    )
    assert not (tmp_path / "r").exists()


@pytest.mark.costly(5)
def test_a_tiny_run_of_the_s3_config_trains_end_to_end(command, capsys, tmp_path):
    tiny = [
        "model.d_model=8", "model.num_heads=1", "model.use_mlp=false", "model.impl=recurrent",
        "data.seq_len=8", "train.batch_size=4", "train.steps=2", "train.warmup_steps=1",
        "train.eval_every=2", "train.eval_examples=4", "train.progress=false",
        f"train.out_dir={tmp_path}",
    ]  # fmt: skip
    args = ["--config", "s3_gated_deltaproduct.yaml"]
    status = command([*args, *(x for item in tiny for x in ("--set", item))])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "data: state tracking in S3, seq_len=8, vocab=6" in out
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2]
    (evaluation,) = (r for r in records if r["kind"] == "eval")
    assert 0 <= evaluation["accuracy"] <= 1
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["data"]["task"] == (
        "state_tracking"
    )
