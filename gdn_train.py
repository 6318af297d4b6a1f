"""The entry point of ``gdn-train`` and ``train.py``: Ctrl-C is one line from the first instant.

The command itself (``gdn_jax.training.cli``) imports JAX, which takes seconds, and any
module of the ``gdn_jax`` package imports it with the package. This module is outside the
package and imports the standard library alone, so it takes SIGINT over before JAX loads:
a Ctrl-C while the command starts is ``<prog>: interrupted before training began`` and exit
status 130, never a traceback; and it is never lost, even where Python cannot propagate it
(``interrupts_delivered``). Once the training loop runs, it takes the signal over itself
(a checkpoint, then exit status 130).
"""

from __future__ import annotations

import _thread
import contextlib
import signal
import sys
import threading
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


def main(argv=None) -> int:
    """The training command (``gdn_jax.training.cli.main``) on ``argv`` (``sys.argv[1:]``
    when None); returns its exit status."""
    # While JAX loads, a Ctrl-C is only noted: raised inside jaxlib's native module set-up it
    # can abort the interpreter (std::terminate) instead of propagating.
    noted = []
    signal.signal(signal.SIGINT, lambda signum, frame: noted.append(signum))
    from gdn_jax.training.cli import main as command

    signal.signal(signal.SIGINT, signal.default_int_handler)
    with interrupts_delivered():
        try:
            if noted:
                raise KeyboardInterrupt
            status = command(argv)
        except KeyboardInterrupt:  # before the command's own handling took it over
            print(f"{program_name()}: interrupted before training began", file=sys.stderr)
            status = 130
        # The command has ended: a Ctrl-C now would only break the interpreter's clean-up.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return status
