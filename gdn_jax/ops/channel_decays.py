"""Per-key-channel decays inside one chunk, and the intra-chunk scores they weight (KDA and
GDN-2).

With log-gates ``g [C, K]``, one per token and key channel, write ``G_t = g_1 + ... + g_t``
(per channel, from the chunk's start). The channel-gated chunked form needs

    exp(G_t)         from the chunk's start through token t     [C, K]
    exp(G_C - G_i)   from token i to the chunk's end            [C, K]
    exp(G_C)         over the whole chunk                       [K]
    M_ti = sum_c x_tc k_ic exp(G_tc - G_ic)   for i <= t        [C, C]

for ``x = q`` (the outputs) and ``x = e`` (the erase vectors, for the WY system). ``M`` sums
over channels a decay that differs per channel, so it is one matmul of decayed factors only
if the decay splits: ``exp(G_t) exp(-G_i)`` would overflow once a chunk decays by more than
e^88 (float32). So ``M`` is built by halving. Split a block of ``b`` tokens into halves; for
``t`` in the second half and ``i`` in the first the half's boundary ``r`` (the first half's
last token) lies between them:

    exp(G_t - G_i) = exp(G_t - G_r) exp(G_r - G_i),   both factors in [0, 1],

so the block's lower-left quarter is one matmul of ``x`` and ``k`` each decayed to the
boundary, ``(X_2 * exp(G_2 - G_r)) (K_1 * exp(G_r - G_1))^T``, and the two diagonal
quarters are the same problem at half the size, down to single tokens (``x_t . k_t``: no
decay). The matmuls add up to the ``2 C^2 K`` flops of one undecayed ``X K^T``.

Every decay is the ``exp`` of a sum of the gates over its own segment of tokens (``(r, t]``
for a level's rows, ``(i, r]`` for its columns, ``[0, t]``, ``(i, C)``), summed directly as
a product with a triangle of ones, never a difference of running sums (``decays.py`` says
why: float32 would lose the -0.01 steps after a -1e4 reset). Each level's two ``[C/2, K]``
factors depend on the gates alone, so they are made where a level uses them and dropped
after it: a chunk's largest arrays are ``[C, K]`` and ``M`` itself, never ``[C, C, K]`` nor
all ``log2(C)`` levels at once (batched over every chunk, as the hoisted schedule runs it,
those would be ``log2(C)`` copies of the keys).

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

from gdn_jax.ops.blocks import barrier_off_cpu


class ChannelDecays(NamedTuple):
    """The decays of one chunk of ``C`` tokens (a power of two) from its start and to its
    end; the halving levels' factors come from ``level_factors``."""

    from_start: Float[Array, "C K"]  # exp(G_t)
    to_end: Float[Array, "C K"]  # exp(G_C - G_i)
    whole: Float[Array, " K"]  # exp(G_C)


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


def channel_decays(log_alpha: Float[Array, "C K"]) -> ChannelDecays:
    """The decays from the chunk's start and to its end, from its gates ``log_alpha [C, K]``
    (each ``<= 0``, finite)."""
    from_start = sums_along(log_alpha, reverse=False, exclusive=False)
    to_end = sums_along(log_alpha, reverse=True, exclusive=True)
    return ChannelDecays(jnp.exp(from_start), jnp.exp(to_end), jnp.exp(from_start[-1]))


def halving_sizes(chunk: int) -> list[int]:
    """The half-block sizes of the levels, finest first: 1, 2, 4, ..., C/2."""
    return [2**j for j in range(chunk.bit_length() - 1)]


