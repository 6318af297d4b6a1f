"""Per-key-channel decays inside one chunk, and the intra-chunk scores they weight (KDA).

With log-gates ``g [C, K]``, one per token and key channel, write ``G_t = g_1 + ... + g_t``
(per channel, from the chunk's start). The chunked form of Kimi Delta Attention needs

    exp(G_t)         from the chunk's start through token t     [C, K]
    exp(G_C - G_i)   from token i to the chunk's end            [C, K]
    exp(G_C)         over the whole chunk                       [K]
    M_ti = sum_c x_tc k_ic exp(G_tc - G_ic)   for i <= t        [C, C]

for ``x = q`` (the outputs) and ``x = k`` (the WY system). ``M`` sums over channels a decay
that differs per channel, so it is one matmul of decayed factors only if the decay splits:
``exp(G_t) exp(-G_i)`` would overflow once a chunk decays by more than e^88 (float32). So
``M`` is built by halving. Split a block of ``b`` tokens into halves; for ``t`` in the second
half and ``i`` in the first the half's boundary ``r`` (the first half's last token) lies
between them:

    exp(G_t - G_i) = exp(G_t - G_r) exp(G_r - G_i),   both factors in [0, 1],

so the block's lower-left quarter is one matmul of ``x`` and ``k`` each decayed to the
boundary, ``(X_2 * exp(G_2 - G_r)) (K_1 * exp(G_r - G_1))^T``, and the two diagonal
quarters are the same problem at half the size, down to single tokens (``x_t . k_t``: no
decay). Each of the ``log2(C)`` levels holds two ``[C/2, K]`` factors, so a chunk's largest
arrays are ``[C, K]`` and ``M`` itself, never ``[C, C, K]``; the matmuls add up to the
``2 C^2 K`` flops of one undecayed ``X K^T``.

Every decay is a product of per-token ``alpha`` over a segment of tokens, built by doubling
(``log2(C)`` products deep), never a ratio or a difference of running sums (as in
``decays.py``): factors in ``[0, 1]`` neither overflow nor cancel, so the -0.01 steps after
a -1e4 reset stay exact, and the chunk takes one ``exp`` per gate.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Float


class HalvingLevel(NamedTuple):
    """The factors of one level, blocks of ``b`` tokens (``C / b`` of them) split in halves."""

    rows: Float[Array, "NB b2 K"]  # exp(G_t - G_r), t in a block's second half
    cols: Float[Array, "NB b2 K"]  # exp(G_r - G_i), i in a block's first half


class ChannelDecays(NamedTuple):
    """The per-channel decays of one chunk of ``C`` tokens (a power of two)."""

    from_start: Float[Array, "C K"]  # exp(G_t)
    to_end: Float[Array, "C K"]  # exp(G_C - G_i)
    whole: Float[Array, " K"]  # exp(G_C)
    levels: tuple[HalvingLevel, ...]  # blocks of b = 2, 4, ..., C tokens


def channel_decays(log_alpha: Float[Array, "C K"]) -> ChannelDecays:
    """Every decay of one chunk from its gates ``log_alpha [C, K]`` (each ``<= 0``, finite).

    The segment decays come by doubling from the per-token ``alpha = exp(log_alpha)``: with
    ``prefix`` and ``suffix`` the decays from each aligned segment of ``h`` tokens' start
    through ``t`` and from after ``t`` to its end, the segments of ``2 h`` scale their second
    half's prefixes by the first half's whole decay and their first half's suffixes by the
    second half's. At ``h`` these are a level's factors (``rows`` from the second halves'
    prefixes, ``cols`` from the first halves' suffixes of the blocks of ``2 h``), at ``h = C``
    the decays from the start and to the end.
    """
    chunk, key_dim = log_alpha.shape
    prefix = jnp.exp(log_alpha).reshape(chunk, 1, key_dim)  # [segments, h, K] at h = 1
    suffix = jnp.ones_like(prefix)
    levels = []
    while prefix.shape[0] > 1:
        num, half = prefix.shape[:2]
        prefix, suffix = (x.reshape(num // 2, 2, half, key_dim) for x in (prefix, suffix))
        levels.append(HalvingLevel(prefix[:, 1], suffix[:, 0]))
        first_whole, second_whole = prefix[:, 0, -1:], prefix[:, 1, -1:]
        prefix = jnp.concatenate([prefix[:, 0], prefix[:, 1] * first_whole], axis=1)
        suffix = jnp.concatenate([suffix[:, 0] * second_whole, suffix[:, 1]], axis=1)
    return ChannelDecays(prefix[0], suffix[0], prefix[0, -1], tuple(levels))


def channel_scores(
    x: Float[Array, "C K"], k: Float[Array, "C K"], decays: ChannelDecays
) -> Float[Array, "C C"]:
    """``M_ti = sum_c x_tc k_ic exp(G_tc - G_ic)`` for ``i <= t``, zero above the diagonal,
    for one row factor ``x`` (the queries or the keys).

    The queries' and the keys' scores are two calls, not one on a stack ``[q; k]`` against
    ``k``: autodiff sums the stacked factors' cotangents for the shared ``k`` as a reduce of a
    product over the stack's axis, and XLA:CPU (jaxlib 0.10.2) hands such reduces to
    YNNPACK, which segfaults or returns wrong values on some of their shapes
    (``tests/test_head_layouts.py``)."""
    chunk, key_dim = x.shape
    blocks = (x * k).sum(-1)[:, None, None]  # [C, 1, 1]: the diagonal
    for level in decays.levels:
        num, half = level.rows.shape[:2]
        x_rows = x.reshape(num, 2, half, key_dim)[:, 1] * level.rows
        k_cols = k.reshape(num, 2, half, key_dim)[:, 0] * level.cols
        lower = jnp.einsum("jtk,jik->jti", x_rows, k_cols)  # [NB, b/2, b/2]
        pairs = blocks.reshape(num, 2, half, half)
        top = jnp.concatenate([pairs[:, 0], jnp.zeros_like(lower)], axis=2)
        bottom = jnp.concatenate([lower, pairs[:, 1]], axis=2)
        blocks = jnp.concatenate([top, bottom], axis=1)  # [NB, b, b]
    return blocks.reshape(chunk, chunk)
