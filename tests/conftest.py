"""Test-wide JAX settings: float64 available, and no silent dtype or rank promotion."""

import os

import jax
import pytest
from jaxtyping import install_import_hook

# Every shape annotation in gdn_jax is checked at call (trace) time in the test session:
# jaxtyping binds the dimension letters across a call's arguments and beartype checks them.
install_import_hook("gdn_jax", "beartype.beartype")

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(scope="session")
def subprocess_env(tmp_path_factory):
    """Environment for the subprocess runs: they compile the same tiny programs again and
    again, so they share a persistent compilation cache (about 25 s of compiling becomes 2 s
    of loading). The cache is keyed by the program, so a hit runs the identical executable."""
    cache = tmp_path_factory.getbasetemp().parent / "jax-compilation-cache"  # all xdist workers
    return dict(
        os.environ,
        JAX_COMPILATION_CACHE_DIR=str(cache),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1",
    )
