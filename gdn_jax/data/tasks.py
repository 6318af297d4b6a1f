"""The task registry: every synthetic dataset a run can train on, by the name ``data.task``.

A task is one module (a frozen config dataclass that follows ``TaskConfig``, a function that
makes examples, an accuracy) plus one entry in ``TASKS``. The training config reads a
``data:`` section as the config of the task it names (``training/config.py``), and the
training loop, the held-out set and ``--compile-only`` make their examples through
``make_examples``, so a new task needs nothing else to train.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol, no_type_check, runtime_checkable

import numpy as np

from gdn_jax.data.mqar import MQARConfig, make_mqar, mqar_accuracy
from gdn_jax.data.state_tracking import (
    StateTrackingConfig,
    make_state_tracking,
    token_accuracy,
)


@runtime_checkable
class TaskConfig(Protocol):
    """What the training package reads of any task's config."""

    # Tokens per example T.
    seq_len: int

    @property
    def vocab_size(self) -> int:
        """Token ids are ``[0, vocab_size)``; the model's ``vocab_size`` must equal it."""

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field."""

    def describe(self) -> str:
        """The task's shape in one line, for the training command's banner."""


MakeExamples = Callable[..., tuple[np.ndarray, np.ndarray]]  # (config, *, num_examples, seed)


@dataclasses.dataclass(frozen=True)
class Task:
    """One registered task: its config class, ``make(config, num_examples=, seed=)`` giving
    int32 ``(inputs, labels)`` ``[B, T]`` (``mqar.IGNORE_INDEX`` where unlabelled), and
    ``accuracy(predictions, labels)``, the figure the task is judged by."""

    config: type
    make: MakeExamples
    accuracy: Callable[[np.ndarray, np.ndarray], float]
    summary: str


TASKS = {
    "mqar": Task(MQARConfig, make_mqar, mqar_accuracy, "multi-query associative recall (Zoology)"),
    "state_tracking": Task(
        StateTrackingConfig,
        make_state_tracking,
        token_accuracy,
        "running composition of permutations of S2..S5 (the word problem)",
    ),
}
# The task of a data section without ``task``: every config written before tasks existed.
DEFAULT_TASK = "mqar"


@no_type_check  # it names a config of no task itself
def task_name(config: TaskConfig) -> str:
    """The ``TASKS`` name of ``config``'s class; ``ValueError`` for an unregistered class."""
    for name, task in TASKS.items():
        if type(config) is task.config:
            return name
    raise ValueError(
        f"data={type(config).__name__} is not the config of a task; registered: "
        f"{ {name: task.config.__name__ for name, task in TASKS.items()} }"
    )


def make_examples(
    config: TaskConfig, *, num_examples: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(inputs, labels)`` int32 ``[B, T]`` of ``config``'s task (see ``Task.make``)."""
    return TASKS[task_name(config)].make(config, num_examples=num_examples, seed=seed)
