"""Test-wide settings: float64 available, no silent dtype or rank promotion, and a run that
compiles as little and as cheaply as it can.

Compiling is most of this suite's time (the arrays are tiny), so:
- XLA:CPU compiles for speed of compiling: LLVM at optimisation level 0 and the classic
  elemental emitters instead of the MLIR fusion emitters. Together they compile this suite's
  programs 3.6x faster (25.6 -> 7.1 s of CPU for a set of op, gradient and model programs).
  Both change only the machine code made from the optimised HLO: every numeric test keeps
  its tolerance, and the structural tests read that HLO, which neither flag touches.
- One temporary directory per test run, made by the first process and shared by every
  xdist worker and subprocess of the run (never the user's home), holds a persistent
  compilation cache (a hit loads the identical executable: the cache is keyed by the
  program) and the one finished tiny training run that the tests which only read a run
  share (``finished_run``).
- The tests marked ``costly`` (subprocesses, multi-device runs) go first, longest first,
  so that none is left to run alone at the end; xdist's worksteal scheduling (pyproject.toml)
  keeps neighbouring tests, which share compiled programs, on one worker.
Each value here is read from the environment first, so a run started by another (an xdist
worker, a subprocess test) inherits the first process's choices.
"""

import os
import shutil
import tempfile

import pytest
import runs

_MADE_ROOT = "GDN_TEST_RUN_ROOT" not in os.environ
if _MADE_ROOT:
    os.environ["GDN_TEST_RUN_ROOT"] = tempfile.mkdtemp(prefix="gdn_jax-tests-")
ROOT = os.environ["GDN_TEST_RUN_ROOT"]
# Subprocesses store every program they compile: they compile the same tiny ones again and
# again. This process keeps only the ones that took a while (below).
os.environ.update(
    # The suite runs on CPU. libtpu, which the test extra installs to compile for TPUs ahead of
    # time (test_tpu_compile.py, a topology needs no backend), would otherwise start a TPU
    # backend in every process: on a host without TPUs it fails after printing warnings on
    # stderr (which the one-line error tests read), and holds libtpu's host lock as it does.
    JAX_PLATFORMS="cpu",
    JAX_COMPILATION_CACHE_DIR=os.path.join(ROOT, "jax-compilation-cache"),
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1",
)
# PyTorch (the interop references) runs its tiny ops on one thread: its OpenMP threads
# spin-wait after every op, on the core the other xdist worker needs.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Flags that only make XLA:CPU compile faster (train.py's own are added with them, so that a
# run of the command in a test process computes what it computes in a fresh interpreter, to
# the bit). A value the caller gave is kept.
COMPILE_FAST = {"xla_backend_optimization_level": "0", "xla_cpu_use_fusion_emitters": "false"}


def _set_up_test_process():
    """What a process that runs tests needs before it collects them: checked shapes and
    rare garbage collections (``process_setup``), the XLA flags, the session's numerics and
    the compilation cache. The xdist controller, which runs none, skips it (2.4 s of
    importing before it starts the workers)."""
    import process_setup

    process_setup.set_up()

    import jax

    from gdn_jax.training.xla_flags import add_cpu_flags, add_flags  # (checked too)

    # Importing gdn_jax starts no backend, so the flags still take effect here.
    add_flags(COMPILE_FAST)
    add_cpu_flags()
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    jax.config.update("jax_numpy_rank_promotion", "raise")
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    # Eager tests compile thousands of one-primitive programs; writing each to disk costs more
    # than compiling it again.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def pytest_configure(config):
    # xdist's workers have PYTEST_XDIST_WORKER set before they read this file.
    controller = "PYTEST_XDIST_WORKER" not in os.environ and config.getoption("numprocesses", 0)
    if not controller:
        _set_up_test_process()
    config.addinivalue_line(
        "markers",
        "costly(seconds): a long test (subprocesses, several devices) and its time in a full "
        "run on 2 cores; it is scheduled first, longest first",
    )


def pytest_collection_modifyitems(config, items):
    def cost(item):
        marker = item.get_closest_marker("costly")
        return marker.args[0] if marker else 0.0

    items.sort(key=cost, reverse=True)  # stable: the rest keep pytest's order


def pytest_unconfigure(config):
    if _MADE_ROOT:
        shutil.rmtree(ROOT, ignore_errors=True)


@pytest.fixture(scope="session")
def subprocess_env():
    """The environment of this process, for the subprocess runs: it carries the shared
    compilation cache and the backend's optimisation level."""
    return dict(os.environ)


@pytest.fixture(scope="session")
def finished_run(subprocess_env):
    """A finished ``python train.py`` run of ``runs.TINY``, made once per test run. Read only."""
    return runs.finished_run(ROOT, subprocess_env)
