"""The explainer's worked example, exactly, through every public form."""

import jax.numpy as jnp
import numpy as np
import pytest
from support.reference import gated_delta_reference

import gdn_jax

S_OLD = [[3.0, 0.0], [1.0, 2.0], [2.0, 1.0]]
Q = [0.6, 0.8]
K = [1.0, 0.0]
V = [0.0, 4.0, 1.0]
S_NEW = [[0.0, 0.0], [4.0, 1.0], [1.0, 0.5]]
Y = [0.0, 3.2, 1.0]


def f64(x):
    return jnp.asarray(x, jnp.float64)


def test_reading_the_memory_with_a_query():
    np.testing.assert_allclose(np.asarray(S_OLD) @ np.asarray(Q), [1.8, 2.2, 2.0])
    # alpha = 1, beta = 0: the state is unchanged and the read is S q.
    state, y = gdn_jax.gated_delta_step(
        f64(S_OLD), f64(Q), f64(K), f64(V), f64(0.0), f64(0.0), scale=1.0
    )
    np.testing.assert_allclose(state, S_OLD)
    np.testing.assert_allclose(y, [1.8, 2.2, 2.0], rtol=1e-12)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_one_update_with_numbers(dtype):
    state, y = gdn_jax.gated_delta_step(
        jnp.asarray(S_OLD, dtype),
        jnp.asarray(Q, dtype),
        jnp.asarray(K, dtype),
        jnp.asarray(V, dtype),
        jnp.log(jnp.asarray(0.5, dtype)),
        jnp.asarray(1.0, dtype),
        scale=1.0,
    )
    np.testing.assert_allclose(state, S_NEW, atol=1e-6)
    np.testing.assert_allclose(y, Y, atol=1e-6)
    assert y.dtype == dtype
    # Reading at the edited key returns the new value; the orthogonal key was only halved.
    np.testing.assert_allclose(state @ jnp.asarray(K, dtype), V, atol=1e-6)
    np.testing.assert_allclose(state @ jnp.asarray([0.0, 1.0], dtype), [0.0, 1.0, 0.5], atol=1e-6)


def test_reference_loop_reproduces_the_example():
    y, state = gated_delta_reference(
        [Q], [K], [V], [np.log(0.5)], [1.0], scale=1.0, initial_state=S_OLD
    )
    np.testing.assert_allclose(state, S_NEW, atol=1e-12)
    np.testing.assert_allclose(y[0], Y, atol=1e-12)


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_sequence_forms_reproduce_the_example(form):
    fn = {
        "recurrent": gdn_jax.gated_delta_rule_recurrent,
        "chunked": gdn_jax.gated_delta_rule_chunked,
    }[form]
    y, state = fn(
        f64([Q]),
        f64([K]),
        f64([V]),
        f64([np.log(0.5)]),
        f64([1.0]),
        scale=1.0,
        initial_state=f64(S_OLD),
    )
    np.testing.assert_allclose(state, S_NEW, atol=1e-12)
    np.testing.assert_allclose(y[0], Y, atol=1e-12)


def test_default_scale_is_inverse_sqrt_key_dim():
    assert gdn_jax.default_scale(64) == 64**-0.5
    q, k, v = f64([[1.0, 2.0, 3.0, 4.0]]), f64([[0.5, 0.5, 0.5, 0.5]]), f64([[1.0, -1.0]])
    gates = f64([0.0]), f64([1.0])
    y_default, _ = gdn_jax.gated_delta_rule_recurrent(q, k, v, *gates)
    y_half, _ = gdn_jax.gated_delta_rule_recurrent(q, k, v, *gates, scale=0.5)
    np.testing.assert_allclose(y_default, y_half, rtol=1e-12)
