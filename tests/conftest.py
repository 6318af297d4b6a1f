"""Test-wide settings: float64 available, no silent dtype or rank promotion, and a run that
compiles as little and as cheaply as it can.

Compiling is most of this suite's time (the arrays are tiny), so:
- XLA:CPU compiles for speed of compiling: LLVM at optimisation level 0 and, on jaxlib
  before 0.11 (whose XLA still has them), the classic elemental emitters instead of the MLIR
  fusion emitters. Together they compile this suite's programs 3.6x faster (25.6 -> 7.1 s
  of CPU for a set of op, gradient and model programs, jaxlib 0.10.2).
  The generated code is also one LLVM module, not split for parallel code generation: the
  two xdist workers already fill both cores, and each split part repeats the module's fixed
  costs (backend compile of a KDA gradient, a Gated DeltaNet gradient and a KDA + GDN-2
  model gradient: 8.7 -> 6.9 s, mean of 4 alternating runs; the suite 7 min 34 s -> 7 min
  6 s, user CPU 14.1 -> 13.3 min). These change only the machine code made from the
  optimised HLO: every numeric test keeps its tolerance, and the structural tests read that
  HLO, which none of the flags touches.
- One temporary directory per test run, made by the first process and shared by every
  xdist worker and subprocess of the run (never the user's home), holds a persistent
  compilation cache (a hit loads the identical executable: the cache is keyed by the
  program) and the one finished tiny training run that the tests which only read a run
  share (``finished_run``).
- The tests marked ``child`` (several devices, or a user's XLA flags) run in one child pytest
  session per kind (``support/child_session.py``; the hooks below start it, report its
  outcomes and, in the child, set it up and record what it ran); they go first.
- The tests marked ``costly`` (subprocesses, multi-device runs) go next, longest first,
  so that none is left to run alone at the end; xdist's worksteal scheduling (pyproject.toml)
  keeps neighbouring tests, which share compiled programs, on one worker.
Each value here is read from the environment first, so a run started by another (an xdist
worker, a subprocess test) inherits the first process's choices.
"""

import functools
import os
import shutil
import tempfile

import pytest
from support import child_session, runs

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
    # GDN_TEST_PLATFORMS=cuda runs the tests on a GPU instead (benchmarks/gpu_run.sh).
    JAX_PLATFORMS=os.environ.get("GDN_TEST_PLATFORMS", "cpu"),
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
COMPILE_FAST = {
    "xla_backend_optimization_level": "0",
    "xla_cpu_parallel_codegen_split_count": "1",
}
# XLA in jaxlib 0.11 and later has no classic emitters and no flag to choose them: an unknown
# flag in XLA_FLAGS is a fatal error there, so it is set only where XLA knows it.
CLASSIC_EMITTERS = {"xla_cpu_use_fusion_emitters": "false"}
CLASSIC_EMITTERS_UNTIL = (0, 11)


def compile_fast_flags(jaxlib_version: str) -> dict[str, str]:
    """``COMPILE_FAST``, with the classic emitters where this jaxlib's XLA still has them."""
    release = tuple(int(part) for part in jaxlib_version.split(".")[:2])
    if release < CLASSIC_EMITTERS_UNTIL:
        return {**COMPILE_FAST, **CLASSIC_EMITTERS}
    return dict(COMPILE_FAST)


def _set_up_test_process():
    """What a process that runs tests needs before it collects them: checked shapes and
    rare garbage collections (``process_setup``), the XLA flags, the session's numerics and
    the compilation cache. The xdist controller, which runs none, skips it (2.4 s of
    importing before it starts the workers)."""
    from support import process_setup

    process_setup.set_up()

    from gdn_jax.ops.mosaic import limits  # (after the shape checks' import hook)

    # Mosaic GPU's interpreter needs a thread of XLA's CPU pool a warpgroup beside the
    # caller's; a 2-core host's pool has two. The floor's JAX has no interpreter, and its
    # pool stays as it is. Before the backend starts (jax.default_backend below).
    limits.give_interpreter_threads()

    import jax
    import jaxlib

    from gdn_jax.training.xla_flags import add_cpu_flags, add_flags  # (checked too)

    # Importing gdn_jax starts no backend, so the flags still take effect here.
    add_flags(compile_fast_flags(jaxlib.__version__))
    child = os.environ.get(child_session.CHILD_ENV, "")
    if child.startswith("devices="):
        add_flags({"xla_force_host_platform_device_count": child.split("=")[1]})
    if child != "user_xla":  # a user's process keeps XLA:CPU's default library fusions
        add_cpu_flags()
    jax.config.update("jax_enable_x64", True)
    if jax.default_backend() == "gpu":
        # XLA multiplies float32 matrices in TF32 on a GPU by default (10 bits of mantissa);
        # the tolerance table's float32 row is for float32 arithmetic.
        jax.config.update("jax_default_matmul_precision", "highest")
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
        "child(devices=N, user_xla=False): run in the child pytest session of its kind "
        "(support/child_session.py): on N CPU devices, or compiled as a user's process is",
    )
    config.addinivalue_line(
        "markers",
        "slow: one of the suite's slowest tests (compiles for a TPU, eight CPU devices, whole "
        "programs in subprocesses), which the README's command leaves out (pyproject.toml's "
        "addopts) and CI runs after it: python -m pytest -n 2 -m slow",
    )
    config.addinivalue_line(
        "markers",
        "costly(seconds): a long test (subprocesses, several devices) and its time in a full "
        "run on 2 cores; it is scheduled first, longest first",
    )


