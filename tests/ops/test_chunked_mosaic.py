"""The chunked gated delta rule as Mosaic GPU kernels (``ops/mosaic/scalar/op.py``), run here in
Mosaic GPU's interpret mode, against the XLA chunked form on outputs, final states and the
gradient of every input (the initial state included).

Mosaic GPU's interpret mode (``plgpu.InterpretGPUParams``) came with jax 0.11: on an older
JAX (the floor set's 0.10.2) the module is skipped at collection, and CI's stages with newer
JAX run it. The kernels' products are wgmma's with bf16 operands, float32 inputs as two bf16
pieces each, which interpret mode computes as the tensor cores do, so the float32 row of the
tolerance table holds here as on a GPU.
"""

import functools
import os

import jax
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

if not hasattr(plgpu, "InterpretGPUParams") or not hasattr(plgpu, "force_gpu_interpret_mode"):
    pytest.skip(
        f"jax {jax.__version__} has no Mosaic GPU interpret mode (plgpu.InterpretGPUParams, "
        "jax >= 0.11)",
        allow_module_level=True,
    )

import jax.numpy as jnp
import numpy as np
from support.races import (
    detecting_races,  # noqa: F401 (the fixture)
    races_reported,
    racy_kernel,
)
from support.reference import random_inputs, random_state
from support.tolerance import assert_close

import gdn_jax

# Every kernel of these tests runs under the interpreter's race detector, which must stay
# silent (support/races.py).
pytestmark = pytest.mark.usefixtures("detecting_races")


def mosaic_rule(q, k, v, log_alpha, beta, *, initial_state=None, cu_seqlens=None, norm=False):
    """``gdn_jax.gated_delta_rule`` by its kernels (``impl="mosaic_gpu"``): interpreted on
    this host, as the dispatch runs a kernel off its platform."""
    return gdn_jax.gated_delta_rule(
        q, k, v, log_alpha, beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
        use_qk_l2norm=norm, impl="mosaic_gpu", chunk_size=64,
    )  # fmt: skip


def xla_rule(q, k, v, log_alpha, beta, *, initial_state=None, cu_seqlens=None, norm=False):
    return gdn_jax.gated_delta_rule(
        q, k, v, log_alpha, beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
        use_qk_l2norm=norm, impl="chunked", chunk_size=64,
    )  # fmt: skip


@functools.cache
def outputs_and_grads(rule, packed: bool, norm: bool):
    """``run(q, k, v, log_alpha, beta, state, ct_y, ct_s[, cu]) -> (y, final, grads)``, one
    jitted program per case."""

    def run(q, k, v, la, b, state, ct_y, ct_s, cu=None):
        def loss(*args):
            y, s = rule(*args[:5], initial_state=args[5], cu_seqlens=cu, norm=norm)
            ct = jnp.sum(y.astype(jnp.float32) * ct_y.astype(jnp.float32))
            return ct + jnp.sum(s * ct_s), (y, s)

        grads, (y, s) = jax.grad(loss, argnums=range(6), has_aux=True)(q, k, v, la, b, state)
        return y, s, grads

    return jax.jit(run)


def assert_same(inputs, dtype, cu=None, *, norm=False, err_msg=""):
    """The kernels' outputs, final states and every gradient within ``dtype``'s tolerance of
    the XLA form's, each in its input's dtype."""
    q, v = inputs[0], inputs[2]
    num_states = q.shape[0] if cu is None else cu.shape[0] - 1
    state = random_state(7, num_states, v.shape[2], v.shape[3], q.shape[3])
    ct_y = random_state(8, *v.shape).astype(v.dtype)
    ct_s = random_state(9, *state.shape)
    args = (*inputs, state, ct_y, ct_s) + (() if cu is None else (cu,))
    kernel = outputs_and_grads(mosaic_rule, cu is not None, norm)(*args)
    xla = outputs_and_grads(xla_rule, cu is not None, norm)(*args)
    for name, a, e in zip(("y", "final"), kernel[:2], xla[:2], strict=True):
        assert a.dtype == e.dtype, (name, a.dtype, e.dtype)
        assert_close(
            a.astype(jnp.float32), e.astype(jnp.float32), dtype, err_msg=f"{err_msg} {name}"
        )
    names = ("q", "k", "v", "log_alpha", "beta", "initial_state")
    for name, a, e in zip(names, kernel[2], xla[2], strict=True):
        assert a.dtype == e.dtype, (name, a.dtype, e.dtype)
        assert_close(
            a.astype(jnp.float32), e.astype(jnp.float32), dtype, err_msg=f"{err_msg} d{name}"
        )


