"""The Mosaic GPU kernels compiled for an H200 on this host (``gdn_jax.gpu_compile``), forward
and backward through the public ops: over every width ``limits.refusals`` accepts, each
kernel fits a Hopper block, spills nothing, runs its products on the tensor cores and leaves
no shared-memory store unfenced before a wgmma or a TMA store reads it (read from its SASS);
and at 2^23 tokens every rule's kernels launch (their grids within CUDA's limits), each with
a model of its time (every loop's trips known).

Traced on abstract shapes: nothing is computed, and T = 2^23 allocates nothing. jax >= 0.12
keeps a compiled Mosaic kernel for the process and dumps it once, so each program here has
shapes of its own.
"""

import functools
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

gpu_compile = pytest.importorskip("gdn_jax.gpu_compile")
if not gpu_compile.plugin_installed():
    pytest.skip('compiling for a GPU needs the CUDA plugin: pip install -e ".[gpu-compile]"',
                allow_module_level=True)  # fmt: skip
from gdn_jax.ops.mosaic import limits  # noqa: E402

if not limits.HAS_KERNELS:
    pytest.skip(f"the kernels need jax >= 0.11, got {jax.__version__}", allow_module_level=True)

from support.abstract import abstract_args  # noqa: E402

import gdn_jax  # noqa: E402
from gdn_jax.ops.rules import RULES  # noqa: E402

# The widths the kernels accept (limits.refusals), padded to multiples of 64: every kernel's
# resources depend on them and on the dtype, not on B, T or H.
WIDTHS = {
    jnp.bfloat16: [(k, v) for k in (64, 128) for v in (64, 128, 192, 256)],
    jnp.float32: [(64, 64), (64, 128)],
}
KERNELS = {"gated_delta_rule": "gdn_mosaic", "gdn2": "channel_mosaic"}
# The JAX of the H200 image, which a lent GPU runs the kernels with (constraints/gpu_image.txt):
# the spill-free claim is this one's. ptxas on jax 0.12's lowering spills a few bytes in two
# channel kernels (docs/benchmarks.md); every other check holds on both.
GPU_IMAGE_JAX = "0.11.2"


def training_step(name, arg_sets):
    """The gradient of a loss of every output of ``gdn_jax.<name>`` by its kernels, one call
    for each set of abstract arguments: a training step's forward and backward."""
    options = {RULES[name].steps: 2} if RULES[name].steps else {}
    op = functools.partial(getattr(gdn_jax, name), impl="mosaic_gpu", chunk_size=64, **options)

    def loss(arg_sets):
        total = 0.0
        for args in arg_sets:
            y, final = op(*args)
            total = total + jnp.sum(y.astype(jnp.float32)) + jnp.sum(final)
        return total

    return jax.grad(loss), arg_sets


def assert_sound(report, prefix):
    assert report.error is None, report.error
    assert report.kernels and all(k.name.startswith(prefix) for k in report.kernels)
    for kernel in report.kernels:
        assert kernel.launchable, (kernel.name, kernel.problem)
        if jax.__version__ == GPU_IMAGE_JAX:
            assert (kernel.spill_stores, kernel.spill_loads) == (0, 0), kernel.name
        assert kernel.tensor_core_instructions > 0, kernel.name
        assert kernel.unfenced_stores == 0, (kernel.name, kernel.unfenced_stores)


@pytest.mark.costly(120)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "float32"])
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_every_accepted_width_fits_spills_nothing_and_fences_every_store(name, dtype):
    seq_len = 128 + 64 * list(KERNELS).index(name) + 32 * (dtype == jnp.float32)
    arg_sets = [
        abstract_args(name, seq_len=seq_len, key_dim=k, value_dim=v, dtype=dtype)
        for k, v in WIDTHS[dtype]
    ]
    step, arg_sets = training_step(name, arg_sets)
    report = gpu_compile.report(step, arg_sets)
    assert_sound(report, KERNELS[name])
    stages = {k.name.removeprefix(KERNELS[name] + "_").split("_")[0] for k in report.kernels}
    assert stages == {"factors", "states", "reverse", "grads"}
    # Every width is its own kernel of each stage.
    assert len(report.kernels) == 4 * len(WIDTHS[dtype])


@pytest.mark.costly(60)
@pytest.mark.parametrize("name", sorted(n for n, rule in RULES.items() if rule.kernels))
def test_every_rule_launches_at_2_to_the_23_tokens(name):
    """The chunks grow on the grid's x, the only axis past 65,535 programs: 2^23 tokens are
    131,072 chunks, which on y or z would not launch."""
    # Each rule its own length: KDA's and GDN-2's kernels are the same, and jax >= 0.12 dumps
    # a kernel the process compiled before no more.
    seq_len = 2**23 + 64 * sorted(RULES).index(name)
    args = abstract_args(name, seq_len=seq_len, key_dim=64, value_dim=64, dtype=jnp.bfloat16,
                         heads=(1, 1))  # fmt: skip
    step, arg_sets = training_step(name, [args])
    chunks = -(-seq_len * (2 if RULES[name].steps else 1) // 64)  # a step a token each
    trips = limits.run_time_trips(chunks, key_dim=64, value_dim=64)
    report = gpu_compile.report(step, arg_sets, open_trips=trips)
    prefix = "channel_mosaic" if name in ("kda", "gdn2") else "gdn_mosaic"
    assert_sound(report, prefix)
    # The model of every kernel's time has each loop's trips: read from its code, or the
    # ones limits.run_time_trips says the kernel bounds at run time.
    for kernel in report.kernels:
        assert kernel.model_problem is None, (kernel.name, kernel.model_problem)
        assert kernel.modelled_us > 0, kernel.name
    assert max(kernel.grid[0] for kernel in report.kernels) >= 2**23 // 64
    assert report.launches.total <= 40 and not report.launches.loops


def test_the_readmes_gpu_compile_block_runs_as_written_and_prints_the_kernels():
    """The README's block that compiles for an H200 (its install line is this JAX's set),
    run as written in a fresh process: it prints every kernel of the op, launchable."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    (block,) = [
        b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "gdn_jax.gpu_compile" in b
    ]
    result = subprocess.run(
        [sys.executable, "-c", block], capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    kernels = [line for line in result.stdout.splitlines() if line.startswith("kernel ")]
    assert {line.split()[1].rsplit("_", 1)[0] for line in kernels} == {
        "gdn_mosaic_factors",
        "gdn_mosaic_states",
    }
    assert all(line.endswith("; launchable") for line in kernels), kernels


def test_traced_here_and_lowered_for_a_gpu_the_kernels_compile():
    """Compiling ahead of time the standard JAX way on this CPU host: ``jax.jit(op).trace(
    arguments placed on an H200).lower()``. Tracing cannot tell the platform, so the kernels'
    form waits for the lowering (``mosaic/by_platform.py``): lowered for CUDA they are the
    compiled Mosaic GPU kernels, with none of the interpreter's host callbacks."""
    device = gpu_compile.target_device("h200")
    placed = jax.sharding.SingleDeviceSharding(device)
    args = [
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed)
        for a in abstract_args("kda", seq_len=320, key_dim=64, value_dim=64, dtype=jnp.bfloat16)
    ]
    lowered = jax.jit(functools.partial(gdn_jax.kda, impl="mosaic_gpu")).trace(*args).lower()
    text = lowered.as_text()
    assert "mosaic_gpu" in text and "callback" not in text
    assert lowered.compile().memory_analysis() is not None
