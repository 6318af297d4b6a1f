"""The projections' product (``layers/dense.py``): the values and gradients of
``jax.lax.dot_general`` and its own rules, in every mode of autodiff, and a kernel gradient
that never lays the output's cotangent out with the token axis minor."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.tolerance import assert_close

from gdn_jax.layers.dense import project, projection_dot_general
from gdn_jax.layers.params import bias_free_linear


def plain(x, kernel):
    return jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))


def inputs(shape, d_out, dtype, seed=0):
    kx, kk, kg = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(kx, shape, jnp.float32).astype(dtype)
    kernel = (jax.random.normal(kk, (shape[-1], d_out), jnp.float32) / 3).astype(dtype)
    cotangent = jax.random.normal(kg, (*shape[:-1], d_out), jnp.float32).astype(dtype)
    return x, kernel, cotangent


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(5,), (6, 5), (2, 7, 5), (2, 3, 4, 5)], ids=str)
def test_values_and_gradients_are_those_of_dot_general(shape, dtype):
    x, kernel, cotangent = inputs(shape, 3, dtype)
    y, pullback = jax.vjp(project, x, kernel)
    y_ref, pullback_ref = jax.vjp(plain, x, kernel)
    assert y.dtype == y_ref.dtype == dtype
    assert_close(y, y_ref, dtype)
    for got, want in zip(pullback(cotangent), pullback_ref(cotangent), strict=True):
        assert got.dtype == want.dtype == dtype and got.shape == want.shape
        assert_close(got, want, dtype)


def test_forward_mode_and_the_hessian_take_dot_generals_own_rules():
    x, kernel, _ = inputs((2, 7, 5), 3, jnp.float32)
    linear = bias_free_linear(dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))(5, 3)
    linear.kernel[...] = kernel

    def out(x):
        return jnp.sum(jnp.sin(linear(x)))

    def out_ref(x):
        return jnp.sum(jnp.sin(plain(x, kernel)))

    tangent = jnp.ones_like(x)
    assert_close(jax.jvp(out, (x,), (tangent,))[1], jax.jvp(out_ref, (x,), (tangent,))[1], x.dtype)
    assert_close(jax.jacfwd(out)(x), jax.grad(out_ref)(x), x.dtype)
    assert_close(jax.hessian(out)(x[0, 0]), jax.hessian(out_ref)(x[0, 0]), x.dtype)


def test_other_products_are_dot_generals_own():
    x, kernel, _ = inputs((4, 5), 3, jnp.float32)
    numbers = (((0,), (0,)), ((), ()))  # x's first axis, not its last
    y = projection_dot_general(x, x, numbers)
    np.testing.assert_array_equal(y, jax.lax.dot_general(x, x, numbers))
    wide = projection_dot_general(
        x, kernel, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float64
    )
    assert wide.dtype == jnp.float64


def test_the_kernel_gradient_never_transposes_the_cotangent():
    """The MQAR shape in small: tokens [B, T, D_in] projected, short-convolved and SiLU'd.
    With JAX's own pullback XLA:CPU makes the cotangent a [D_out, B*T] array (the token axis
    minor); with the written one no such array exists."""
    x, kernel, _ = inputs((4, 48, 16), 24, jnp.float32)
    taps = jnp.ones((4, 24), jnp.float32)

    def conv(h):
        padded = jnp.pad(h, ((0, 0), (3, 0), (0, 0)))
        return jax.nn.silu(sum(padded[:, i : i + 48] * taps[i][None, None] for i in range(4)))

    def transposed(product):
        grad = jax.grad(lambda x, k: jnp.sum(conv(product(x, k)) ** 2), argnums=(0, 1))
        hlo = jax.jit(grad).lower(x, kernel).compile().as_text()
        return re.findall(r"f32\[24,192\]", hlo)

    assert transposed(plain), "the check no longer sees what it guards against"
    assert transposed(project) == []
