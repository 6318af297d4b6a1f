"""What the Mosaic GPU kernels take, in one place: their tile sizes and every limit they have,
forward and backward, rendered as one message form with the calling op's name.

``refusals(...)`` returns the reasons a call cannot run on the kernels (empty: it can), for
everything the forward and the backward will need, so that an explicit
``impl="mosaic_gpu"`` is refused before any work and ``"auto"`` never meets a limit later.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

F32 = jnp.float32

CHUNK = 64  # a warpgroup's wgmma rows: the chunk's tokens
VALUE_BLOCK = 64  # the value channels of one state-pass program: a wgmma's 64 rows of the state
PAD = 64  # channels are padded with zeros to multiples of this: a wgmma operand's width


# Mosaic GPU's API as these kernels are written for it (``plgpu.kernel`` with named grids,
# Lane semantics, the interpreter that runs them off a GPU) is jax >= 0.11's (Python >= 3.12).
HAS_KERNELS = hasattr(plgpu, "InterpretGPUParams")

# CUDA's launch limits: the grid's x up to 2^31 - 1 programs, y and z up to 65,535. Every
# kernel puts what grows with the input (chunks, sequences) on x, the last grid axis.
GRID_X, GRID_YZ = 2**31 - 1, 65_535
# Token offsets into the laid-out inputs are int32 in the kernels.
MOST_TOKENS = 2**31 - 1

# Mosaic GPU's interpreter runs each warpgroup of a program as a computation of its own on the
# CPU client's thread pool while the caller's computation waits in a callback: a kernel of two
# warpgroups needs three of the pool's threads, or the second never starts and the first waits
# at a barrier for ever. XLA sizes the pool at PJRT_NPROC (or NPROC) where set, else at the
# CPUs the process may run on, when the backend starts.
POOL_SIZE_VARIABLES = ("PJRT_NPROC", "NPROC")
MOST_WARPGROUPS = 2  # of any kernel here (scalar/grads.py)


def interpreter_pool() -> int:
    """The threads XLA's CPU client gives a process started with this environment."""
    for name in POOL_SIZE_VARIABLES:
        value = os.environ.get(name, "")
        if value.strip().isdigit():
            return int(value)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def interpreter_threads(warpgroups: int) -> int:
    """The pool a kernel of ``warpgroups`` warpgroups needs interpreted: one of one runs in
    the caller's computation, more each run beside it."""
    return warpgroups + 1 if warpgroups > 1 else 1


def give_interpreter_threads() -> None:
    """Set ``PJRT_NPROC`` so that XLA's CPU pool has the threads the interpreter needs for
    every kernel here, where this JAX has the interpreter and the pool would be smaller;
    call it before the CPU backend starts (a test session, a script that interprets)."""
    needed = interpreter_threads(MOST_WARPGROUPS)
    if HAS_KERNELS and interpreter_pool() < needed:
        os.environ["PJRT_NPROC"] = str(needed)


def interpreter_refusal(name: str, warpgroups: int) -> str | None:
    """Why kernel ``name`` of ``warpgroups`` warpgroups cannot run interpreted in this
    process (None: it can)."""
    needed = interpreter_threads(warpgroups)
    pool = interpreter_pool()
    if pool >= needed:
        return None
    return (
        f"{name}: Mosaic GPU's interpreter runs each of this kernel's {warpgroups} warpgroups "
        f"as a computation on XLA's CPU thread pool beside the caller's, which needs {needed} "
        f"threads; this process's pool has {pool}, so the kernel would wait for ever. Start "
        f"the process with PJRT_NPROC={needed} (or more) in its environment, or use "
        f"impl='chunked' off a GPU"
    )


# The named error of every route of a second derivative through the kernels' custom_vjp.
SECOND_ORDER = (
    "{op}: impl='mosaic_gpu' differentiates once, in reverse mode: its backward is "
    "Mosaic GPU kernels, which JAX cannot differentiate again (forward over reverse, "
    "jax.hessian, a gradient of a gradient); use impl='chunked' for second order"
)


