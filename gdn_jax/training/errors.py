"""Every way a training run can be refused or end early, each with a one-line reason.

``RunError`` (and ``NothingToResume``) refuse a run before anything is written; the CLI turns
them into one line with exit status 2. The others end a run that started: a NaN loss, a
failed save, memory, each with exit status 1, and ``Interrupted``, 130 or 143.
"""

from __future__ import annotations

import signal
from pathlib import Path

import jax

# The commands' flags and the keyword arguments of ``run`` that they set.
FLAGS = {"--resume": "resume=True", "--overwrite": "overwrite=True"}


class RunError(ValueError):
    """A run that must not start, with a one-line reason for the user: written with the
    commands' flags (``command_text``, what they print), read as an exception with the
    keyword arguments a Python caller passes instead (``FLAGS``)."""

    def __init__(self, message: str):
        self.command_text = message
        for flag, keyword in FLAGS.items():
            message = message.replace(flag, keyword)
        super().__init__(message)


class NothingToResume(RunError):
    """``--resume`` found no checkpoint; ``overwrite`` tells whether a fresh start must
    delete what is there (logged steps) or may simply replace it."""

    def __init__(self, message: str, *, overwrite: bool):
        super().__init__(message)
        self.overwrite = overwrite


def unreadable(path: Path, reason: str) -> RunError:
    """The error for a run file that cannot be read or parsed."""
    return RunError(f"{path} cannot be read: {reason}")


def reason(error: BaseException, limit: int | None = 120) -> str:
    """An error's first line (at most ``limit`` characters), or its type when it says
    nothing: what a one-line message quotes of an error from a library."""
    text = str(error)
    return text.splitlines()[0][:limit] if text else type(error).__name__


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is the host's ``MemoryError`` or XLA's ``RESOURCE_EXHAUSTED``."""
    return isinstance(error, MemoryError) or (
        isinstance(error, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(error)
    )


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or Inf; the last good checkpoint is kept."""


class SaveError(RuntimeError):
    """A checkpoint could not be written (a full disk, say); the earlier ones are kept."""


class OutOfMemory(RuntimeError):
    """Building, compiling or running the model ran out of memory (host or device):
    ``error`` says where, ``sizes`` (``{"model.d_model": 64, ...}``) are the settings that
    decide how much memory a run takes, each named as the user sets it."""

    def __init__(self, error: BaseException, sizes: dict[str, object]):
        given = ", ".join(f"{name}={value}" for name, value in sizes.items())
        super().__init__(
            f"out of memory ({reason(error)}) with {given}; shrink "
            f"{', '.join(list(sizes)[:-1])} or {list(sizes)[-1]}"
        )


class Interrupted(RuntimeError):
    """SIGINT or SIGTERM stopped the run after a checkpoint at the current step; or stopped
    ``runs`` runs trained together, each after a checkpoint, in directories below
    ``out_dir``."""

    def __init__(self, signum: int, step: int, out_dir: Path, runs: int = 1):
        self.signum, self.step, self.out_dir = signum, step, out_dir
        name = signal.Signals(signum).name
        saved = "checkpoint saved" if runs == 1 else f"checkpoints of its {runs} runs saved"
        super().__init__(f"{name} at step {step}; {saved} in {out_dir}")
