"""Decays inside one chunk from its log-space gates, and their gradient.

Write ``g_t = log_alpha_1 + ... + log_alpha_t`` for the log-decay from the chunk start
through token ``t``. The chunked form needs ``exp(g_t - g_i)`` between tokens, ``exp(g_t)``
from the start, ``exp(g_C - g_i)`` to the end and ``exp(g_C)`` over the chunk. Each is the
``exp`` of a segment sum of ``log_alpha`` over ``(i, t]``, summed directly (as Mamba-2 does)
rather than taken as a difference of running sums, whose float32 cancellation loses the small
gaps after a large one (``log_alpha = -1e4``, then ``-0.01``). Every segment sum is ``<= 0``
(the sums above the diagonal are 0 by construction), so no ``exp`` overflows.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

# A log-decay this low is a full reset in float32 and float64 alike (exp underflows to 0
# below about -746). Clamping to it keeps -inf gates out of the segment sums, whose matmul
# would otherwise multiply -inf by the zeros of its mask.
LOG_ALPHA_FLOOR = -1e4


class ChunkDecays(NamedTuple):
    """The decays of one chunk of ``C`` tokens (add leading axes for many chunks)."""

    within: Float[Array, "C C"]  # exp(g_t - g_i) for i <= t, 0 above the diagonal
    from_start: Float[Array, " C"]  # exp(g_t)
    to_end: Float[Array, " C"]  # exp(g_C - g_i)
    whole: Float[Array, ""]  # exp(g_C)


def segment_sums(log_alpha: Float[Array, " C"]) -> Float[Array, "C C"]:
    """``L[t, i] = sum(log_alpha[i+1 : t+1])`` for ``t >= i``, else 0: the log-decay from
    token ``i`` to token ``t``."""
    chunk = log_alpha.shape[0]
    lower = jnp.tril(jnp.ones((chunk, chunk), log_alpha.dtype))
    # A cumulative sum down the columns of the masked matrix, as a product with a
    # lower-triangular matrix of ones (XLA:CPU's cumsum is a slow reduce_window). HIGHEST
    # keeps TPU and GPU from rounding the log-decays to bf16 or tf32.
    masked = jnp.where(jnp.tril(lower, -1) > 0, log_alpha[:, None], 0)
    return jnp.matmul(lower, masked, precision=jax.lax.Precision.HIGHEST)


def chunk_decays(log_alpha: Float[Array, " C"]) -> ChunkDecays:
    """Every decay of one chunk, from its gates ``log_alpha [C]`` (each ``<= 0``).

    The sums from the chunk start add the first gate to column 0 of the segment sums, which
    starts after it: ``g_t = log_alpha_0 + L[t, 0]``.
    """
    chunk = log_alpha.shape[0]
    seg = segment_sums(log_alpha)
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    from_start = log_alpha[0] + seg[:, 0]
    within = jnp.where(causal, jnp.exp(seg), 0)
    return ChunkDecays(within, jnp.exp(from_start), jnp.exp(seg[-1]), jnp.exp(from_start[-1]))


def chunk_decays_bwd(decays: ChunkDecays, cotangents: ChunkDecays) -> Float[Array, " C"]:
    """The gradient with respect to ``log_alpha [C]`` from cotangents of every decay.

    Each decay is ``exp`` of a difference of ``g``, so its cotangent times its value flows
    with ``+`` to the later end of the segment and ``-`` to the earlier one, giving ``dg``;
    then ``d log_alpha_s = sum_{t >= s} dg_t`` since ``g_t`` sums the gates up to ``t``.
    """
    inner = cotangents.within * decays.within  # zero above the diagonal
    from_start = cotangents.from_start * decays.from_start
    to_end = cotangents.to_end * decays.to_end
    d_g = inner.sum(1) - inner.sum(0) + from_start - to_end
    d_g = d_g.at[-1].add(cotangents.whole * decays.whole + to_end.sum())
    return jax.lax.cumsum(d_g, reverse=True)
