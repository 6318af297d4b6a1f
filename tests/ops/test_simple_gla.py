"""simple_gla (one decay a head, no delta correction): its batched and one-head forms against
the float64 loop and each other, and its step against its recurrent form."""

import functools

import jax
import jax.numpy as jnp
import pytest
from support import cpu_schedule as on_cpu
from support.forms import (
    assert_forms_agree,
    assert_steps_equal_recurrent,
    with_state_and_cotangents,
)
from support.reference import gated_delta_reference, random_inputs, random_state
from support.tolerance import assert_close

import gdn_jax

rule = jax.jit(on_cpu.simple_gla, static_argnames=("impl", "chunk_size"))


@pytest.mark.parametrize("impl", ["chunked", "recurrent"])
@pytest.mark.parametrize(("seq_len", "chunk_size"), [(1, 16), (100, 32), (129, 64)])
def test_matches_reference(impl, seq_len, chunk_size):
    q, k, v, la, b = random_inputs(seq_len, seq_len, 12, 20, lead=(1,), heads=(2, 4))
    state = random_state(1, 1, 4, 20, 12)
    out, final = rule(q, k, v, la, b, initial_state=state, impl=impl, chunk_size=chunk_size)
    for head in range(4):
        y, s = gated_delta_reference(
            q[0, :, head // 2],
            k[0, :, head // 2],
            v[0, :, head],
            la[0, :, head],
            b[0, :, head],
            scale=12**-0.5,
            initial_state=state[0, head],
            delta=False,
        )
        assert_close(out[0, :, head], y, jnp.float32)
        assert_close(final[0, head], s, jnp.float32)


def test_plain_linear_attention_is_the_causal_sum():
    # log_alpha = 0, beta = 1: y_t = sum_{j<=t} v_j (k_j . q_t) scale.
    q, k, v, _, _ = random_inputs(2, 40, 6, 5, lead=(1,), heads=(1, 1))
    zeros, ones = jnp.zeros((1, 40, 1)), jnp.ones((1, 40, 1))
    out, _ = rule(q, k, v, zeros.astype(jnp.float32), ones.astype(jnp.float32), impl="chunked")
    scores = jnp.tril(q[0, :, 0] @ k[0, :, 0].T) * 6**-0.5
    assert_close(out[0, :, 0], scores @ v[0, :, 0], jnp.float32)


def test_chunked_gradients_match_recurrent():
    args = random_inputs(3, 77, 8, 8, lead=(2,), heads=(2, 2))
    state = random_state(4, 2, 2, 8, 8)

    def loss(impl, *a):
        out, final = on_cpu.simple_gla(*a[:5], initial_state=a[5], impl=impl, chunk_size=16)
        return jnp.sum(out**2) + jnp.sum(final**2)

    grad = functools.partial(jax.grad, argnums=range(6))
    g_chk = jax.jit(grad(functools.partial(loss, "chunked")))(*args, state)
    g_rec = jax.jit(grad(functools.partial(loss, "recurrent")))(*args, state)
    for a, e in zip(g_chk, g_rec, strict=True):
        assert_close(a, e, jnp.float32)


def test_packed_sequences_match_separate_runs():
    q, k, v, la, b = random_inputs(5, 50, 8, 8, lead=(1,), heads=(1, 1))
    cu = [0, 20, 50]
    out, final = rule(q, k, v, la, b, cu_seqlens=jnp.asarray(cu, jnp.int32), chunk_size=16)
    for n in range(2):
        part = [x[:, cu[n] : cu[n + 1]] for x in (q, k, v, la, b)]
        out_n, final_n = rule(*part, chunk_size=16)
        assert_close(out[:, cu[n] : cu[n + 1]], out_n, jnp.float32)
        assert_close(final[n], final_n[0], jnp.float32)


def test_one_head_forms_match_the_float64_loop():
    q, k, v, la, b = random_inputs(3, 45, 12, 10)
    state = random_state(4, 10, 12)
    y_ref, s_ref = gated_delta_reference(
        q, k, v, la, b, scale=0.3, initial_state=state, delta=False
    )
    for fn in (gdn_jax.simple_gla_recurrent, on_cpu.simple_gla_chunked):
        y, s = jax.jit(functools.partial(fn, scale=0.3))(q, k, v, la, b, initial_state=state)
        assert y.dtype == jnp.float32 and y.shape == (45, 10)
        assert_close(y, y_ref, jnp.float32, "y")
        assert_close(s, s_ref, jnp.float32, "final state")


@pytest.mark.parametrize("schedule", ["in_scan", "hoisted"])
def test_one_head_chunked_equals_recurrent_values_and_gradients(schedule):
    # 45 tokens, off the chunk grid of 16.
    args = with_state_and_cotangents(random_inputs(5, 45, 12, 10), 5, 45, 12, 10, jnp.float32)
    options = dict(chunk_size=16, schedule=schedule)
    assert_forms_agree("simple_gla", args, jnp.float32, options, schedule)


def test_step_token_by_token_equals_the_recurrent_form():
    q, k, v, la, b = random_inputs(6, 7, 12, 10)
    state = random_state(7, 10, 12)
    assert_steps_equal_recurrent("simple_gla", (q, k, v, la, b), state, jnp.float32)
