"""Parameter types and initialisers shared by the layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

# Head (tensor) parallelism: the mesh axis "model" splits every layer by heads. Each parameter
# carries how it splits in Flax's partitioning metadata (``nnx.get_partition_spec``):
# projections into heads by their output columns, projections out of heads by their input
# rows, per-head vectors along their head axis; the rest is whole on every device. A grouped
# value head lives with its key head because value heads are numbered key head by key head.
MODEL_AXIS = "model"
# Sequence (context) parallelism: a mesh axis "seq" of more than one device splits T, and the
# recurrent mixers pass the state and the convolution's halo across it.
SEQ_AXIS = "seq"
COLUMNS = (None, MODEL_AXIS)
ROWS = (MODEL_AXIS, None)
PER_HEAD = (MODEL_AXIS,)


def partitioned(init, sharding):
    """``init`` whose parameters carry ``sharding`` as metadata only: nothing is placed until
    the caller puts the state on a mesh (no mesh is needed to build a layer)."""
    return nnx.with_partitioning(init, sharding, eager_sharding=False)


def param(value, sharding, kind=nnx.Param):
    """A parameter of ``kind`` with ``sharding`` metadata (see ``partitioned``)."""
    return kind(value, out_sharding=sharding, eager_sharding=False)


class NoWeightDecay(nnx.Param):
    """A parameter that the optimizer must not decay: gate parameters such as ``A_log`` and
    ``dt_bias``, whose values set time constants rather than feature weights. Filter with
    ``nnx.OfType(NoWeightDecay)`` or ``isinstance``."""


def a_log_init(key, shape, dtype=jnp.float32, *, minval=0.0):
    """``A_log = log(A)``, ``A ~ U(minval, 16)``: per-head decay rates spread over an order
    of magnitude (Gated DeltaNet's and Mamba-2's initialisation; KDA draws from U(1, 16))."""
    a = jax.random.uniform(key, shape, jnp.float32, minval=minval, maxval=16.0)
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
    """``nnx.Linear`` without bias and with these settings: ``linear(in, out, sharding)``,
    ``sharding`` one of ``COLUMNS`` (into heads), ``ROWS`` (out of heads) or ``None``. The
    default ``kernel_init`` is Flax's, LeCun normal."""
    if kernel_init is None:
        kernel_init = nnx.initializers.lecun_normal()

    def linear(in_features, out_features, sharding=None):
        init = kernel_init if sharding is None else partitioned(kernel_init, sharding)
        return nnx.Linear(
            in_features,
            out_features,
            use_bias=False,
            dtype=dtype,
            param_dtype=param_dtype,
            kernel_init=init,
            rngs=rngs,
        )

    return linear


def gate_linear(in_features, out_features, *, use_bias, dtype, param_dtype, kernel_init, rngs):
    """An output gate's projection into the value heads (split by heads), with a zero bias
    when ``use_bias``; the default ``kernel_init`` is Flax's, LeCun normal."""
    kernel_init = kernel_init or nnx.initializers.lecun_normal()
    return nnx.Linear(
        in_features,
        out_features,
        use_bias=use_bias,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=partitioned(kernel_init, COLUMNS),
        bias_init=partitioned(nnx.initializers.zeros, PER_HEAD),
        rngs=rngs,
    )
