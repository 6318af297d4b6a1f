"""The token layout of the Mosaic GPU kernels (``ops/mosaic/scalar/op.py``, ``ops/mosaic/channel/op.py``):
every sequence's chunks on one token axis, each sequence starting on a chunk boundary, and
channels padded to the kernels' tiles (``padded``).

Without ``cu_seqlens`` each batch row is a sequence, its tail chunk padded with inert tokens
(zero inputs: no decay, no write, as ``varlen.chunk_layout`` pads); with it (``B == 1``) the
packed sequences are laid out by ``varlen.pack_layout``. Either way the kernels see ``tokens``
(a multiple of the chunk) and a table of each sequence's first chunk and chunk count, so that
a program of the state passes walks one sequence. Laying out and back are a pad and a slice,
or a scatter and a gather, which autodiff transposes into each other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax.numpy as jnp

from gdn_jax.ops.chunked.varlen import pack_layout
from gdn_jax.ops.mosaic.limits import padded_width


def padded(x, axis: int):
    """``x`` with zero channels along ``axis`` up to ``limits.padded_width`` (a multiple of
    ``limits.PAD``: a wgmma operand's 128-byte swizzle of bf16); the zeros reach no other
    channel in any product."""
    pad = padded_width(x.shape[axis]) - x.shape[axis]
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def padded_states(states):
    """States ``[N, HV, V, K]`` (or their cotangents) with both channel axes ``padded``."""
    return padded(padded(states, 3), 2)


class TokenLayout(NamedTuple):
    """``to_tokens``: ``[B, T, ...] -> [tokens, ...]``; ``from_tokens`` back, zeros where a
    token belongs to no sequence; ``table [N, 2]`` int32 (first chunk, chunk count)."""

    tokens: int
    to_tokens: Callable
    from_tokens: Callable
    table: jnp.ndarray


def token_layout(batch: int, seq_len: int, chunk: int, cu_seqlens=None) -> TokenLayout:
    """The layout of ``batch`` rows of ``seq_len`` tokens, or of the packed ``cu_seqlens``
    (``batch == 1``)."""
    if cu_seqlens is not None:
        return _packed(seq_len, chunk, cu_seqlens)
    per_row = -(-seq_len // chunk)
    padded = per_row * chunk
    rows = jnp.arange(batch, dtype=jnp.int32)
    table = jnp.stack([rows * per_row, jnp.full_like(rows, per_row)], axis=1)

    def to_tokens(x):
        x = jnp.pad(x, [(0, 0), (0, padded - seq_len)] + [(0, 0)] * (x.ndim - 2))
        return x.reshape(batch * padded, *x.shape[2:])

    def from_tokens(y):
        return y.reshape(batch, padded, *y.shape[1:])[:, :seq_len]

    return TokenLayout(batch * padded, to_tokens, from_tokens, table)


def _packed(seq_len: int, chunk: int, cu_seqlens) -> TokenLayout:
    layout = pack_layout(cu_seqlens, seq_len, chunk)
    cu = cu_seqlens.astype(jnp.int32)
    chunks = -(-(cu[1:] - cu[:-1]) // chunk)
    table = jnp.stack([jnp.cumsum(chunks, dtype=jnp.int32) - chunks, chunks], axis=1)
    return TokenLayout(
        layout.num_blocks * chunk,
        lambda x: layout.scatter(x[0]),
        lambda y: layout.gather(y)[None],
        table,
    )
