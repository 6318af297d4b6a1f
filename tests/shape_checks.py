"""Every shape annotation in gdn_jax checked at call (trace) time in the tests: jaxtyping's
import hook binds the dimension letters across a call's arguments and beartype checks them.

``install()`` comes before gdn_jax is first imported, and first imports the libraries that
gdn_jax's modules import. While a hooked module runs, jaxtyping's loader gives every module
imported from it a bytecode cache name of its own; a library first imported then has no
cached bytecode under that name, and is compiled from source in every process that cannot
write it (PYTHONDONTWRITEBYTECODE): 1.3 s of CPU per process, measured.
"""

# The libraries gdn_jax imports at module level (flax.nnx alone brings in some 1,300
# modules), and the standard library modules it imports that the test processes may not
# have yet.
import argparse  # noqa: F401
import concurrent.futures  # noqa: F401
import fcntl  # noqa: F401
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
import safetensors  # noqa: F401
import tqdm  # noqa: F401
import yaml  # noqa: F401
from jaxtyping import install_import_hook


def install():
    install_import_hook("gdn_jax", "beartype.beartype")