def level_factors(log_alpha: Float[Array, "C K"], half: int):
    """The factors of the level whose blocks hold ``2 half`` tokens: ``(rows, cols)``, each
    ``[NB, half, K]``, ``rows = exp(G_t - G_r)`` for ``t`` in a block's second half and
    ``cols = exp(G_r - G_i)`` for ``i`` in its first, ``r`` the first half's last token."""
    chunk, key_dim = log_alpha.shape
    halves = log_alpha.reshape(chunk // (2 * half), 2, half, key_dim)
    rows = sums_along(halves[:, 1], reverse=False, exclusive=False)
    cols = sums_along(halves[:, 0], reverse=True, exclusive=True)
    return jnp.exp(rows), jnp.exp(cols)


def channel_scores(
    xs: tuple[Float[Array, "C K"], ...], k: Float[Array, "C K"], log_alpha: Float[Array, "C K"]
) -> tuple[Float[Array, "C C"], ...]:
    """``M_ti = sum_c x_tc k_ic exp(G_tc - G_ic)`` for ``i <= t``, zero above the diagonal,
    for each row factor ``x`` of ``xs`` (the queries, the erase vectors) against one ``k``:
    every level's factors are made once for all of them."""
    chunk, key_dim = k.shape
    blocks = [(x * k).sum(-1)[:, None, None] for x in xs]  # [C, 1, 1]: the diagonals
    for half in halving_sizes(chunk):
        blocks, gates = _after(blocks, log_alpha)
        rows, cols = level_factors(gates, half)
        num = rows.shape[0]
        k_cols = k.reshape(num, 2, half, key_dim)[:, 0] * cols
        for i, x in enumerate(xs):
            x_rows = x.reshape(num, 2, half, key_dim)[:, 1] * rows
            lower = jnp.einsum("jtk,jik->jti", x_rows, k_cols)  # [NB, b/2, b/2]
            pairs = blocks[i].reshape(num, 2, half, half)
            top = jnp.concatenate([pairs[:, 0], jnp.zeros_like(lower)], axis=2)
            bottom = jnp.concatenate([lower, pairs[:, 1]], axis=2)
            blocks[i] = jnp.concatenate([top, bottom], axis=1)  # [NB, b, b]
    return tuple(b.reshape(chunk, chunk) for b in blocks)


def channel_scores_bwd(xs, k, log_alpha, d_scores):
    """The pullback of ``channel_scores(xs, k, log_alpha)`` for cotangents ``d_scores`` (one
    ``[C, C]`` per score; what lies above the diagonal is ignored): ``(d_xs, d_k,
    d_log_alpha)``, the last from the levels' factors only (``channel_decays_bwd`` adds the
    rest)."""
    chunk, key_dim = k.shape
    blocks = [d[None] for d in d_scores]  # the diagonal blocks of each level, [NB, b, b]
    d_xs = [jnp.zeros_like(x) for x in xs]
    d_k, d_log_alpha = jnp.zeros_like(k), jnp.zeros_like(log_alpha)
    for half in reversed(halving_sizes(chunk)):
        (blocks, d_log_alpha), gates = _after((blocks, d_log_alpha), log_alpha)
        rows, cols = level_factors(gates, half)
        num = rows.shape[0]
        k_cols = k.reshape(num, 2, half, key_dim)[:, 0]
        d_rows, d_cols = jnp.zeros_like(rows), jnp.zeros_like(cols)
        for i, x in enumerate(xs):
            lower = blocks[i][:, half:, :half]  # [NB, b/2, b/2]
            x_rows = x.reshape(num, 2, half, key_dim)[:, 1]
            d_x_rows = jnp.einsum("jti,jik->jtk", lower, k_cols * cols)  # of x_rows * rows
            d_k_cols = jnp.einsum("jti,jtk->jik", lower, x_rows * rows)  # of k_cols * cols
            d_xs[i] = d_xs[i] + _second_halves(d_x_rows * rows)
            d_k = d_k + _first_halves(d_k_cols * cols)
            d_rows, d_cols = d_rows + d_x_rows * x_rows, d_cols + d_k_cols * k_cols
            halves = jnp.stack([blocks[i][:, :half, :half], blocks[i][:, half:, half:]], 1)
            blocks[i] = halves.reshape(num * 2, half, half)
        second = sums_along(d_rows * rows, reverse=True, exclusive=False)
        first = sums_along(d_cols * cols, reverse=False, exclusive=True)
        d_log_alpha = d_log_alpha + jnp.stack([first, second], axis=1).reshape(chunk, key_dim)
    for i, x in enumerate(xs):
        diagonal = blocks[i][:, 0, :]  # [C, 1]
        d_xs[i], d_k = d_xs[i] + diagonal * k, d_k + diagonal * x
    return tuple(d_xs), d_k, d_log_alpha


def _after(done, log_alpha):
    """``(done, log_alpha)`` as they are, with the next level's factors made from this
    ``log_alpha`` only once ``done`` (the last level's results) exists. Off CPU the barrier
    keeps XLA from making every level's factors at once, ``log2(C)`` copies of the keys
    batched over all chunks (KDA's hoisted forward+backward on a v5e chip: 1504 MiB with it,
    1588 without); XLA:CPU's temp is the same either way and the barrier cost it 5-7% of
    KDA's time (docs/benchmarks.md)."""
    return barrier_off_cpu(done, log_alpha)


def _first_halves(x: Float[Array, "NB h K"]) -> Float[Array, "C K"]:
    """``x``, one row per token of each block's first half, in place among zeros."""
    return jnp.stack([x, jnp.zeros_like(x)], axis=1).reshape(-1, x.shape[-1])


def _second_halves(x: Float[Array, "NB h K"]) -> Float[Array, "C K"]:
    """``x``, one row per token of each block's second half, in place among zeros."""
    return jnp.stack([jnp.zeros_like(x), x], axis=1).reshape(-1, x.shape[-1])


def channel_decays_bwd(
    decays: ChannelDecays,
    d_from_start: Float[Array, "C K"],
    d_to_end: Float[Array, "C K"],
    d_whole: Float[Array, " K"],
) -> Float[Array, "C K"]:
    """The gradient with respect to the gates ``log_alpha [C, K]`` from the cotangents of
    the decays from the start, to the end and over the whole chunk (module docstring)."""
    d = sums_along(d_from_start * decays.from_start, reverse=True, exclusive=False)
    d = d + sums_along(d_to_end * decays.to_end, reverse=False, exclusive=True)
    return d + (d_whole * decays.whole)[None]