IN_CHILD = child_session.CHILD_ENV in os.environ
# This process's child sessions' tests, by kind: {kind: [nodeid, ...]}.
CHILD_TESTS = {}


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected
def pytest_collection_modifyitems(config, items):
    def cost(item):
        marker = item.get_closest_marker("costly")
        # A child session's tests go first: the first of them waits for the whole session.
        in_child = not IN_CHILD and item.get_closest_marker("child")
        return 1e6 if in_child else marker.args[0] if marker else 0.0

    items.sort(key=cost, reverse=True)  # stable: the rest keep pytest's order
    CHILD_TESTS.clear()
    for item in items:
        marker = item.get_closest_marker("child")
        if marker is not None:
            CHILD_TESTS.setdefault(child_session.kind(marker), []).append(item.nodeid)


@functools.cache
def _child_outcomes(kind):
    return child_session.run(kind, CHILD_TESTS[kind], dict(os.environ), ROOTDIR)


ROOTDIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A ``child`` test runs its body in its child session and reports that outcome here."""
    marker = pyfuncitem.get_closest_marker("child")
    if marker is None or IN_CHILD:
        return None
    outcome, text = _child_outcomes(child_session.kind(marker))[pyfuncitem.nodeid]
    if outcome == "failed":
        pytest.fail(f"in the child session:\n{text}", pytrace=False)
    if outcome == "skipped":
        pytest.skip(f"in the child session: {text}")
    return True


def pytest_runtest_logstart(nodeid, location):
    if IN_CHILD:
        child_session.record(dict(nodeid=nodeid, when="start"))


def pytest_runtest_logreport(report):
    if IN_CHILD:
        text = report.longreprtext[-6000:] if report.outcome != "passed" else ""
        child_session.record(
            dict(nodeid=report.nodeid, when=report.when, outcome=report.outcome, text=text)
        )


def pytest_unconfigure(config):
    if _MADE_ROOT:
        shutil.rmtree(ROOT, ignore_errors=True)


def _empty_plot(log, path):
    path.write_bytes(b"")


@pytest.fixture(scope="session", autouse=True)
def empty_plots():
    """Every run in a test process writes an empty curves.png where its plot goes: drawing
    one is half a second of CPU, and only the tests that take ``real_plots`` read it.
    Yields the real ``plots.plot_metrics``."""
    from gdn_jax.training import plots

    real = plots.plot_metrics
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plots, "plot_metrics", _empty_plot)
        yield real


@pytest.fixture
def real_plots(empty_plots):
    """Runs draw their curves.png in this test."""
    from gdn_jax.training import plots

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plots, "plot_metrics", empty_plots)
        yield


@pytest.fixture(scope="session")
def subprocess_env():
    """The environment of this process, for the subprocess runs: it carries the shared
    compilation cache and the backend's optimisation level."""
    return dict(os.environ)


@pytest.fixture(scope="session")
def finished_run(subprocess_env):
    """A finished ``python train.py`` run of ``runs.TINY``, made once per test run. Read only."""
    return runs.finished_run(ROOT, subprocess_env)


@pytest.fixture(scope="module")
def model():
    """The small hybrid ``LanguageModel`` (``support.small_model.HYBRID``) whose input checks
    tests/layers/test_layer_inputs.py and tests/models/test_model_inputs.py call, one per test
    module; a module that defines its own ``model`` fixture uses that instead."""
    # Imported here, not above: gdn_jax must be imported after _set_up_test_process.
    from flax import nnx
    from support.small_model import HYBRID

    from gdn_jax import LanguageModel

    return LanguageModel(HYBRID, rngs=nnx.Rngs(0))
