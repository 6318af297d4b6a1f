"""The backward of the Mosaic GPU forward (``chunked_mosaic.py``): ``chunked.py``'s
hand-derived backward in XLA, run from the chunk start states that the forward kernel
wrote, over every value head at once.

Its stages are the XLA form's hoisted ones (``chunked.SCHEDULES["hoisted"]``): stage 1 again
for every chunk, the reverse state pass carrying the state's cotangent over the chunks
(with the resets of each sequence's first and last chunk, ``blocks.scan_blocks_backward``),
then every input's gradient chunk by chunk. Its inputs are the kernels' token layout
(``mosaic_layout.py``), so one call covers batch rows and packed sequences alike.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gdn_jax.ops import chunked
from gdn_jax.ops.wy import DELTA


def _one_head(resets, q, k, v, log_alpha, beta, starts, d_y, d_finals):
    """One value head: chunks ``[NC, C, ...]`` in, ``(dq, dk, dv, d log_alpha, d beta,
    d initial)`` out."""
    inputs = (q, k, v, log_alpha, beta)
    _, backward = chunked.SCHEDULES["hoisted"]
    (d_q, d_k, d_v, d_beta, d_log_alpha), d_initial = backward(
        DELTA, inputs, starts, resets, d_y, d_finals
    )
    return d_q, d_k, d_v, d_log_alpha, d_beta, d_initial


def xla_backward(inputs, starts, resets, d_y, d_finals):
    """The gradients of the token-layout inputs ``q, k [tokens, H, K]``, ``v [tokens, HV,
    V]``, ``log_alpha, beta [tokens, HV]`` and of the initial states ``[N, HV, V, K]``, from
    the chunk start states ``[chunks, HV, V, K]`` (float32) and the cotangents of ``y
    [tokens, HV, V]`` and of the final states. The gradients of q and k sum over their
    value heads; q, k and v's are in their own dtype, the rest in the states'."""
    q, k, v, log_alpha, beta = inputs
    tokens, heads, key_dim = q.shape
    v_heads, value_dim = v.shape[1:]
    group = v_heads // heads
    chunks = starts.shape[0]
    chunk = tokens // chunks

    def by_group(x):  # [tokens, HV, ...] -> [chunks, C, H, group, ...]
        return x.reshape(chunks, chunk, heads, group, *x.shape[2:])

    q, k = (x.reshape(chunks, chunk, heads, key_dim) for x in (q, k))
    v, log_alpha, beta, d_y = (by_group(x) for x in (v, log_alpha, beta, d_y))
    starts = starts.reshape(chunks, heads, group, value_dim, key_dim)
    d_finals = d_finals.reshape(d_finals.shape[0], heads, group, value_dim, key_dim)
    one = functools.partial(_one_head, resets)
    over_group = jax.vmap(one, in_axes=(None, None, 2, 2, 2, 1, 2, 1))
    over_heads = jax.vmap(over_group, in_axes=(2, 2, 2, 2, 2, 1, 2, 1))
    # Each gradient comes out [H, group, ...] (a value head's own, before the sums).
    d_q, d_k, d_v, d_log_alpha, d_beta, d_initial = over_heads(
        q, k, v, log_alpha, beta, starts, d_y, d_finals
    )

    def tokens_first(x, trailing):  # [H, group, chunks, C, *trailing] -> [tokens, HV, ...]
        x = jnp.moveaxis(x, (0, 1), (2, 3))
        return x.reshape(tokens, v_heads, *trailing)

    def key_grad(x):  # summed over each key head's value heads, in float32
        summed = x.astype(jnp.float32).sum(1).astype(x.dtype)
        return jnp.moveaxis(summed, 0, 2).reshape(tokens, heads, key_dim)

    d_initial = jnp.moveaxis(d_initial, (0, 1), (1, 2))
    return (
        key_grad(d_q),
        key_grad(d_k),
        tokens_first(d_v, (value_dim,)),
        tokens_first(d_log_alpha, ()),
        tokens_first(d_beta, ()),
        d_initial.reshape(d_initial.shape[0], v_heads, value_dim, key_dim),
    )
