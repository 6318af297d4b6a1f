"""gated_linear_attention: the recurrence without the delta correction."""

import functools

import jax
import jax.numpy as jnp
import pytest
from support import cpu_schedule as on_cpu
from support.reference import gated_delta_reference, random_inputs, random_state
from support.tolerance import assert_close

rule = jax.jit(on_cpu.gated_linear_attention, static_argnames=("impl", "chunk_size"))


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
        out, final = on_cpu.gated_linear_attention(
            *a[:5], initial_state=a[5], impl=impl, chunk_size=16
        )
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
