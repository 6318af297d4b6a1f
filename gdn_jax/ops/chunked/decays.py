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

    Each decay is ``exp`` of a sum of the gates over a segment of tokens, so its cotangent
    times its value reaches every gate of the segment: ``exp(g_t - g_i)`` those in ``(i, t]``,
    ``exp(g_t)`` those in ``[0, t]``, ``exp(g_C - g_i)`` those in ``(i, C)`` and ``exp(g_C)``
    all. So ``d log_alpha_s`` sums ``within`` over ``i < s <= t``, ``from_start`` over
    ``t >= s`` and ``to_end`` over ``i < s``.

    Each sum adds the terms of the segments that hold ``s``, and nothing else. The shorter
    route, one ``+`` at a segment's end and one ``-`` at its start and a cumulative sum, adds
    and cancels every segment that does not hold ``s`` as well: in float32 that leaves about
    1e-7 of each such term, and the terms of little decay (the diagonal's and the padded tail
    chunk's, ``exp(0) = 1``) would swamp the gradient of a strong decay, whose own terms are
    small exps (``log_alpha = -8`` gives 3e-4).
    """
    chunk = decays.from_start.shape[0]
    index = jnp.arange(chunk)
    before = (index[:, None] < index[None, :]).astype(decays.within.dtype)  # [i, s]: i < s
    highest = jax.lax.Precision.HIGHEST  # no bf16 or tf32 rounding of the cotangents
    inner = cotangents.within * decays.within  # [t, i], zero above the diagonal
    rows_before = jnp.matmul(inner, before, precision=highest)  # [t, s]: sum over i < s
    from_start = cotangents.from_start * decays.from_start
    to_end = cotangents.to_end * decays.to_end
    held = jnp.where(before > 0, 0, rows_before + from_start[:, None])  # [t, s]: keep t >= s
    return (
        held.sum(0)
        + jnp.matmul(to_end, before, precision=highest)
        + (cotangents.whole * decays.whole)
    )
