"""The entry point of ``gdn-train`` and ``train.py``: Ctrl-C is one line from the first instant.

The command itself (``gdn_jax.training.cli``) imports JAX, which takes seconds, and any
module of the ``gdn_jax`` package imports it with the package. This module is outside the
package and imports the standard library alone until SIGINT is taken over, so a Ctrl-C while
the command starts is ``<prog>: interrupted before training began`` and exit status 130,
never a traceback; and it is never lost (``gdn_jax.training.entry``). Once the training loop
runs, it takes the signal over itself (a checkpoint, then exit status 130). The package
never imports this module: what it shares with it lives in ``gdn_jax.training.entry``.
"""

from __future__ import annotations

import signal


def main(argv=None) -> int:
    """The training command (``gdn_jax.training.cli.main``) on ``argv`` (``sys.argv[1:]``
    when None); returns its exit status."""
    # While JAX loads, a Ctrl-C is only noted: raised inside jaxlib's native module set-up it
    # can abort the interpreter (std::terminate) instead of propagating.
    noted = []
    signal.signal(signal.SIGINT, lambda signum, frame: noted.append(signum))
    from gdn_jax.training.cli import main as command
    from gdn_jax.training.entry import launch

    return launch(command, argv, noted)
