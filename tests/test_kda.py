"""Kimi Delta Attention (per-channel gates) against the float64 loop and the gated delta rule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import gated_delta_reference, random_inputs, random_state
from tolerance import assert_close

import gdn_jax

HEADS, V_HEADS, KEY, VALUE = 2, 4, 12, 10

kda = jax.jit(gdn_jax.kda, static_argnames=("impl", "chunk_size", "use_qk_l2norm", "scale"))
kda_recurrent = jax.jit(gdn_jax.kda_recurrent, static_argnames="scale")


def batched_inputs(seed, seq_len, batch=1, **kw):
    return random_inputs(
        seed, seq_len, KEY, VALUE, lead=(batch,), heads=(HEADS, V_HEADS), per_channel=True, **kw
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_step_and_recurrent_match_the_float64_loop(dtype):
    q, k, v, la, b = random_inputs(0, 40, KEY, VALUE, dtype=dtype, per_channel=True)
    state = random_state(1, VALUE, KEY, dtype=dtype)
    y_ref, s_ref = gated_delta_reference(q, k, v, la, b, scale=0.3, initial_state=state)
    y, s = kda_recurrent(q, k, v, la, b, scale=0.3, initial_state=state)
    assert y.dtype == dtype and s.dtype == dtype
    assert_close(y, y_ref, dtype)
    assert_close(s, s_ref, dtype)
    s1, y1 = gdn_jax.kda_step(state, q[0], k[0], v[0], la[0], b[0], scale=0.3)
    y1_ref, s1_ref = gated_delta_reference(
        q[:1], k[:1], v[:1], la[:1], b[:1], scale=0.3, initial_state=state
    )
    assert_close(y1, y1_ref[0], dtype)
    assert_close(s1, s1_ref, dtype)


def test_channels_decay_separately():
    # One token, no write: column c of the state is scaled by exp(log_alpha[c]) alone.
    state = random_state(2, 3, 4, dtype=jnp.float64)
    la = jnp.log(jnp.asarray([1.0, 0.5, 0.25, 0.0], jnp.float64))
    zeros = jnp.zeros(4, jnp.float64)
    new, _ = gdn_jax.kda_step(state, zeros, zeros, jnp.zeros(3, jnp.float64), la, 0.0)
    np.testing.assert_allclose(new, np.asarray(state) * [1.0, 0.5, 0.25, 0.0], rtol=1e-15)


@pytest.mark.parametrize("impl", ["recurrent"])
def test_batched_grouped_heads_match_the_loop_per_head(impl):
    q, k, v, la, b = batched_inputs(3, 33, batch=2)
    state = random_state(4, 2, V_HEADS, VALUE, KEY)
    out, final = kda(q, k, v, la, b, initial_state=state, impl=impl, chunk_size=16)
    assert out.shape == (2, 33, V_HEADS, VALUE) and final.shape == (2, V_HEADS, VALUE, KEY)
    group = V_HEADS // HEADS
    for n in range(2):
        for i in range(V_HEADS):
            args = (x[n, :, i // group] for x in (q, k))
            y, s = gated_delta_reference(
                *args,
                v[n, :, i],
                la[n, :, i],
                b[n, :, i],
                scale=KEY**-0.5,
                initial_state=state[n, i],
            )
            assert_close(out[n, :, i], y, jnp.float32, f"sequence {n}, value head {i}")
            assert_close(final[n, i], s, jnp.float32, f"sequence {n}, value head {i}")


@pytest.mark.parametrize("impl", ["recurrent"])
def test_equal_channels_are_the_gated_delta_rule(impl):
    q, k, v, la, b = random_inputs(5, 45, KEY, VALUE, lead=(1,), heads=(HEADS, V_HEADS))
    state = random_state(6, 1, V_HEADS, VALUE, KEY)
    la_channels = jnp.broadcast_to(la[..., None], (*la.shape, KEY))
    out, final = kda(q, k, v, la_channels, b, initial_state=state, impl=impl, chunk_size=16)
    out_gdn, final_gdn = gdn_jax.gated_delta_rule(
        q, k, v, la, b, initial_state=state, impl="recurrent"
    )
    assert_close(out, out_gdn, jnp.float32)
    assert_close(final, final_gdn, jnp.float32)


def test_a_per_head_log_alpha_is_refused_naming_the_argument():
    q, k, v, la, b = random_inputs(7, 8, KEY, VALUE, lead=(1,), heads=(HEADS, V_HEADS))
    with pytest.raises(
        ValueError,
        match=r"kda: log_alpha must have shape \[B, T, HV, K\] \(one gate per key channel\) = "
        r"\(1, 8, 4, 12\), got \(1, 8, 4\)",
    ):
        gdn_jax.kda(q, k, v, la, b)
    q1, k1, v1, la1, b1 = random_inputs(7, 8, KEY, VALUE)
    with pytest.raises(ValueError, match=r"kda_recurrent: log_alpha must have shape \[T, K\]"):
        gdn_jax.kda_recurrent(q1, k1, v1, la1, b1)
    with pytest.raises(ValueError, match=r"kda_step: log_alpha must have shape \[K\]"):
        gdn_jax.kda_step(jnp.zeros((VALUE, KEY)), q1[0], k1[0], v1[0], la1[0], b1[0])
