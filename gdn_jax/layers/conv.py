"""Short causal convolution over the projected q, k or v channels."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from gdn_jax.layers.params import COLUMNS, PER_HEAD, SEQ_AXIS, conv_init, param
from gdn_jax.ops.chunked.varlen import segment_positions
from gdn_jax.ops.conv import short_conv, short_convs_seq_parallel


class ShortConvolution(nnx.Module):
    """Depthwise causal convolution of width ``conv_size`` followed by SiLU, as
    flash-linear-attention's ``ShortConvolution(activation="silu")``."""

    def __init__(self, channels, conv_size, *, use_bias=False, dtype, param_dtype, rngs):
        # Channels are heads' features, split over the model axis like the projection before.
        self.weight = param(conv_init(rngs.params(), (conv_size, channels), param_dtype), COLUMNS)
        bias = jnp.zeros((channels,), param_dtype)
        self.bias = param(bias, PER_HEAD) if use_bias else None
        self.dtype = dtype

    def __call__(self, x, *, history=None, same_segment=None):
        """``x [B, T, D]``, ``history [B, W-1, D]`` or None, ``same_segment [W-1, T]`` or None.
        Returns ``(silu(conv(x)) [B, T, D], history [B, W-1, D])``."""
        return short_conv(*self.filters(), x, history, same_segment)

    def filters(self):
        """``(weight [W, D], bias [D] or None)`` in the compute dtype."""
        bias = None if self.bias is None else self.bias[...].astype(self.dtype)
        return self.weight[...].astype(self.dtype), bias


def convolve_qkv(convs, qkv, *, histories=None, cu_seqlens=None, seq_mesh=None):
    """Run the q, k and v short convolutions ``convs`` over ``qkv``, each ``[B, T, channels]``,
    from ``histories`` (the previous call's, or None for a fresh start); with packed
    ``cu_seqlens`` no tap reaches across a sequence start. Returns ``(qkv, histories)``.

    With ``seq_mesh`` (a mesh with a ``SEQ_AXIS``; no ``histories``), T is split over that
    axis and each shard takes the ``W - 1`` tokens before it from the previous shard."""
    same_segment = None
    if cu_seqlens is not None:
        conv_size = convs[0].weight.shape[0]
        _, offset = segment_positions(cu_seqlens, qkv[0].shape[1])
        lags = jnp.arange(conv_size - 1, 0, -1, dtype=jnp.int32)[:, None]
        same_segment = offset[None, :] >= lags  # tap j looks back W-1-j tokens
    if seq_mesh is not None:
        filters = [conv.filters() for conv in convs]
        return short_convs_seq_parallel(filters, qkv, same_segment, seq_mesh, SEQ_AXIS), None
    histories = (None, None, None) if histories is None else histories
    outs = [
        conv(z, history=h, same_segment=same_segment)
        for conv, z, h in zip(convs, qkv, histories, strict=True)
    ]
    return tuple(y for y, _ in outs), tuple(h for _, h in outs)
