"""Gated DeltaProduct (``n`` delta steps a token): the recurrent and chunked forms and the
batched entry against a float64 loop of the recurrence, each other and the gated delta rule,
and its step against its recurrent form."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads
from support.forms import assert_steps_equal_recurrent
from support.reference import householder_reference, random_state
from support.tolerance import assert_close

import gdn_jax

KEY, VALUE = 12, 10
F32 = jnp.float32
NAMES = ("q", "k", "v", "log_alpha", "beta", "initial_state")


def product_inputs(seed, seq_len, n, *, dtype=jnp.float32, lead=(), heads=None):
    """q per token, k, v and beta (in (0, 2)) per step, log_alpha per token."""
    rng = np.random.default_rng(seed)
    qk_heads, v_heads = ((), ()) if heads is None else ((heads[0],), (heads[1],))
    q = rng.standard_normal((*lead, seq_len, *qk_heads, KEY))
    k = rng.standard_normal((*lead, seq_len * n, *qk_heads, KEY))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((*lead, seq_len * n, *v_heads, VALUE))
    log_alpha = rng.uniform(-1.0, 0.0, (*lead, seq_len, *v_heads))
    beta = rng.uniform(0.0, 2.0, (*lead, seq_len * n, *v_heads))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v, log_alpha, beta))


# Jitted: eagerly each call would compile a program per operation.
recurrent = jax.jit(
    gdn_jax.gated_delta_product_recurrent, static_argnames=("num_householder", "scale")
)
chunked = jax.jit(
    gdn_jax.gated_delta_product_chunked,
    static_argnames=("num_householder", "scale", "chunk_size", "schedule"),
)
product = jax.jit(
    gdn_jax.gated_delta_product, static_argnames=("num_householder", "impl", "chunk_size")
)
gated_delta_rule = jax.jit(gdn_jax.gated_delta_rule, static_argnames=("impl", "chunk_size"))


@functools.cache
def outputs_and_grads(form, n, **options):
    fn = {
        "recurrent": gdn_jax.gated_delta_product_recurrent,
        "chunked": gdn_jax.gated_delta_product_chunked,
    }[form]

    def run(q, k, v, la, b, state, ct_y, ct_s):
        def loss(*args):
            y, s = fn(*args[:5], initial_state=args[5], num_householder=n, **options)
            return jnp.sum(y * ct_y) + jnp.sum(s * ct_s), (y, s)

        grads, (y, s) = jax.grad(loss, argnums=range(6), has_aux=True)(q, k, v, la, b, state)
        return y, s, grads

    return jax.jit(run)


def single_head_args(seed, seq_len, n, dtype=jnp.float32):
    inputs = product_inputs(seed, seq_len, n, dtype=dtype)
    state = random_state(seed + 1, VALUE, KEY, dtype=dtype)
    cotangents = (
        random_state(seed + 2, seq_len, VALUE, dtype=dtype),
        random_state(seed + 3, VALUE, KEY, dtype=dtype),
    )
    return (*inputs, state, *cotangents)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_forms_match_the_float64_loop(dtype):
    q, k, v, la, b = product_inputs(0, 30, 3, dtype=dtype)
    state = random_state(1, VALUE, KEY, dtype=dtype)
    y_ref, s_ref = householder_reference(q, k, v, la, b, 3, scale=0.3, initial_state=state)
    for fn in (recurrent, chunked):
        y, s = fn(q, k, v, la, b, num_householder=3, scale=0.3, initial_state=state)
        assert y.dtype == dtype and y.shape == (30, VALUE)
        assert_close(y, y_ref, dtype, fn.__name__)
        assert_close(s, s_ref, dtype, fn.__name__)
    y, s = recurrent(q, k, v, None, b, num_householder=3, scale=0.3)
    y_ref, s_ref = householder_reference(q, k, v, None, b, 3, scale=0.3)
    assert_close(y, y_ref, dtype, "no forget gate")


@pytest.mark.parametrize(("n", "schedule"), [(2, "in_scan"), (3, "hoisted")])
def test_chunked_equals_recurrent_values_and_gradients(n, schedule):
    # 45 tokens: 90 or 135 steps, off the chunk grid of 32.
    args = single_head_args(10 + n, 45, n)
    expected = outputs_and_grads("recurrent", n)(*args)
    actual = outputs_and_grads("chunked", n, chunk_size=32, schedule=schedule)(*args)
    assert_close(actual[0], expected[0], jnp.float32, "y")
    assert_close(actual[1], expected[1], jnp.float32, "final state")
    for name, a, e in zip(NAMES, actual[2], expected[2], strict=True):
        assert np.isfinite(a).all(), f"d{name}"
        assert_close(a, e, jnp.float32, f"d{name}")


def test_chunked_finite_differences_float64():
    q, k, v, la, b = product_inputs(20, 13, 2, dtype=jnp.float64)
    state = random_state(21, VALUE, KEY, dtype=jnp.float64)

    def run(*a):
        return gdn_jax.gated_delta_product_chunked(
            *a[:5], initial_state=a[5], num_householder=2, chunk_size=16
        )

    check_grads(jax.jit(run), (q, k, v, la, b, state), order=1, modes=["rev"], eps=1e-6)


@pytest.mark.parametrize("impl", ["chunked", "recurrent"])
def test_batched_grouped_heads_match_the_loop_and_n_1_is_the_gated_delta_rule(impl):
    q, k, v, la, b = product_inputs(3, 21, 2, lead=(2,), heads=(2, 4))
    state = random_state(4, 2, 4, VALUE, KEY)
    out, final = product(
        q, k, v, la, b, num_householder=2, initial_state=state, impl=impl, chunk_size=16
    )
    assert out.shape == (2, 21, 4, VALUE) and final.shape == (2, 4, VALUE, KEY)
    # Sliced in NumPy: eager slices of JAX arrays would compile a program per shape.
    q, k, v, la, b, out, final = (np.asarray(x) for x in (q, k, v, la, b, out, final))
    for n in range(2):
        for i in range(4):
            h = i // 2
            y, s = householder_reference(
                q[n, :, h], k[n, :, h], v[n, :, i], la[n, :, i], b[n, :, i], 2,
                scale=KEY**-0.5, initial_state=state[n, i],
            )  # fmt: skip
            assert_close(out[n, :, i], y, jnp.float32, f"sequence {n}, head {i}")
            assert_close(final[n, i], s, jnp.float32, f"sequence {n}, head {i}")
    q1, k1, v1, la1, b1 = product_inputs(5, 21, 1, lead=(2,), heads=(2, 4))
    one = product(
        q1, k1, v1, la1, b1, num_householder=1, initial_state=state, impl=impl, chunk_size=16
    )
    gdn = gated_delta_rule(q1, k1, v1, la1, b1, initial_state=state, impl=impl, chunk_size=16)
    for a, e in zip(one, gdn, strict=True):
        assert_close(a, e, jnp.float32, "n = 1")


def test_packed_sequences_count_tokens_and_equal_separate_runs():
    cu = [0, 7, 7, 30]  # tokens: an empty sequence, and one across the 32-step chunks
    q, k, v, la, b = product_inputs(6, 30, 2, lead=(1,), heads=(1, 2))
    state = random_state(7, 3, 2, VALUE, KEY)
    out, final = product(
        q, k, v, la, b, num_householder=2, initial_state=state, chunk_size=16,
        cu_seqlens=jnp.asarray(cu, jnp.int32),
    )  # fmt: skip
    # Sliced in NumPy: eager slices of JAX arrays would compile a program per shape.
    q, k, v, la, b, state, out, final = (np.asarray(x) for x in (q, k, v, la, b, state, out, final))
    for n, (lo, hi) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        for i in range(2):
            if lo == hi:
                assert_close(final[n, i], state[n, i], jnp.float32, "empty sequence")
                continue
            y, s = householder_reference(
                q[0, lo:hi, 0], k[0, 2 * lo : 2 * hi, 0], v[0, 2 * lo : 2 * hi, i],
                la[0, lo:hi, i], b[0, 2 * lo : 2 * hi, i], 2, scale=KEY**-0.5,
                initial_state=state[n, i],
            )  # fmt: skip
            assert_close(out[0, lo:hi, i], y, jnp.float32, f"sequence {n}, head {i}")
            assert_close(final[n, i], s, jnp.float32, f"sequence {n}, head {i}")


def test_a_step_layout_that_does_not_fit_is_refused_naming_the_argument():
    q, k, v, la, b = product_inputs(8, 6, 2, lead=(1,), heads=(1, 1))
    with pytest.raises(
        ValueError,
        match=r"gated_delta_product: k must have shape \[B, T n, H, K\] with n = num_householder = 3",
    ):
        gdn_jax.gated_delta_product(q, k, v, la, b, num_householder=3)
    with pytest.raises(
        ValueError, match=r"gated_delta_product: beta must have shape \[B, T n, HV\]"
    ):
        gdn_jax.gated_delta_product(q, k, v, la, b[:, :6], num_householder=2)
    with pytest.raises(
        ValueError,
        match=r"gated_delta_product: log_alpha must have shape \[B, T, HV\] \(one a token\)",
    ):
        gdn_jax.gated_delta_product(q, k, v, jnp.repeat(la, 2, axis=1), b, num_householder=2)
    with pytest.raises(ValueError, match=r"num_householder=0 must be a positive integer"):
        gdn_jax.gated_delta_product(q, k, v, la, b, num_householder=0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            dict(heads=(2, 3)),
            r"value heads HV=3 \(v.shape=\(1, 6, 3, 10\)\) must be a multiple of query/key "
            r"heads H=2 \(q.shape=\(1, 3, 2, 12\)\)",
        ),
        (dict(q=jnp.int32), r"q must be a floating array, got dtype int32"),
        (dict(chunk_size=48), r"chunk_size=48 must be one of \(16, 32, 64, 128\)"),
        (dict(impl="fused"), r"impl='fused' must be one of"),
        (
            dict(initial_state=(1, 2, 10, 11)),
            r"initial_state must have shape \[B, HV, V, K\] = \(1, 2, 10, 12\), got "
            r"\(1, 2, 10, 11\)",
        ),
        (dict(seq_len=0), r"need at least one token, got q.shape=\(1, 0, 2, 12\)"),
        (dict(cu_seqlens=[0, 1, 2]), r"cu_seqlens must rise from 0 to T=3"),
    ],
)
def test_errors_name_the_op_and_the_callers_shapes(change, message):
    """Each refusal names ``gated_delta_product`` and the shapes it was called with, in
    tokens, not the gated delta rule it runs over the interleaved steps."""
    seq_len, heads = change.pop("seq_len", 3), change.pop("heads", (2, 2))
    q, k, v, la, b = product_inputs(40, seq_len, 2, lead=(1,), heads=heads)
    if "q" in change:
        q = q.astype(change.pop("q"))
    if "initial_state" in change:
        change["initial_state"] = jnp.zeros(change["initial_state"], F32)
    with pytest.raises(ValueError, match=rf"^gated_delta_product: {message}"):
        gdn_jax.gated_delta_product(q, k, v, la, b, num_householder=2, **change)


def test_step_token_by_token_equals_the_recurrent_form():
    """A token's step runs its n Householder steps, then reads: values, the final state and
    every gradient as the recurrent form's."""
    q, k, v, la, b = product_inputs(30, 5, 3)
    state = random_state(31, VALUE, KEY)
    options = dict(num_householder=3)
    assert_steps_equal_recurrent("gated_delta_product", (q, k, v, la, b), state, F32, **options)
    new_state, y = gdn_jax.gated_delta_product_step(
        state, q[0], k[:3], v[:3], None, b[:3], **options
    )
    y_ref, s_ref = householder_reference(
        q[:1], k[:3], v[:3], None, b[:3], 3, scale=KEY**-0.5, initial_state=state
    )
    assert_close(y, y_ref[0], F32, "y without a forget gate")
    assert_close(new_state, s_ref, F32, "state without a forget gate")


def test_step_layout_is_checked_against_num_householder():
    q, k, v, la, b = product_inputs(32, 2, 2)
    state = random_state(33, VALUE, KEY)
    with pytest.raises(
        ValueError,
        match=r"gated_delta_product_step: k must have shape \[n, K\] with n = num_householder = 3",
    ):
        gdn_jax.gated_delta_product_step(state, q[0], k[:2], v[:3], la[0], b[:3], num_householder=3)
