"""``impl="pallas"``: the chunked gated delta rule as Pallas kernels, forward and backward
(``ops/chunked_pallas.py``), run here in Pallas's interpret mode, against the XLA chunked form
on outputs, final states and the gradient of every input (the initial state included); and
its lowering for a GPU, which this CPU host can do without one."""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.reference import random_inputs, random_state
from support.tolerance import assert_close

import gdn_jax
from gdn_jax.ops import chunked_pallas


@functools.cache
def outputs_and_grads(impl, chunk_size, packed):
    """``run(q, k, v, log_alpha, beta, state, ct_y, ct_s[, cu]) -> (y, final, grads)`` of the
    batched op with ``impl``, one jitted program per case."""

    def run(q, k, v, la, b, state, ct_y, ct_s, cu=None):
        def loss(*args):
            y, s = gdn_jax.gated_delta_rule(
                *args[:5], initial_state=args[5], impl=impl, chunk_size=chunk_size, cu_seqlens=cu
            )
            return jnp.sum(y * ct_y) + jnp.sum(s * ct_s), (y, s)

        grads, (y, s) = jax.grad(loss, argnums=range(6), has_aux=True)(q, k, v, la, b, state)
        return y, s, grads

    return jax.jit(run)


def assert_same(inputs, dtype, chunk_size, cu=None, err_msg=""):
    q, v = inputs[0], inputs[2]
    num_states = q.shape[0] if cu is None else cu.shape[0] - 1
    state = random_state(7, num_states, v.shape[2], v.shape[3], q.shape[3], dtype=dtype)
    ct_y = random_state(8, *v.shape, dtype=dtype)
    ct_s = random_state(9, *state.shape, dtype=dtype)
    args = (*inputs, state, ct_y, ct_s) + (() if cu is None else (cu,))
    kernel = outputs_and_grads("pallas", chunk_size, cu is not None)(*args)
    xla = outputs_and_grads("chunked", chunk_size, cu is not None)(*args)
    for name, a, e in zip(("y", "final"), kernel[:2], xla[:2], strict=True):
        assert_close(a, e, dtype, err_msg=f"{err_msg} {name}")
    names = ("q", "k", "v", "log_alpha", "beta", "initial_state")
    for name, a, e in zip(names, kernel[2], xla[2], strict=True):
        assert a.dtype == e.dtype, (name, a.dtype, e.dtype)
        assert_close(a, e, dtype, err_msg=f"{err_msg} d{name}")


# (H, HV): one head; grouped value heads (two per key head); several key heads.
@pytest.mark.parametrize("heads", [(1, 1), (1, 2), (2, 4)])
def test_kernel_equals_chunked_form_over_head_layouts(heads):
    # T = 45 over chunks of 16: a tail chunk of 13 tokens; K and V off the kernel's tiles.
    inputs = random_inputs(0, 45, 12, 20, dtype=jnp.float64, lead=(2,), heads=heads)
    assert_same(inputs, jnp.float64, 16, err_msg=f"heads={heads}")


def test_packed_sequences_with_an_empty_one_and_initial_states():
    inputs = random_inputs(1, 40, 8, 16, dtype=jnp.float64, lead=(1,), heads=(2, 4))
    cu = jnp.array([0, 7, 7, 30, 40], jnp.int32)  # the second sequence has no tokens
    assert_same(inputs, jnp.float64, 16, cu=cu)


@pytest.fixture
def launched(monkeypatch):
    """``launched(**fields)``: the kernels launched so for the test, compiled afresh (jit
    caches programs by their inputs, not by the launch they read while tracing)."""

    def launch(**fields):
        monkeypatch.setattr(chunked_pallas, "LAUNCH", chunked_pallas.Launch(**fields))
        jax.clear_caches()

    yield launch
    jax.clear_caches()  # the default launch for the tests after this one


