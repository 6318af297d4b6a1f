"""Short causal convolution over the projected q, k or v channels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from gdn_jax.layers.params import conv_init
from gdn_jax.ops.conv import causal_depthwise_conv
from gdn_jax.ops.varlen import segment_positions


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


def convolve_qkv(convs, qkv, *, histories=None, cu_seqlens=None):
    """Run the q, k and v short convolutions ``convs`` over ``qkv``, each ``[B, T, channels]``,
    from ``histories`` (the previous call's, or None for a fresh start); with packed
    ``cu_seqlens`` no tap reaches across a sequence start. Returns ``(qkv, histories)``."""
    same_segment = None
    if cu_seqlens is not None:
        conv_size = convs[0].weight.shape[0]
        _, offset = segment_positions(cu_seqlens, qkv[0].shape[1])
        lags = jnp.arange(conv_size - 1, 0, -1, dtype=jnp.int32)[:, None]
        same_segment = offset[None, :] >= lags  # tap j looks back W-1-j tokens
    histories = (None, None, None) if histories is None else histories
    outs = [
        conv(z, history=h, same_segment=same_segment)
        for conv, z, h in zip(convs, qkv, histories, strict=True)
    ]
    return tuple(y for y, _ in outs), tuple(h for _, h in outs)