# Gates of -0.05 to 0 leave about exp(-1.6) of a state after a chunk of 64, so that what
# crosses chunks (the state pass and its reverse) weighs in the outputs and gradients as much
# as the work inside a chunk (gates down to -1 would leave exp(-32)).
MILD = dict(log_alpha_range=(-0.05, 0.0))


# (H, HV): one head, over two batch rows whose V = 72 pads to two tiles of 64 (two programs
# of the state passes, and of the grads kernel, a value head); grouped value heads (two per
# key head); several key heads. T = 150 is two chunks of 64 and a tail of 22; K = 16 pads
# to one tile.
@pytest.mark.parametrize(
    "heads, batch, value_dim", [((1, 1), 2, 72), ((1, 2), 1, 24), ((2, 4), 1, 24)]
)
def test_kernels_equal_chunked_form_over_head_layouts(heads, batch, value_dim):
    inputs = random_inputs(0, 150, 16, value_dim, lead=(batch,), heads=heads, **MILD)
    assert_same(inputs, jnp.float32, err_msg=f"heads={heads}")


def test_packed_sequences_with_an_empty_one_and_initial_states():
    inputs = random_inputs(1, 150, 16, 24, lead=(1,), heads=(2, 4), **MILD)
    cu = jnp.array([0, 7, 7, 100, 150], jnp.int32)  # the second sequence has no tokens
    assert_same(inputs, jnp.float32, cu=cu)


def test_bf16_inputs_with_the_norm_inside_the_op():
    """bf16 q, k and v (one bf16 piece an operand, as the field's kernels take them), L2
    norm inside the op: the outputs in bf16, every gradient in its input's dtype, within
    bf16's tolerance of the XLA form. K = 80 and V = 72 pad to 128: the grads kernel takes
    a whole value head and works two blocks of 64 channels of each."""
    q, k, v, la, b = random_inputs(2, 100, 80, 72, lead=(2,), heads=(1, 2), **MILD)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    assert_same((q, k, v, la, b), jnp.bfloat16, norm=True)


def test_strong_decays_and_a_full_reset():
    """A -inf gate (a full reset) and a gate of -30 inside a chunk: the segment sums keep the
    decays after them exact, as the XLA form's do."""
    q, k, v, la, b = random_inputs(3, 96, 16, 16, lead=(1,), heads=(1, 1))
    la = np.asarray(la).copy()
    la[0, 5, 0], la[0, 20, 0], la[0, 70, 0] = -np.inf, -30.0, -1e4
    assert_same((q, k, v, jnp.asarray(la), b), jnp.float32)


def test_no_sequences_give_empty_outputs_and_no_tokens_the_ops_own_error():
    """An empty batch runs, as the XLA form's, to empty outputs with the states passed
    through (the gradient of the final states reaches the initial states whole); no tokens
    is the op's own named error, whichever form."""
    q, k, v, la, b = random_inputs(4, 20, 16, 16, lead=(0,), heads=(1, 2))
    state = random_state(5, 0, 2, 16, 16)

    def loss(state):
        y, final = mosaic_rule(q, k, v, la, b, initial_state=state)
        return jnp.sum(y) + jnp.sum(final), (y, final)

    d_state, (y, final) = jax.grad(loss, has_aux=True)(state)
    assert y.shape == v.shape and final.shape == state.shape
    np.testing.assert_array_equal(d_state, np.ones(state.shape))
    empty = random_inputs(4, 0, 16, 16, lead=(2,), heads=(1, 2))
    for rule in (mosaic_rule, xla_rule):
        with pytest.raises(ValueError, match=r"gated_delta_rule: need at least one token"):
            rule(*empty)


def test_second_order_through_the_kernels_is_one_named_error():
    """Their backward is Mosaic GPU kernels, which JAX cannot differentiate again: forward
    over reverse and jax.hessian are a ValueError that says to use the chunked form, not
    JAX's own NotImplementedError from inside the kernel."""
    q, k, v, la, b = random_inputs(11, 20, 16, 16, lead=(1,), heads=(1, 1))

    def loss(v, q):
        return jnp.sum(mosaic_rule(q, k, v, la, b)[0] ** 2)

    message = (
        r"^gated_delta_rule: impl='mosaic_gpu' differentiates once, in reverse mode.*'chunked'"
    )
    with pytest.raises(ValueError, match=message):
        jax.jvp(lambda q: jax.grad(loss)(v, q), (q,), (q,))
    with pytest.raises(ValueError, match=message):
        jax.hessian(loss)(v, q)


