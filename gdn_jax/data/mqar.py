"""Multi-query associative recall (MQAR), the synthetic recall task of Zoology.

Zoology (Arora et al., 2023, "Zoology: Measuring and Improving Recall in Efficient Language
Models") builds each example as a key-value context followed by a query region::

    k1 v1 k2 v2 ... kn vn | . . kq . . . kr . ...
    \\___ context (2n) ___/ \\____ queries (T - 2n) ____/

Keys come from ``[1, vocab // 2)`` and values from ``[vocab // 2, vocab)``, distinct within an
example. The query region is cut into ``(T - 2n) // 2`` slots of two tokens; every key is asked
again, once, at the first token of one slot, and the label there is that key's value
(next-token convention: ``labels[:, t]`` is what the model must emit after reading
``inputs[:, :t + 1]``). Slots are drawn without replacement with probability following a power
law in their distance from the context, so most queries come soon after it.

Generation is plain NumPy, vectorised over examples; only the loops over the ``n`` pairs remain.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import no_type_check

import numpy as np

IGNORE_INDEX = -100


@no_type_check  # data: validate() names a field of the wrong type
@dataclasses.dataclass(frozen=True)
class MQARConfig:
    """Shape of an MQAR dataset; see the module docstring for the layout."""

    # Token ids are [0, vocab_size); 0 is the filler, the lower half keys, the upper half values.
    vocab_size: int = 8192
    # Tokens per example, context and query region together; must be even (two-token slots).
    seq_len: int = 256
    # Key-value pairs in the context, which is also the number of queries per example.
    num_kv_pairs: int = 16
    # Zoology's power-law exponent: slot gap g is drawn with weight a * g ** (a - 1).
    power_a: float = 0.01
    # Fillers: zeros when False; when True, random tokens from [1, vocab_size) other than the
    # example's own keys and values (so no extra query and no value leak; Zoology allows both).
    random_non_queries: bool = False

    def validate(self) -> None:
        """Checks the config describes a constructible dataset.

        Raises:
            ValueError: naming the offending field and its value.
        """
        for field in ("vocab_size", "seq_len", "num_kv_pairs"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(f"{field}={value!r} must be an integer")
        if isinstance(self.power_a, bool) or not isinstance(self.power_a, numbers.Real):
            raise ValueError(f"power_a={self.power_a!r} must be a number")
        if not isinstance(self.random_non_queries, bool):
            raise ValueError(f"random_non_queries={self.random_non_queries!r} must be a bool")
        if self.seq_len <= 0 or self.seq_len % 2:
            raise ValueError(f"seq_len={self.seq_len} must be even and positive")
        if self.vocab_size <= self.seq_len:
            raise ValueError(
                f"vocab_size={self.vocab_size} must exceed seq_len={self.seq_len} (Zoology's rule)"
            )
        if self.num_kv_pairs < 1:
            raise ValueError(f"num_kv_pairs={self.num_kv_pairs} must be at least 1")
        if 4 * self.num_kv_pairs > self.seq_len:
            raise ValueError(
                f"num_kv_pairs={self.num_kv_pairs} needs 4 * num_kv_pairs <= seq_len={self.seq_len}"
                " (the query region must have a slot per key)"
            )
        num_keys, num_values = _num_keys(self.vocab_size), _num_values(self.vocab_size)
        if self.num_kv_pairs > min(num_keys, num_values):
            raise ValueError(
                f"num_kv_pairs={self.num_kv_pairs} exceeds the {num_keys} keys / {num_values}"
                f" values available with vocab_size={self.vocab_size}"
            )
        if not self.power_a > 0:
            raise ValueError(f"power_a={self.power_a} must be positive")

    @property
    def num_slots(self) -> int:
        """Two-token query slots after the context."""
        return (self.seq_len - 2 * self.num_kv_pairs) // 2

    def describe(self) -> str:
        """The task in one line, for the training command's banner."""
        return f"seq_len={self.seq_len}, kv pairs={self.num_kv_pairs}, vocab={self.vocab_size}"


def _num_keys(vocab_size: int) -> int:
    # Token 0 is reserved for filler, so keys are [1, vocab // 2).
    return vocab_size // 2 - 1


def _num_values(vocab_size: int) -> int:
    return vocab_size - vocab_size // 2


def check_generation(fn: str, config, config_type: type, num_examples, seed) -> None:
    """The arguments of task generator ``fn``: a ``config_type`` (validated), a number of
    examples and a seed (NumPy's), each an integer >= 0; a ``TypeError`` or ``ValueError``
    names the one that is not."""
    if not isinstance(config, config_type):
        raise TypeError(
            f"{fn}: config must be a {config_type.__name__}, got {type(config).__name__}"
        )
    config.validate()
    for name, value in (("num_examples", num_examples), ("seed", seed)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"{fn}: {name}={value!r} must be an integer >= 0")


