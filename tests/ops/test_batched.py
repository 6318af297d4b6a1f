"""The batched entry point: vmap equivalence, grouped value heads, q/k L2 norm, bf16."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import cpu_schedule as on_cpu
from support import forms
from support.reference import gated_delta_reference, random_inputs, random_state
from support.tolerance import assert_close

import gdn_jax

batched = forms.batched("gated_delta_rule")


@pytest.mark.parametrize("impl", ["chunked", "recurrent"])
def test_matches_single_head_functions_vmapped_by_hand(impl):
    q, k, v, la, b = random_inputs(0, 70, 16, 12, lead=(2,), heads=(3, 3))
    state = random_state(1, 2, 3, 12, 16)
    out, final = batched(q, k, v, la, b, initial_state=state, impl=impl, chunk_size=32)
    single = {
        "chunked": functools.partial(on_cpu.gated_delta_rule_chunked, chunk_size=32),
        "recurrent": gdn_jax.gated_delta_rule_recurrent,
    }[impl]

    def one(q, k, v, la, b, s):
        return single(q, k, v, la, b, initial_state=s)

    over_heads = jax.vmap(one, in_axes=(1, 1, 1, 1, 1, 0), out_axes=(1, 0))
    out_ref, final_ref = jax.jit(jax.vmap(over_heads))(q, k, v, la, b, state)
    assert out.shape == (2, 70, 3, 12) and final.shape == (2, 3, 12, 16)
    assert_close(out, out_ref, jnp.float32)
    assert_close(final, final_ref, jnp.float32)
    # And against the float64 loop for one (batch, head), sliced in NumPy (eager slices of
    # JAX arrays would compile a program per shape).
    q, k, v, la, b, state, out, final = (np.asarray(x) for x in (q, k, v, la, b, state, out, final))
    y64, s64 = gated_delta_reference(
        q[1, :, 2],
        k[1, :, 2],
        v[1, :, 2],
        la[1, :, 2],
        b[1, :, 2],
        scale=16**-0.5,
        initial_state=state[1, 2],
    )
    assert_close(out[1, :, 2], y64, jnp.float32)
    assert_close(final[1, 2], s64, jnp.float32)


@pytest.mark.parametrize("impl", ["chunked", "recurrent"])
def test_grouped_value_heads_read_their_group_query_key_head(impl):
    heads, v_heads = 2, 6
    q, k, v, la, b = random_inputs(2, 50, 8, 8, lead=(1,), heads=(heads, v_heads))
    out, final = batched(q, k, v, la, b, impl=impl, chunk_size=16)
    # Sliced in NumPy: eager slices of JAX arrays would compile a program per shape.
    q, k, v, la, b, out, final = (np.asarray(x) for x in (q, k, v, la, b, out, final))
    group = v_heads // heads
    for i in range(v_heads):
        y, s = gated_delta_reference(
            q[0, :, i // group],
            k[0, :, i // group],
            v[0, :, i],
            la[0, :, i],
            b[0, :, i],
            scale=8**-0.5,
        )
        assert_close(out[0, :, i], y, jnp.float32, f"value head {i}")
        assert_close(final[0, i], s, jnp.float32, f"value head {i}")


def test_grouped_value_heads_gradients_sum_over_the_group():
    q, k, v, la, b = random_inputs(3, 40, 8, 8, lead=(1,), heads=(2, 4))

    def loss(impl, q, k, v, la, b):
        out, final = on_cpu.gated_delta_rule(q, k, v, la, b, impl=impl, chunk_size=16)
        return jnp.sum(out**2) + jnp.sum(final)

    g_chk = jax.jit(jax.grad(functools.partial(loss, "chunked"), argnums=range(5)))(q, k, v, la, b)
    g_rec = jax.jit(jax.grad(functools.partial(loss, "recurrent"), argnums=range(5)))(
        q, k, v, la, b
    )
    for a, e in zip(g_chk, g_rec, strict=True):
        assert_close(a, e, jnp.float32)


def test_qk_l2norm_equals_normalising_outside():
    q, k, v, la, b = random_inputs(4, 45, 10, 6, lead=(2,), heads=(2, 2), unit_keys=False)

    # One program for each side, outputs and gradients together.
    @functools.partial(jax.jit, static_argnames="norm_inside")
    def outputs_and_grads(q, k, v, la, b, norm_inside):
        def loss(q, k):
            if not norm_inside:
                q, k = gdn_jax.l2_normalize(q), gdn_jax.l2_normalize(k)
            out, _ = on_cpu.gated_delta_rule(q, k, v, la, b, use_qk_l2norm=norm_inside)
            return jnp.sum(out**2)

        if norm_inside:
            outputs = on_cpu.gated_delta_rule(q, k, v, la, b, use_qk_l2norm=True)
        else:
            qn, kn = (x / jnp.sqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6) for x in (q, k))
            outputs = on_cpu.gated_delta_rule(qn, kn, v, la, b)
        return outputs, jax.grad(loss, argnums=(0, 1))(q, k)

    (inside, s_inside), grads_inside = outputs_and_grads(q, k, v, la, b, norm_inside=True)
    (outside, s_outside), grads_outside = outputs_and_grads(q, k, v, la, b, norm_inside=False)
    assert_close(inside, outside, jnp.float32)
    assert_close(s_inside, s_outside, jnp.float32)
    for a, e in zip(grads_inside, grads_outside, strict=True):
        assert_close(a, e, jnp.float32)


@pytest.mark.parametrize("impl", ["chunked", "recurrent"])
def test_bfloat16_in_bfloat16_out_close_to_float32(impl):
    q, k, v, la, b = random_inputs(5, 100, 32, 32, lead=(1,), heads=(2, 2))
    out32, final32 = batched(q, k, v, la, b, impl=impl)
    to_bf16 = lambda x: x.astype(jnp.bfloat16)  # noqa: E731
    out16, final16 = batched(to_bf16(q), to_bf16(k), to_bf16(v), la, b, impl=impl)
    assert out16.dtype == jnp.bfloat16
    assert final16.dtype == jnp.float32  # the state is accumulated in float32
    assert_close(out16, out32, jnp.bfloat16)
    assert_close(final16, final32, jnp.bfloat16)


def test_explicit_scale_is_used():
    q, k, v, la, b = random_inputs(6, 20, 4, 4, lead=(1,), heads=(1, 1))
    out, _ = batched(q, k, v, la, b, scale=1.0)
    y, _ = gated_delta_reference(
        q[0, :, 0], k[0, :, 0], v[0, :, 0], la[0, :, 0], b[0, :, 0], scale=1.0
    )
    assert_close(out[0, :, 0], y, jnp.float32)
