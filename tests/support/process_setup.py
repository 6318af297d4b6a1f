"""What every test process sets up before it first imports gdn_jax: conftest.py's, and that
of the multi-device check scripts, which run in processes of their own.

- Every shape annotation in gdn_jax is checked at call (trace) time: jaxtyping's import
  hook binds the dimension letters across a call's arguments and beartype checks them.
  ``set_up()`` first imports the libraries that gdn_jax's modules import. While a hooked
  module runs, jaxtyping's loader gives every module imported from it a bytecode cache name
  of its own; a library first imported then has no cached bytecode under that name, and is
  compiled from source in every process that cannot write it (PYTHONDONTWRITEBYTECODE):
  1.3 s of CPU per process, measured.
- Python's garbage collector runs its full collections rarely. Tracing makes objects by the
  million and the heap holds jax, flax and every compiled program, so a full collection
  takes about 0.2 s, and the default thresholds ran one every few seconds of tracing.
  ``(10000, 20, 20)`` took the collector from 4.3 to 1.2 s of CPU out of 55 s for three op
  and model modules, and from 2.6 to 0.6 s in ``mesh_checks.py``; a test cannot tell the
  difference.
"""

# The libraries gdn_jax imports at module level (flax.nnx alone brings in some 1,300
# modules), and the standard library modules it imports that the test processes may not
# have yet.
import argparse  # noqa: F401
import concurrent.futures  # noqa: F401
import contextlib
import fcntl  # noqa: F401
import gc
import shlex  # noqa: F401
import signal  # noqa: F401
import subprocess  # noqa: F401
import tempfile  # noqa: F401
import threading  # noqa: F401

import flax.nnx  # noqa: F401
import jax  # noqa: F401
import numpy  # noqa: F401
import optax  # noqa: F401
import orbax.checkpoint  # noqa: F401
import tqdm  # noqa: F401
import yaml  # noqa: F401
from jaxtyping import install_import_hook

# The interop extra, which CI's run of the op, layer and model tests on the newest versions
# does not install.
with contextlib.suppress(ImportError):
    import safetensors  # noqa: F401


def set_up():
    install_import_hook("gdn_jax", "beartype.beartype")
    gc.set_threshold(10_000, 20, 20)