def split_seeds(seed: int) -> tuple[int, int]:
    """Derives independent train and test seeds from one seed.

    Spawning children of a ``SeedSequence`` gives streams that do not overlap, unlike ``seed``
    and ``seed + 1`` which a caller might also pick for some other split.

    Args:
        seed: Non-negative master seed.

    Returns:
        ``(train_seed, test_seed)``, distinct 64-bit integers, deterministic in ``seed``.
    """
    train, test = np.random.SeedSequence(seed).spawn(2)
    train_seed = int(train.generate_state(1, dtype=np.uint64)[0])
    test_seed = int(test.generate_state(1, dtype=np.uint64)[0])
    if train_seed == test_seed:  # 2**-64 odds, but a silent train/test overlap is unacceptable.
        raise RuntimeError(f"split_seeds({seed}) produced equal seeds; pick another seed")
    return train_seed, test_seed


@no_type_check  # a public entry point: it names a bad argument itself
def make_mqar(config: MQARConfig, *, num_examples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Generates MQAR examples following Zoology's ``multiquery_ar``.

    Args:
        config: Dataset shape; validated here.
        num_examples: Number of sequences N.
        seed: Seed for ``np.random.default_rng``; use ``split_seeds`` for disjoint splits.

    Returns:
        ``(inputs, labels)``, both int32 ``[B, T]``. ``labels`` is ``IGNORE_INDEX`` except at the
        ``num_kv_pairs`` query positions, where it holds the queried key's value.

    Raises:
        ValueError: if the config is invalid or ``num_examples`` is negative.
    """
    check_generation("make_mqar", config, MQARConfig, num_examples, seed)
    rng = np.random.default_rng(seed)
    n, half = config.num_kv_pairs, config.vocab_size // 2

    keys = 1 + _distinct_per_row(rng, num_examples, population=_num_keys(config.vocab_size), k=n)
    values = half + _distinct_per_row(
        rng, num_examples, population=_num_values(config.vocab_size), k=n
    )
    slots = _power_law_slots(rng, num_examples, config=config)

    inputs = np.zeros((num_examples, config.seq_len), dtype=np.int32)
    inputs[:, 0 : 2 * n : 2] = keys
    inputs[:, 1 : 2 * n : 2] = values
    if config.random_non_queries:
        used = np.concatenate([keys, values], axis=1)
        inputs[:, 2 * n :] = _fillers(
            rng, used, vocab_size=config.vocab_size, width=2 * config.num_slots
        )

    query_pos = 2 * n + 2 * slots
    # Key i goes to the i-th slot drawn, as in Zoology, so the pairing is as random as the draw.
    np.put_along_axis(inputs, query_pos, keys, axis=1)
    labels = np.full((num_examples, config.seq_len), IGNORE_INDEX, dtype=np.int32)
    np.put_along_axis(labels, query_pos, values, axis=1)
    return inputs, labels


def _distinct_per_row(
    rng: np.random.Generator, rows: int, *, population: int, k: int
) -> np.ndarray:
    """Ordered samples of ``k`` distinct ints from ``[0, population)``, one per row.

    Floyd's algorithm keeps the cost O(rows * k**2) instead of a ``[rows, population]`` shuffle;
    it yields a uniform subset but not a uniform order, hence the per-row shuffle at the end.
    """
    chosen = np.empty((rows, k), dtype=np.int64)
    for i, top in enumerate(range(population - k, population)):
        draw = rng.integers(0, top + 1, size=rows)
        seen = (chosen[:, :i] == draw[:, None]).any(axis=1)
        # `top` cannot be taken yet: earlier steps only drew from [0, top).
        chosen[:, i] = np.where(seen, top, draw)
    return rng.permuted(chosen, axis=1)


def _power_law_slots(rng: np.random.Generator, rows: int, *, config: MQARConfig) -> np.ndarray:
    """Draws ``num_kv_pairs`` distinct slot indices per row, in draw order.

    Slot ``s`` (0-based; gap ``s + 1``) has weight ``p_s = a * (s + 1) ** (a - 1)``. Sampling
    without replacement uses exponential races (Efraimidis-Spirakis): slot ``s`` finishes at
    ``E_s / p_s`` with ``E_s ~ Exp(1)``, and the finishing order has the same distribution as
    repeatedly drawing and renormalising, i.e. Zoology's ``np.random.choice(replace=False, p=p)``.
    Normalising ``p`` would scale every time alike, so it is skipped.
    """
    n, a = config.num_kv_pairs, config.power_a
    gaps = np.arange(1, config.num_slots + 1, dtype=np.float64)
    finish = rng.standard_exponential(size=(rows, config.num_slots)) * (gaps ** (1.0 - a) / a)
    first = np.argpartition(finish, n - 1, axis=1)[:, :n]
    order = np.argsort(np.take_along_axis(finish, first, axis=1), axis=1)
    return np.take_along_axis(first, order, axis=1)


def _fillers(
    rng: np.random.Generator, used: np.ndarray, *, vocab_size: int, width: int
) -> np.ndarray:
    """Random filler tokens from ``[1, vocab_size)`` minus the row's own keys and values.

    Zoology draws fillers from the whole vocabulary, so a filler can repeat a key (an extra,
    unlabelled query) or leak a value. Excluding the row's ``used`` tokens keeps every key asked
    exactly once and every value confined to the context; other rows' keys and values stay
    possible, so fillers remain hard to tell apart from real tokens. Clashes are redrawn
    (rejection sampling), which keeps the draw uniform over the allowed tokens.
    """
    rows = used.shape[0]
    tokens = rng.integers(1, vocab_size, size=(rows, width), dtype=np.int32)
    clash = _row_membership(tokens, used, vocab_size=vocab_size)
    # Each round redraws only the clashes; at most 2n of the vocab_size - 1 > 4n tokens clash.
    while clash.any():
        r, c = np.nonzero(clash)
        tokens[r, c] = rng.integers(1, vocab_size, size=r.size, dtype=np.int32)
        clash[r, c] = (used[r] == tokens[r, c][:, None]).any(axis=1)
    return tokens


def _row_membership(
    tokens: np.ndarray, used: np.ndarray, *, vocab_size: int, block: int = 256
) -> np.ndarray:
    """``out[i, j]`` is whether ``tokens[i, j]`` is among ``used[i]``.

    A ``[block, vocab_size]`` lookup table answers every token with one gather; ``block`` rows at
    a time keep the table cache-sized, and clearing only the entries set avoids a memset.
    """
    rows = tokens.shape[0]
    out = np.empty(tokens.shape, dtype=bool)
    table = np.zeros(block * vocab_size, dtype=bool)
    offsets = (vocab_size * np.arange(block, dtype=np.int64))[:, None]
    for start in range(0, rows, block):
        stop = min(start + block, rows)
        offset = offsets[: stop - start]
        marks = (used[start:stop] + offset).ravel()
        table[marks] = True
        np.take(table, tokens[start:stop] + offset, out=out[start:stop])
        table[marks] = False
    return out


def per_example_accuracy(predictions: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Fraction of supervised positions predicted right, per example.

    Args:
        predictions: Predicted token ids ``[B, T]``.
        labels: Targets ``[B, T]``, ``IGNORE_INDEX`` where unsupervised.

    Returns:
        float64 ``[B]``; NaN for an example with no supervised position.

    Raises:
        ValueError: if the shapes differ or are not ``[B, T]``.
    """
    predictions, labels = np.asarray(predictions), np.asarray(labels)
    if predictions.shape != labels.shape or labels.ndim != 2:
        raise ValueError(
            f"predictions.shape={predictions.shape} and labels.shape={labels.shape} must be the"
            " same [B, T]"
        )
    supervised = labels != IGNORE_INDEX
    correct = ((predictions == labels) & supervised).sum(axis=1)
    count = supervised.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return correct / count


def mqar_accuracy(predictions: np.ndarray, labels: np.ndarray) -> float:
    """Mean over examples of the per-example accuracy on supervised positions.

    Averaging per example first weighs every example equally, however many queries it has;
    examples with no supervised position are left out.

    Args:
        predictions: Predicted token ids ``[B, T]``.
        labels: Targets ``[B, T]``, ``IGNORE_INDEX`` where unsupervised.

    Returns:
        Accuracy in ``[0, 1]``.

    Raises:
        ValueError: if the shapes differ, or no example has a supervised position.
    """
    per_example = per_example_accuracy(predictions, labels)
    scored = per_example[~np.isnan(per_example)]
    if scored.size == 0:
        raise ValueError(f"labels.shape={np.shape(labels)} has no supervised position to score")
    return float(scored.mean())


@no_type_check  # a public entry point: it names a bad argument itself
def make_batch(inputs: np.ndarray, labels: np.ndarray) -> dict:
    """Host-side batch: ``inputs``, ``labels [B, T]`` plus the labelled ``positions`` and their
    ``targets`` ``[B, n]`` (MQAR labels the same number of positions in every example)."""
    for name, x in (("inputs", inputs), ("labels", labels)):
        if not (isinstance(x, np.ndarray) and x.ndim == 2 and np.issubdtype(x.dtype, np.integer)):
            shown = (
                f"shape {x.shape} and dtype {x.dtype}" if hasattr(x, "shape") else type(x).__name__
            )
            raise ValueError(f"make_batch: {name} must be integer NumPy arrays [B, T], got {shown}")
    if inputs.shape != labels.shape:
        raise ValueError(
            f"make_batch: inputs {inputs.shape} and labels {labels.shape} must have one shape"
        )
    rows, cols = np.nonzero(labels != IGNORE_INDEX)
    per_row = np.bincount(rows, minlength=labels.shape[0])
    if per_row.min() != per_row.max():
        raise ValueError(f"every example needs as many labels; got counts {sorted(set(per_row))}")
    positions = cols.reshape(labels.shape[0], -1).astype(np.int32)
    targets = np.take_along_axis(labels, positions, axis=1)
    return dict(inputs=inputs, labels=labels, positions=positions, targets=targets)
