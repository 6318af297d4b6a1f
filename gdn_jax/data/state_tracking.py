"""State tracking: the running composition of permutations, the word problem of ``S_n``.

Each token is one element of the symmetric group ``S_n`` (``n`` in 2..5), and the label at
every position ``t`` is the composition of the tokens at positions ``0..t``::

    inputs  x_0  x_1        x_2             ...
    labels  x_0  x_1 . x_0  x_2 . x_1 . x_0 ...

where ``a . b`` applies ``b`` first, then ``a``. This is the task of Merrill et al. (2024,
"The Illusion of State in State-Space Models"), on which Grazzi et al. (2024, "Unlocking
State-Tracking in Linear RNNs Through Negative Eigenvalues") and Siems et al. (2025,
"DeltaProduct") test how much of a group a linear recurrence can follow. A token id is the
index of its permutation in ``permutations(n)``, the lexicographic list of ``S_n``, so id 0
is the identity; tokens are uniform over the group. Every position is supervised.

Why it tells the mixers apart: a token's state transition in Gated DeltaNet is one
generalised Householder matrix ``alpha (I - beta k k^T)``, whose eigenvalues are real (``1``
and ``alpha (1 - beta)``, in ``[-1, 1]`` with ``beta`` in ``[0, 2]``). ``S_2`` (parity) needs
only the reflection ``beta = 2``, but a 3-cycle of ``S_3`` acts as a rotation by 120 degrees
(eigenvalues ``exp(+-2 pi i / 3)``) in every real representation in which it is not the
identity, and a rotation is a product of two reflections, never one. Gated DeltaProduct with
``n_h = 2`` steps a token multiplies two such matrices per token, so one layer of it can
represent ``S_3``, and one layer of Gated DeltaNet, even with negative eigenvalues, cannot
(the argument of Grazzi et al. and Siems et al.; two layers of it can, Siems et al. show,
since ``S_3`` is the dihedral group of the triangle).

Labels are made by a doubling scan over the group's Cayley table, vectorised over examples
and positions: ``log2(T)`` table look-ups of the whole ``[B, T]`` array.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import typing
from typing import Literal, no_type_check

import numpy as np

from gdn_jax.data.mqar import check_generation

Group = Literal["S2", "S3", "S4", "S5"]
GROUPS = typing.get_args(Group)


@no_type_check  # data: validate() names bad fields
@dataclasses.dataclass(frozen=True)
class StateTrackingConfig:
    """Shape of a state-tracking dataset; see the module docstring for the task."""

    # The symmetric group whose elements are the tokens: S2 (parity), S3, S4 or S5.
    group: Group = "S3"
    # Tokens per example, every one of them labelled.
    seq_len: int = 64

    def validate(self) -> None:
        """Checks the config describes a constructible dataset.

        Raises:
            ValueError: naming the offending field and its value.
        """
        if self.group not in GROUPS:
            raise ValueError(f"group={self.group!r} is not a group; allowed: {GROUPS}")
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int):
            raise ValueError(f"seq_len={self.seq_len!r} must be an integer")
        if self.seq_len < 1:
            raise ValueError(f"seq_len={self.seq_len} must be positive")

    @property
    def degree(self) -> int:
        """``n`` of ``S_n``: the permutations act on ``range(n)``."""
        return int(self.group[1:])

    @property
    def vocab_size(self) -> int:
        """Token ids (and label ids): the ``n!`` elements of the group."""
        return math.factorial(self.degree)

    def describe(self) -> str:
        """The task in one line, for the training command's banner."""
        return f"state tracking in {self.group}, seq_len={self.seq_len}, vocab={self.vocab_size}"


@functools.cache
def permutations(n: int) -> np.ndarray:
    """``S_n`` in lexicographic order, int64 ``[n!, n]``: row ``i`` is the permutation with
    token id ``i``, mapping ``j`` to ``row[j]``; row 0 is the identity."""
    return np.array(list(itertools.permutations(range(n))), dtype=np.int64)


@functools.cache
def cayley_table(n: int) -> np.ndarray:
    """int64 ``[n!, n!]``: ``table[a, b]`` is the id of ``a . b`` (``b`` first, then ``a``),
    the permutation ``j -> perms[a][perms[b][j]]``."""
    perms = permutations(n)
    ids = np.arange(len(perms))
    composed = perms[ids[:, None, None], perms[None, :, :]]  # [a, b, j]
    # A permutation read as a base-n number; lexicographic order sorts these codes.
    place = n ** np.arange(n - 1, -1, -1)
    return np.searchsorted(perms @ place, composed @ place)


def running_composition(tokens: np.ndarray, n: int) -> np.ndarray:
    """Labels of ``tokens`` (ids ``[B, T]``): ``out[:, t] = tokens[:, t] . ... . tokens[:, 0]``.

    A Hillis-Steele scan: after the round of shift ``d``, ``out[:, t]`` is the product of
    the ``2d`` tokens ending at ``t`` (fewer near the start), since composition is
    associative and the later window goes on the left.
    """
    table = cayley_table(n)
    out = np.array(tokens, dtype=np.int64)
    shift = 1
    while shift < out.shape[1]:
        # The right-hand side is read whole before the assignment writes.
        out[:, shift:] = table[out[:, shift:], out[:, :-shift]]
        shift *= 2
    return out


@no_type_check  # a public entry point: it names a bad argument itself
def make_state_tracking(
    config: StateTrackingConfig, *, num_examples: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Generates state-tracking examples: uniform group elements and their running products.

    Args:
        config: Dataset shape; validated here.
        num_examples: Number of sequences B.
        seed: Seed for ``np.random.default_rng``; use ``mqar.split_seeds`` for disjoint splits.

    Returns:
        ``(inputs, labels)``, both int32 ``[B, T]`` of ids in ``[0, vocab_size)``; every
        position is labelled.

    Raises:
        ValueError: if the config is invalid or ``num_examples`` is negative.
    """
    check_generation("make_state_tracking", config, StateTrackingConfig, num_examples, seed)
    rng = np.random.default_rng(seed)
    inputs = rng.integers(0, config.vocab_size, size=(num_examples, config.seq_len))
    labels = running_composition(inputs, config.degree)
    return inputs.astype(np.int32), labels.astype(np.int32)


def token_accuracy(predictions: np.ndarray, labels: np.ndarray) -> float:
    """Fraction of all ``B * T`` positions whose group element is predicted right.

    Every position is labelled and every example has ``T`` of them, so this is also the mean
    over examples of the per-example accuracy that the training loop logs. It counts the
    easy early positions (the label at ``t = 0`` is the token itself) as much as the late
    ones; the accuracy at the last position alone is ``predictions[:, -1] == labels[:, -1]``.

    Args:
        predictions: Predicted ids ``[B, T]``.
        labels: Targets ``[B, T]``.

    Returns:
        Accuracy in ``[0, 1]``.

    Raises:
        ValueError: if the shapes differ, are not ``[B, T]`` or hold no position.
    """
    predictions, labels = np.asarray(predictions), np.asarray(labels)
    if predictions.shape != labels.shape or labels.ndim != 2 or labels.size == 0:
        raise ValueError(
            f"predictions.shape={predictions.shape} and labels.shape={labels.shape} must be the"
            " same non-empty [B, T]"
        )
    return float(np.mean(predictions == labels))
