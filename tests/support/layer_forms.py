"""What the recurrent layers' tests share: the chunked layer against the recurrent one on the
loss and the gradients of the input and of every parameter, and the parameter count."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from support.tolerance import assert_close


def sine_loss(layer, x):
    return jnp.sum(jnp.sin(layer(x)))


def assert_layers_agree_with_gradients(chunked, recurrent, x, loss=sine_loss):
    """``loss(layer, x)`` and its gradients with respect to ``x`` and every parameter are
    equal for the two layers (float32 tolerance), each parameter named by its path."""
    grad = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1)))
    (l_c, (g_c, gx_c)), (l_r, (g_r, gx_r)) = grad(chunked, x), grad(recurrent, x)
    assert_close(l_c, l_r, jnp.float32)
    assert_close(gx_c, gx_r, jnp.float32)
    flat_r = dict(nnx.to_flat_state(g_r))
    assert len(flat_r) == len(nnx.to_flat_state(g_c))
    for path, g in nnx.to_flat_state(g_c):
        assert_close(g.get_value(), flat_r[path].get_value(), jnp.float32, str(path))


def parameter_count(layer) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(layer, nnx.Param)))


def sigmoid(x):
    """NumPy's, for the float64 references of the layers."""
    return 1 / (1 + np.exp(-x))


def param_value(p):
    """A parameter's value as a float64 NumPy array, for those references."""
    return np.asarray(p[...], np.float64)