def padded_width(dim: int) -> int:
    """``dim`` channels as the kernels hold them, padded with zeros to a multiple of ``PAD``."""
    return -(-dim // PAD) * PAD


def _common(inputs) -> list[str]:
    """What every kernel here needs: jax's Mosaic GPU API, chunks of a wgmma's rows, float32
    compute, and a launch within CUDA's and int32's limits."""
    reasons = []
    if not HAS_KERNELS:
        reasons.append(
            f"needs jax >= 0.11 (Python >= 3.12; the Mosaic GPU API the kernels are written "
            f"in, and its interpreter off a GPU), got jax {jax.__version__}"
        )
    if inputs.chunk_size != CHUNK:
        reasons.append(
            f"runs chunks of {CHUNK} tokens (a wgmma's rows), got chunk_size={inputs.chunk_size}"
        )
    if inputs.compute != F32:
        reasons.append(f"computes in float32, got inputs whose compute dtype is {inputs.compute}")
    if inputs.tokens > MOST_TOKENS:
        reasons.append(
            f"indexes tokens in int32: at most {MOST_TOKENS:,} laid out in chunks of {CHUNK}, "
            f"got {inputs.tokens:,}"
        )
    if inputs.v_heads > GRID_YZ:
        reasons.append(
            f"launches a program row per value head, at most {GRID_YZ:,}, got HV={inputs.v_heads}"
        )
    return reasons


def _widths(inputs, widest_key: int, widest_value: int, why: str) -> list[str]:
    key, value = padded_width(inputs.key_dim), padded_width(inputs.value_dim)
    if key <= widest_key and value <= widest_value:
        return []
    return [
        f"takes key dims up to {widest_key} and value dims up to {widest_value} with v of "
        f"dtype {jnp.dtype(inputs.v_dtype).name} ({why}), got K={inputs.key_dim}, "
        f"V={inputs.value_dim}"
    ]


def refusals(inputs) -> tuple[str, ...]:
    """Why the kernels (either gate kind's) cannot take ``inputs`` (``rule.KernelInputs``),
    forward and backward alike: K up to 128 and V up to 256 with bf16 v (one bf16 piece an
    operand), K up to 64 and V up to 128 with any other (two pieces an operand: the factors
    and grads kernels' shared memory holds no more)."""
    if jnp.dtype(inputs.v_dtype) == jnp.bfloat16:
        widths = _widths(inputs, 128, 256, "a Hopper block's shared memory")
    else:
        widths = _widths(inputs, 64, 128, "two bf16 pieces an operand; bf16 v takes 128 and 256")
    return (*_common(inputs), *widths)


def run_time_trips(chunks: int, key_dim: int, value_dim: int) -> dict[str, tuple[int, ...]]:
    """The trips of the loops each kernel bounds at run time, by kernel name, in the order of
    their code, for sequences of ``chunks`` chunks each: the model of their time
    (``gdn_jax.gpu_compile.sass``) cannot read them from the machine code. The state passes
    run over a sequence's chunks (read from its offsets); Gated DeltaNet's grads kernel adds
    a 0 from HBM to its loops over 64 channels at a time (``tiles.over_blocks``): on its
    keys' side the queries' and the keys' (its share of the key channels) and the state's
    rows (value channels), on its values' side the corrections' and the values' (value
    channels), the queries' and the keys' (the other share); the channel rules' grads kernel
    to its two warpgroups' loops over the value blocks."""
    passes = {f"{kind}_mosaic_{name}": (chunks,) for kind in ("gdn", "channel")
              for name in ("states", "reverse")}  # fmt: skip
    keys, values = padded_width(key_dim) // PAD, padded_width(value_dim) // PAD
    first, second = keys - keys // 2, keys // 2  # scalar/grads.py: the keys' side's, the other
    trips = (first, first, values, values, values, *(second, second)[: 2 * (second > 0)])
    return {**passes, "gdn_mosaic_grads": trips, "channel_mosaic_grads": (values, values)}