def test_gated_delta_products_errors_through_the_kernels_name_it():
    """Gated DeltaProduct runs the gated delta rule's kernels; their errors name the op that
    was called (traced on abstract shapes: nothing runs)."""
    steps = random_inputs(12, 40, 16, 16, lead=(1,), heads=(1, 1))
    q, log_alpha = steps[0][:, :20], steps[3][:, :20]

    def loss(v):
        y, _ = gdn_jax.gated_delta_product(q, steps[1], v, log_alpha, steps[4],
                                           num_householder=2, impl="mosaic_gpu", chunk_size=64)  # fmt: skip
        return jnp.sum(y**2)

    message = r"^gated_delta_product: impl='mosaic_gpu' differentiates once"
    with pytest.raises(ValueError, match=message):
        jax.eval_shape(jax.hessian(loss), steps[2])


def test_gated_delta_product_runs_on_the_kernels_over_its_steps():
    """Gated DeltaProduct (n = 2) by the gated delta rule's kernels over its interleaved
    steps (``rules/gated_delta_product.py``), against its chunked form: outputs, final states
    and every gradient, with packed sequences (one empty, one ending off the chunk grid in
    steps), grouped value heads and initial states."""
    n, seq_len = 2, 75
    steps = random_inputs(11, seq_len * n, 16, 24, lead=(1,), heads=(1, 2), **MILD)
    q = steps[0][:, :seq_len]
    k, v, beta = steps[1], steps[2], steps[4]
    log_alpha = steps[3][:, :seq_len]
    cu = jnp.array([0, 20, 20, 75], jnp.int32)
    state = random_state(12, 3, 2, 24, 16)
    ct_y = random_state(13, 1, seq_len, 2, 24)

    def run(impl):
        def loss(*args):
            y, s = gdn_jax.gated_delta_product(
                *args[:5], initial_state=args[5], cu_seqlens=cu, num_householder=n,
                impl=impl, chunk_size=64,
            )  # fmt: skip
            return jnp.sum(y * ct_y) + jnp.sum(s), (y, s)

        grad = jax.grad(loss, argnums=range(6), has_aux=True)
        return jax.jit(grad)(q, k, v, log_alpha, beta, state)

    (grads, (y, s)), (xla_grads, (xla_y, xla_s)) = run("mosaic_gpu"), run("chunked")
    assert_close(y, xla_y, jnp.float32, err_msg="y")
    assert_close(s, xla_s, jnp.float32, err_msg="final")
    names = ("q", "k", "v", "log_alpha", "beta", "initial_state")
    for name, a, e in zip(names, grads, xla_grads, strict=True):
        assert a.shape == e.shape, (name, a.shape, e.shape)
        assert_close(a, e, jnp.float32, err_msg=f"d{name}")


def test_the_race_detector_is_on_and_reports_a_race(capfd):
    """The positive control: the detector these tests run under reports a kernel's race."""
    x = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    assert races_reported(lambda: racy_kernel()(jnp.ones(x.shape, x.dtype)), capfd) >= 1


def test_a_cpu_pool_too_small_for_two_warpgroups_is_one_named_error(monkeypatch):
    """The interpreter runs each of the grads kernel's two warpgroups as a computation on
    XLA's CPU pool beside the caller's: in a pool of two the second never starts and the
    first waits at its barrier for ever (a 2-core host's default). Lowering the backward
    there names the kernel and the fix; the forward's kernels, of one warpgroup, lower."""
    monkeypatch.setenv("PJRT_NPROC", "2")  # read when the interpreted form is lowered
    q, k, v, la, b = random_inputs(14, 20, 16, 16, lead=(1,), heads=(1, 1))

    def loss(v):
        return jnp.sum(mosaic_rule(q, k, v, la, b)[0] ** 2)

    jax.jit(loss).lower(v)
    with pytest.raises(RuntimeError, match=r"^gdn_mosaic_grads: .* PJRT_NPROC=3 "):
        jax.jit(jax.grad(loss)).lower(v)


def test_the_pool_is_given_the_interpreters_threads_before_jax_starts(monkeypatch):
    """``limits.give_interpreter_threads`` (the test session's and gpu_check's first step)
    raises a pool of two to three and leaves a larger one as it is."""
    from gdn_jax.ops.mosaic import limits

    monkeypatch.delenv("NPROC", raising=False)
    for given, kept in (("2", "3"), ("1", "3"), ("8", "8")):
        monkeypatch.setenv("PJRT_NPROC", given)
        limits.give_interpreter_threads()
        assert os.environ["PJRT_NPROC"] == kept, given
        assert limits.interpreter_refusal("k", 2) is None
