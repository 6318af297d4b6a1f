"""The MQAR dataset: layout invariants, determinism, query-gap law, config checks, accuracy."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gdn_jax.data import (
    IGNORE_INDEX,
    MQARConfig,
    make_batch,
    make_mqar,
    make_state_tracking,
    mqar_accuracy,
)
from gdn_jax.data.mqar import _row_membership, per_example_accuracy, split_seeds

SMALL = MQARConfig(vocab_size=128, seq_len=64, num_kv_pairs=8)
# 4 * num_kv_pairs == seq_len: every query slot is taken, the tightest legal layout.
TIGHT = MQARConfig(vocab_size=40, seq_len=32, num_kv_pairs=8)
CONFIGS = [
    SMALL,
    dataclasses.replace(SMALL, random_non_queries=True),
    TIGHT,
    dataclasses.replace(TIGHT, random_non_queries=True),
    MQARConfig(vocab_size=8192, seq_len=256, num_kv_pairs=16, random_non_queries=True),
]


def _config_id(config: MQARConfig) -> str:
    return (
        f"V{config.vocab_size}-T{config.seq_len}-n{config.num_kv_pairs}"
        f"-{'random' if config.random_non_queries else 'zero'}"
    )


@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_shapes_and_dtypes(config):
    inputs, labels = make_mqar(config, num_examples=7, seed=0)
    assert inputs.shape == labels.shape == (7, config.seq_len)
    assert inputs.dtype == labels.dtype == np.int32


def test_zero_examples():
    inputs, labels = make_mqar(SMALL, num_examples=0, seed=0)
    assert inputs.shape == labels.shape == (0, SMALL.seq_len)


def test_negative_num_examples_rejected():
    with pytest.raises(ValueError, match="num_examples=-1"):
        make_mqar(SMALL, num_examples=-1, seed=0)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        # A string count was a TypeError from '<', a negative seed NumPy's "expected
        # non-negative integer", a dict config an AttributeError.
        (lambda: make_mqar(SMALL, num_examples="2", seed=0), ValueError,
         r"^make_mqar: num_examples='2' must be an integer >= 0$"),
        (lambda: make_mqar(SMALL, num_examples=2, seed=-1), ValueError,
         r"^make_mqar: seed=-1 must be an integer >= 0$"),
        (lambda: make_mqar({}, num_examples=2, seed=0), TypeError,
         r"^make_mqar: config must be a MQARConfig, got dict$"),
        (lambda: make_state_tracking(SMALL, num_examples=2, seed=0), TypeError,
         r"^make_state_tracking: config must be a StateTrackingConfig, got MQARConfig$"),
        (lambda: make_batch([[1, 2]], [[1, 2]]), ValueError,
         r"^make_batch: inputs must be integer NumPy arrays \[B, T\], got list$"),
        (lambda: make_batch(np.zeros((2, 4), np.int32), np.zeros((2, 5), np.int32)), ValueError,
         r"^make_batch: inputs \(2, 4\) and labels \(2, 5\) must have one shape$"),
    ],
)  # fmt: skip
def test_the_generators_name_a_bad_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize("random_non_queries", [False, True])
def test_deterministic_in_seed(random_non_queries):
    config = dataclasses.replace(SMALL, random_non_queries=random_non_queries)
    first = make_mqar(config, num_examples=50, seed=3)
    again = make_mqar(config, num_examples=50, seed=3)
    other = make_mqar(config, num_examples=50, seed=4)
    np.testing.assert_array_equal(first[0], again[0])
    np.testing.assert_array_equal(first[1], again[1])
    assert not np.array_equal(first[0], other[0])


def test_split_seeds_distinct_and_deterministic():
    train_seed, test_seed = split_seeds(0)
    assert train_seed != test_seed
    assert split_seeds(0) == (train_seed, test_seed)
    assert split_seeds(1) != (train_seed, test_seed)
    train, _ = make_mqar(SMALL, num_examples=50, seed=train_seed)
    test, _ = make_mqar(SMALL, num_examples=50, seed=test_seed)
    assert not np.array_equal(train, test)
    # Same row twice across the split would be a leak; with these sizes it means a bug.
    assert not {row.tobytes() for row in train} & {row.tobytes() for row in test}


def _check_example(x: np.ndarray, y: np.ndarray, config: MQARConfig) -> None:
    n, half = config.num_kv_pairs, config.vocab_size // 2
    keys, values = x[0 : 2 * n : 2], x[1 : 2 * n : 2]
    query_x, query_y = x[2 * n :], y[2 * n :]

    assert len(set(keys.tolist())) == n and keys.min() >= 1 and keys.max() < half
    assert len(set(values.tolist())) == n and values.min() >= half
    assert values.max() < config.vocab_size
    assert np.all(y[: 2 * n] == IGNORE_INDEX)

    supervised = np.flatnonzero(query_y != IGNORE_INDEX)
    assert supervised.size == n
    assert np.all(supervised % 2 == 0), "queries sit at the first token of a two-token slot"
    value_of = dict(zip(keys.tolist(), values.tolist(), strict=True))
    for key in keys.tolist():
        (where,) = np.flatnonzero(query_x == key)  # exactly once
        assert query_y[where] == value_of[key]
    assert sorted(query_x[supervised].tolist()) == sorted(keys.tolist())

    assert not np.isin(query_x, values).any(), "a value leaked past the context"
    fillers = np.ones(query_x.shape, dtype=bool)
    fillers[supervised] = False
    if config.random_non_queries:
        assert query_x[fillers].min() >= 1 and query_x[fillers].max() < config.vocab_size
    else:
        assert np.all(query_x[fillers] == 0)


@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_every_example_is_well_formed(config):
    inputs, labels = make_mqar(config, num_examples=200, seed=11)
    for x, y in zip(inputs, labels, strict=True):
        _check_example(x, y, config)


def test_random_fillers_vary():
    config = dataclasses.replace(SMALL, random_non_queries=True)
    inputs, labels = make_mqar(config, num_examples=200, seed=5)
    fillers = inputs[:, 2 * config.num_kv_pairs :][labels[:, 2 * config.num_kv_pairs :] < 0]
    # Other examples' keys and values are fair game, so most of the vocabulary shows up.
    assert np.unique(fillers).size > 0.9 * (config.vocab_size - 1)


def _query_slots(labels: np.ndarray, config: MQARConfig) -> np.ndarray:
    _, cols = np.nonzero(labels != IGNORE_INDEX)
    return ((cols - 2 * config.num_kv_pairs) // 2).reshape(labels.shape[0], -1)


def test_small_power_a_favours_short_gaps():
    base = MQARConfig(vocab_size=512, seq_len=256, num_kv_pairs=8)
    _, skewed = make_mqar(dataclasses.replace(base, power_a=0.01), num_examples=2000, seed=0)
    _, flat = make_mqar(dataclasses.replace(base, power_a=1.0), num_examples=2000, seed=0)
    skewed_mean = _query_slots(skewed, base).mean()
    flat_mean = _query_slots(flat, base).mean()
    # Uniform over 120 slots averages 59.5 (slot index); the 0.01 law pulls well below it.
    assert abs(flat_mean - (base.num_slots - 1) / 2) < 2.0
    assert skewed_mean < 0.7 * flat_mean


def test_single_query_follows_power_law():
    # With one pair a query slot is a single draw, so its frequencies must match p exactly.
    config = MQARConfig(vocab_size=64, seq_len=16, num_kv_pairs=1, power_a=0.3)
    _, labels = make_mqar(config, num_examples=20_000, seed=2)
    counts = np.bincount(_query_slots(labels, config).ravel(), minlength=config.num_slots)
    gaps = np.arange(1, config.num_slots + 1)
    p = config.power_a * gaps ** (config.power_a - 1)
    np.testing.assert_allclose(counts / counts.sum(), p / p.sum(), atol=0.012)


def test_first_key_takes_the_first_drawn_slot():
    # Zoology pairs key i with the i-th slot drawn, so the first context key's slot is a plain
    # draw from p while the second key's slot is pushed later by the removal of the first.
    config = MQARConfig(vocab_size=64, seq_len=16, num_kv_pairs=2, power_a=0.3)
    inputs, _ = make_mqar(config, num_examples=20_000, seed=3)
    query_x = inputs[:, 2 * config.num_kv_pairs :]
    first_pos = np.argmax(query_x == inputs[:, :1], axis=1)
    counts = np.bincount(first_pos // 2, minlength=config.num_slots)
    gaps = np.arange(1, config.num_slots + 1)
    p = config.power_a * gaps ** (config.power_a - 1)
    np.testing.assert_allclose(counts / counts.sum(), p / p.sum(), atol=0.012)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"seq_len": 63}, r"seq_len=63"),
        ({"seq_len": 0}, r"seq_len=0"),
        ({"vocab_size": 64}, r"vocab_size=64"),
        ({"vocab_size": 30}, r"vocab_size=30"),
        ({"num_kv_pairs": 17}, r"num_kv_pairs=17.*4 \* num_kv_pairs"),
        ({"num_kv_pairs": 0}, r"num_kv_pairs=0"),
        ({"power_a": 0.0}, r"power_a=0.0"),
        ({"power_a": -1.0}, r"power_a=-1.0"),
    ],
)
def test_validate_names_the_bad_field(changes, message):
    config = dataclasses.replace(MQARConfig(vocab_size=128, seq_len=64, num_kv_pairs=4), **changes)
    with pytest.raises(ValueError, match=message):
        config.validate()
    with pytest.raises(ValueError, match=message):
        make_mqar(config, num_examples=1, seed=0)


def test_default_config_is_valid():
    MQARConfig().validate()
    TIGHT.validate()


def test_row_membership_matches_brute_force():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 20, size=(11, 9), dtype=np.int32)
    used = rng.integers(0, 20, size=(11, 3))
    got = _row_membership(tokens, used, vocab_size=20, block=4)  # blocks of 4, 4 and 3 rows
    want = (tokens[:, :, None] == used[:, None, :]).any(axis=2)
    np.testing.assert_array_equal(got, want)


def test_accuracy_hand_example():
    ignore = IGNORE_INDEX
    labels = np.array([[ignore, 5, 6, ignore, 7, 8], [1, ignore, ignore, 2, ignore, ignore]])
    predictions = np.array([[0, 5, 0, 9, 7, 0], [1, 0, 0, 2, 3, 3]])
    np.testing.assert_allclose(per_example_accuracy(predictions, labels), [0.5, 1.0])
    assert mqar_accuracy(predictions, labels) == pytest.approx(0.75)


def test_accuracy_weighs_examples_equally_and_skips_unsupervised():
    ignore = IGNORE_INDEX
    labels = np.array([[1, ignore, ignore, ignore], [1, 2, 3, 4], [ignore] * 4])
    predictions = np.array([[0, 0, 0, 0], [1, 2, 3, 4], [0, 0, 0, 0]])
    per_example = per_example_accuracy(predictions, labels)
    np.testing.assert_allclose(per_example[:2], [0.0, 1.0])
    assert np.isnan(per_example[2])
    # Per example, not per position: (0 + 1) / 2, where pooling would give 4 / 5.
    assert mqar_accuracy(predictions, labels) == pytest.approx(0.5)


def test_perfect_predictions_score_one():
    inputs, labels = make_mqar(SMALL, num_examples=20, seed=1)
    predictions = np.where(labels != IGNORE_INDEX, labels, inputs)
    assert mqar_accuracy(predictions, labels) == 1.0
    assert mqar_accuracy(inputs, labels) == 0.0  # the key itself is never its value


def test_accuracy_shape_mismatch():
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(2, 4\)"):
        mqar_accuracy(np.zeros((2, 3), dtype=int), np.zeros((2, 4), dtype=int))


def test_accuracy_without_supervision_raises():
    labels = np.full((2, 3), IGNORE_INDEX)
    with pytest.raises(ValueError, match="no supervised position"):
        mqar_accuracy(np.zeros((2, 3), dtype=int), labels)
