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

Backward. The scores' pullback mirrors their build, coarsest level first: a level's block
``(X_2 * R) (K_1 * Cc)^T`` sends ``dL (K_1 * Cc)`` to ``X_2 * R`` and ``dL^T (X_2 * R)`` to
``K_1 * Cc``, hence to ``x``, ``k`` and the factors ``R`` and ``Cc``; the diagonal sends
``dM_tt k_t`` and ``dM_tt x_t``. A factor is ``exp`` of a sum of gates over a segment, so
the gradient of gate ``s`` sums (cotangent x value) over the factors whose segment holds
``s``: for ``R = exp(G_t - G_r)``, the tokens ``t >= s`` of a second half; for ``Cc =
exp(G_r - G_i)``, the ``i < s`` of a first half; for ``exp(G_t)`` every ``t >= s``, for
``exp(G_C - G_i)`` every ``i < s``, for ``exp(G_C)`` all. Every term of such a sum belongs
to it, so none is added and cancelled again (``decays.chunk_decays_bwd`` says what that
costs in float32).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
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


def sums_along(x: Float[Array, "... n K"], *, reverse: bool, exclusive: bool):
    """Cumulative sums of ``x`` along its axis ``n``, forward (``sum_{i <= s}``, or ``i <
    s`` when ``exclusive``) or ``reverse`` (``sum_{t >= s}``, or ``t > s``), as one product
    with a triangle of ones (XLA:CPU's cumsum is a slow reduce_window); HIGHEST keeps TPU
    and GPU from rounding the terms to bf16 or tf32."""
    n = x.shape[-2]
    index = jnp.arange(n)
    rows, cols = index[:, None], index[None, :]
    if reverse:
        keep = cols > rows if exclusive else cols >= rows
    else:
        keep = cols < rows if exclusive else cols <= rows
    ones = keep.astype(x.dtype)
    return jnp.einsum("st,...tk->...sk", ones, x, precision=jax.lax.Precision.HIGHEST)


def channel_scores_bwd(
    x: Float[Array, "C K"], k: Float[Array, "C K"], decays: ChannelDecays, d_scores
) -> tuple[Float[Array, "C K"], Float[Array, "C K"], tuple[HalvingLevel, ...]]:
    """The pullback of ``channel_scores(x, k, decays)`` for ``d_scores [C, C]``
    (what lies above the diagonal is ignored): ``(dx, dk, d_levels)``, ``d_levels`` the
    cotangents of each level's factors, in ``decays.levels``' order."""
    chunk, key_dim = x.shape
    blocks = d_scores[None]  # the diagonal blocks of the level, [NB, b, b]
    d_x, d_k, d_levels = jnp.zeros_like(x), jnp.zeros_like(k), []
    for level in reversed(decays.levels):
        num, half = level.rows.shape[:2]
        lower = blocks[:, half:, :half]  # [NB, b/2, b/2]
        x_rows = x.reshape(num, 2, half, key_dim)[:, 1]
        k_cols = k.reshape(num, 2, half, key_dim)[:, 0]
        d_rows = jnp.einsum("jti,jik->jtk", lower, k_cols * level.cols)  # of x_rows * rows
        d_cols = jnp.einsum("jti,jtk->jik", lower, x_rows * level.rows)  # of k_cols * cols
        zeros = jnp.zeros_like(d_rows)
        d_x = d_x + jnp.stack([zeros, d_rows * level.rows], 1).reshape(chunk, key_dim)
        d_k = d_k + jnp.stack([d_cols * level.cols, zeros], 1).reshape(chunk, key_dim)
        d_levels.append(HalvingLevel(d_rows * x_rows, d_cols * k_cols))
        halves = jnp.stack([blocks[:, :half, :half], blocks[:, half:, half:]], axis=1)
        blocks = halves.reshape(num * 2, half, half)
    diagonal = blocks[:, 0, :]  # [C, 1]
    return d_x + diagonal * k, d_k + diagonal * x, tuple(d_levels[::-1])


def channel_decays_bwd(
    decays: ChannelDecays,
    d_from_start: Float[Array, "C K"],
    d_to_end: Float[Array, "C K"],
    d_whole: Float[Array, " K"],
    d_levels: tuple[HalvingLevel, ...],
) -> Float[Array, "C K"]:
    """The gradient with respect to the gates ``log_alpha [C, K]`` from the cotangents of
    every decay (module docstring)."""
    chunk, key_dim = decays.from_start.shape
    d = sums_along(d_from_start * decays.from_start, reverse=True, exclusive=False)
    d = d + sums_along(d_to_end * decays.to_end, reverse=False, exclusive=True)
    d = d + (d_whole * decays.whole)[None]
    for level, d_level in zip(decays.levels, d_levels, strict=True):
        second = sums_along(d_level.rows * level.rows, reverse=True, exclusive=False)
        first = sums_along(d_level.cols * level.cols, reverse=False, exclusive=True)
        d = d + jnp.stack([first, second], axis=1).reshape(chunk, key_dim)
    return d
