"""Short causal convolution over the projected q, k or v channels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from gdn_jax.layers.params import conv_init
from gdn_jax.ops.conv import causal_depthwise_conv


class ShortConvolution(nnx.Module):
    """Depthwise causal convolution of width ``conv_size`` followed by SiLU, as
    flash-linear-attention's ``ShortConvolution(activation="silu")``."""

    def __init__(self, channels, conv_size, *, use_bias=False, dtype, param_dtype, rngs):
        self.weight = nnx.Param(conv_init(rngs.params(), (conv_size, channels), param_dtype))
        self.bias = nnx.Param(jnp.zeros((channels,), param_dtype)) if use_bias else None
        self.dtype = dtype

    def __call__(self, x, *, history=None, same_segment=None):
        """``x [B, T, D]``, ``history [B, W-1, D]`` or None, ``same_segment [W-1, T]`` or None.
        Returns ``(silu(conv(x)) [B, T, D], history [B, W-1, D])``."""
        weight = self.weight[...].astype(self.dtype)
        bias = None if self.bias is None else self.bias[...].astype(self.dtype)

        def one(x, history):
            return causal_depthwise_conv(
                x, weight, bias, history=history, same_segment=same_segment
            )

        y, history = jax.vmap(one)(x, history)
        return jax.nn.silu(y), history