@pytest.mark.parametrize("packed", [False, True])
def test_value_blocks_of_both_kernels_equal_one_block(launched, packed):
    """Forward programs of 16 value channels and backward programs of 8 (V = 20 pads to 32:
    two and four blocks a value head), whose shares of the gradients of q, k and the gates
    are summed after the kernel."""
    launched(block_v=16, backward_block_v=8)
    inputs = random_inputs(3, 45, 12, 20, dtype=jnp.float64, lead=(1,), heads=(2, 4))
    cu = jnp.array([0, 7, 7, 30, 45], jnp.int32) if packed else None
    assert_same(inputs, jnp.float64, 16, cu=cu, err_msg=f"packed={packed}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_narrow_inputs_keep_their_dtype_and_agree(dtype):
    """q, k and v in float32 or bf16 (state and gates in float32): the outputs in v's dtype,
    every gradient in its input's, within that dtype's tolerance of the XLA form (with the
    L2 norm of q and k inside the op)."""
    q, k, v, la, b = random_inputs(2, 40, 16, 16, lead=(1,), heads=(1, 2))
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    run = functools.partial(gdn_jax.gated_delta_rule, chunk_size=16, use_qk_l2norm=True)
    (y, s), (y_ref, s_ref) = (
        jax.jit(functools.partial(run, impl=impl))(q, k, v, la, b) for impl in ("pallas", "chunked")
    )
    assert y.dtype == dtype and s.dtype == jnp.float32
    assert_close(y.astype(jnp.float32), y_ref.astype(jnp.float32), dtype)
    assert_close(s, s_ref, dtype)
    ct_y = random_state(6, *v.shape).astype(dtype)

    def grads(impl):
        def loss(*args):
            y, _ = run(*args, impl=impl)
            return jnp.sum((y * ct_y).astype(jnp.float32))

        return jax.jit(jax.grad(loss, argnums=range(5)))(q, k, v, la, b)

    names = ("q", "k", "v", "log_alpha", "beta")
    for name, a, e in zip(names, grads("pallas"), grads("chunked"), strict=True):
        assert a.dtype == e.dtype, (name, a.dtype, e.dtype)
        assert_close(a.astype(jnp.float32), e.astype(jnp.float32), dtype, err_msg=name)


def test_strong_decays_and_a_full_reset():
    """A -inf gate (a full reset) and gates of -30 inside a chunk: the segment sums keep
    the decays after them exact, as the XLA form's do."""
    q, k, v, la, b = random_inputs(3, 32, 8, 8, dtype=jnp.float64, lead=(1,), heads=(1, 1))
    la = np.asarray(la).copy()
    la[0, 5, 0], la[0, 20, 0] = -np.inf, -30.0
    assert_same((q, k, v, jnp.asarray(la), b), jnp.float64, 16)


def test_other_rules_name_the_kernel_they_lack():
    q, k, v, la, b = random_inputs(4, 16, 8, 8, lead=(1,), heads=(1, 1), per_channel=True)
    with pytest.raises(ValueError) as info:
        gdn_jax.kda(q, k, v, la, b, impl="pallas")
    assert str(info.value) == (
        'kda: impl="pallas" has a kernel for gated_delta_rule only; use impl="chunked"'
    )


def _triton_deprecation_from_jax_0_11():
    """JAX deprecated Pallas's Triton backend in 0.11 and warns at each lowering through it
    (an error once JAX accelerates the deprecation, which this test would then report)."""
    if jax.__version_info__ < (0, 11):
        return contextlib.nullcontext()
    return pytest.warns(DeprecationWarning, match="Pallas Triton backend is deprecated")


def test_float32_products_on_a_gpu_take_three_tf32_passes_unless_asked_for_ieee(
    monkeypatch, launched
):
    """On a GPU float32 products run on the tensor cores at about float32's accuracy (IEEE
    float32 products became scalar FMAs and spilled registers: benchmarks/triton_sm90.py);
    float64, and the interpret mode (XLA:CPU has no TF32), keep full precision."""
    three_passes = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    full = jax.lax.Precision.HIGHEST
    assert chunked_pallas._precision(jnp.float32) == full  # this host: interpret mode
    monkeypatch.setattr(chunked_pallas, "_on_gpu", lambda: True)
    assert chunked_pallas._precision(jnp.float32) == three_passes
    assert chunked_pallas._precision(jnp.float64) == full
    launched(products="ieee")
    assert chunked_pallas._precision(jnp.float32) == full


@pytest.mark.parametrize("backward_block_v", [None, 16])
def test_lowers_for_a_gpu_through_triton(monkeypatch, launched, backward_block_v):
    """The forward and backward program, lowered for CUDA on this CPU host (no GPU needed):
    the two kernels are Triton calls, at shapes off their tiles (T = 40, K = 12, V = 20,
    grouped heads, bf16), the backward's programs a whole value head or half of one."""
    launched(backward_block_v=backward_block_v)
    monkeypatch.setattr(chunked_pallas, "_on_gpu", lambda: True)  # lower it, don't interpret
    q, k, v, la, b = random_inputs(5, 40, 12, 20, lead=(1,), heads=(2, 4))
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))

    def loss(*args):
        y, _ = gdn_jax.gated_delta_rule(*args, impl="pallas", chunk_size=16)
        return jnp.sum(y.astype(jnp.float32))

    grad = jax.jit(jax.grad(loss, argnums=range(5)))
    # Triton compiles for a GPU's architecture; from jax 0.12 a host without one names it.
    h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    target = jax.sharding.AbstractMesh(
        (1,), ("x",), jax.sharding.AxisType.Auto, abstract_device=h200
    )
    with jax.sharding.use_abstract_mesh(target), _triton_deprecation_from_jax_0_11():
        text = grad.trace(q, k, v, la, b).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "custom_call" in line]
    assert sum("xla.gpu.triton" in line for line in calls) == 2, calls
