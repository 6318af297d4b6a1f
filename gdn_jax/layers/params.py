"""Parameter types and initialisers shared by the layers."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx


class NoWeightDecay(nnx.Param):
    """A parameter that the optimizer must not decay: gate parameters such as ``A_log`` and
    ``dt_bias``, whose values set time constants rather than feature weights. Filter with
    ``nnx.OfType(NoWeightDecay)`` or ``isinstance``."""


def a_log_init(key, shape, dtype=jnp.float32):
    """``A_log = log(A)``, ``A ~ U(0, 16)``: per-head decay rates spread over an order of
    magnitude (Gated DeltaNet's and Mamba-2's initialisation)."""
    a = jax.random.uniform(key, shape, jnp.float32, minval=0.0, maxval=16.0)
    # U(0, 16) can return exactly 0; the floor keeps log finite without visibly moving the law.
    return jnp.log(jnp.maximum(a, 1e-4)).astype(dtype)


def dt_bias_init(key, shape, dtype=jnp.float32, *, dt_min=1e-3, dt_max=1e-1, dt_floor=1e-4):
    """``dt_bias = softplus^{-1}(dt)`` with ``dt`` log-uniform in ``[dt_min, dt_max]``, clamped
    below at ``dt_floor``, so that ``softplus(dt_bias)`` starts at ``dt``."""
    u = jax.random.uniform(key, shape, jnp.float32)
    dt = jnp.exp(u * (jnp.log(dt_max) - jnp.log(dt_min)) + jnp.log(dt_min))
    dt = jnp.maximum(dt, dt_floor)
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


def conv_init(key, shape, dtype=jnp.float32):
    """PyTorch's ``Conv1d`` default for a depthwise filter ``[W, D]``: ``U(-1/sqrt(W), 1/sqrt(W))``."""
    bound = shape[0] ** -0.5
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dtype)


def bias_free_linear(*, dtype, param_dtype, kernel_init=None, rngs):
    """``nnx.Linear`` without bias and with these settings: ``linear(in, out)``. The default
    ``kernel_init`` is Flax's, LeCun normal."""
    if kernel_init is None:
        kernel_init = nnx.initializers.lecun_normal()
    return functools.partial(
        nnx.Linear,
        use_bias=False,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=kernel_init,
        rngs=rngs,
    )
