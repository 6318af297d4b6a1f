"""How a command of the package starts and ends around a Ctrl-C: its name, and a
``KeyboardInterrupt`` that is never lost.

``gdn_train.py``, outside the package, notes a Ctrl-C while JAX loads (any module here
imports JAX with the package, so that part cannot live here) and hands over to ``launch``;
``python -m gdn_jax.training.cli`` and ``python -m gdn_jax.sweep`` enter here directly.
"""

from __future__ import annotations

import _thread
import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

# How long a KeyboardInterrupt that Python could not propagate waits before it is raised
# again: long enough for the code that swallowed it (a garbage collection) to have returned.
REDELIVERY_S = 0.01


@contextlib.contextmanager
def interrupts_delivered():
    """SIGINT raises ``KeyboardInterrupt`` where it can propagate.

    Where it cannot (a garbage-collection callback, such as the one JAX registers, a
    ``__del__``, a weakref callback), Python prints ``Exception ignored in ...`` with a
    traceback and goes on: a Ctrl-C in the first second of a run was lost and the run
    trained to its end. Here such a ``KeyboardInterrupt`` is raised again in the main thread
    once that code has returned: from another thread, so that it does not land in this
    hook, which is itself such a place."""
    previous = sys.unraisablehook

    def deliver_again(unraisable):
        if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
            threading.Timer(REDELIVERY_S, _thread.interrupt_main).start()
        else:
            previous(unraisable)

    sys.unraisablehook = deliver_again
    try:
        yield
    finally:
        sys.unraisablehook = previous


def program_name() -> str:
    """``train.py`` when run as the repository's script, else the installed command's name."""
    return "train.py" if Path(sys.argv[0]).name == "train.py" else "gdn-train"


def launch(command: Callable[..., int], argv=None, noted: Sequence[int] = ()) -> int:
    """``command(argv)``'s exit status, a Ctrl-C before the command's own handling takes it
    over being one line and 130; ``noted`` holds the signals that arrived while JAX loaded
    (the entry script's note, read only once SIGINT raises again, so that none is missed)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with interrupts_delivered():
        try:
            if noted:
                raise KeyboardInterrupt
            status = command(argv)
        except KeyboardInterrupt:
            print(f"{program_name()}: interrupted before training began", file=sys.stderr)
            status = 130
        # The command has ended: a Ctrl-C now would only break the interpreter's clean-up.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return status
