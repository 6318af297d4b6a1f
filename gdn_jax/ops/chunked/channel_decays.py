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

Every decay is the ``exp`` of a sum of the gates over its own segment of tokens, and every
such sum is a sum over its own segment, never a difference of running sums (``chunked/decays.py``
says why: float32 would lose the -0.01 steps after a -1e4 reset). They come from one chain
over the levels, finest first, with no product: for blocks of ``h`` tokens let ``P_h[t]``
be the sum of the gates from the start of ``t``'s block through ``t`` and ``S_h[t]`` the sum
over the rest of its block after ``t`` (``P_1 = g``, ``S_1 = 0``). A level whose blocks hold
``2h`` tokens decays its rows by ``exp(P_h)`` on the second halves and its columns by
``exp(S_h)`` on the first halves, and the blocks of ``2h`` tokens follow from those of ``h``
by adding one half's total to the other half:

    P_2h = [P_h,  P_h + (first half's total)],   S_2h = [S_h + (second half's total),  S_h],

each term a sum of gates of one sign, so nothing cancels. At the top, ``exp(P_C)``,
``exp(S_C)`` and ``exp(P_C[-1])`` are the decays from the chunk's start, to its end and over
it. (Each sum as a product with a triangle of ones gave XLA:CPU outputs with the tokens
minor, which every use then read transposed, and KDA's forward+backward slower in both
schedules: docs/benchmarks.md.) A level's two ``[C/2, K]``
factors are made where it uses them: a chunk's largest arrays are ``[C, K]`` and ``M``
itself, never ``[C, C, K]``.

Backward. The scores' pullback mirrors their build, coarsest level first: a level's block
``(X_2 * R) (K_1 * Cc)^T`` sends ``dL (K_1 * Cc)`` to ``X_2 * R`` and ``dL^T (X_2 * R)`` to
``K_1 * Cc``, hence to ``x``, ``k`` and the factors ``R = exp(P_h)`` and ``Cc = exp(S_h)``
(cotangents ``dR * R`` and ``dCc * Cc`` of the sums); the diagonal sends ``dM_tt k_t`` and
``dM_tt x_t``. The sums' cotangents run down the same chain, from the decays' at the top:
the pullback of one step from ``h`` to ``2h`` passes ``dP_2h`` and ``dS_2h`` through and adds
to the last token of each first half the second half's summed ``dP_2h``, and to the last
token of each second half the first half's summed ``dS_2h``; ``dP_1`` is the gates'
gradient. The backward makes every level's sums first (``level_sums``), ``2 log2(C)`` arrays
of ``[C, K]``.

The backward treats the row factors together: a level stacks every ``x``'s cotangent block
along the rows, so each direction is one product for all of them, and the keys' cotangent
from that product is already summed over them, so ``k`` gets one padded piece per level,
not one per ``x`` (XLA:CPU assembles the per-token gradients from these pieces in one pass
whose cost grows with their number). On XLA:CPU this made KDA's and GDN-2's
forward+backward faster; the forward stacked the same way was no faster on CPU and took
more temp on a TPU (docs/benchmarks.md).

On a GPU every kernel of the halving is a launch of its own, a few a level, and each launch
costs more than these small products: there the chunked form makes every level's products
at once (``chunked/channel_levels.py``), with the same factors and sums of gates.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Float

from gdn_jax.ops.chunked.blocks import barrier_off_cpu


class ChannelDecays(NamedTuple):
    """The decays of one chunk of ``C`` tokens (a power of two) from its start and to its
    end; the halving levels' factors come from ``level_factors``."""

    from_start: Float[Array, "C K"]  # exp(G_t)
    to_end: Float[Array, "C K"]  # exp(G_C - G_i)
    whole: Float[Array, " K"]  # exp(G_C)


Sums = tuple  # (P_h, S_h), each [C, K]: the gates summed within blocks of h tokens


def halving_sizes(chunk: int) -> list[int]:
    """The half-block sizes of the levels, finest first: 1, 2, 4, ..., C/2."""
    return [2**j for j in range(chunk.bit_length() - 1)]


def finest(log_alpha: Float[Array, "C K"]) -> Sums:
    """The sums within blocks of one token: ``(g, 0)``."""
    return log_alpha, jnp.zeros_like(log_alpha)


def coarser(sums: Sums, half: int) -> Sums:
    """The sums within blocks of ``2 half`` tokens from those within blocks of ``half``."""
    p, s = (x.reshape(-1, 2, half, x.shape[-1]) for x in sums)
    p2 = jnp.stack([p[:, 0], p[:, 1] + p[:, 0, -1:]], axis=1)
    s2 = jnp.stack([s[:, 0] + p[:, 1, -1:], s[:, 1]], axis=1)
    return p2.reshape(sums[0].shape), s2.reshape(sums[0].shape)


def coarser_bwd(d_sums: Sums, half: int) -> Sums:
    """The pullback of ``coarser(sums, half)``: the cotangents of the sums within blocks of
    ``half`` tokens from those of ``2 half``."""
    d_p, d_s = (x.reshape(-1, 2, half, x.shape[-1]) for x in d_sums)
    totals = jnp.stack([d_p[:, 1].sum(1), d_s[:, 0].sum(1)], axis=1)  # [NB, 2, K]
    last = d_p[:, :, -1:] + totals[:, :, None]
    d_p = jnp.concatenate([d_p[:, :, :-1], last], axis=2)
    return d_p.reshape(d_sums[0].shape), d_sums[1]


def top_decays(sums: Sums) -> ChannelDecays:
    """The chunk's decays from the sums within its one block."""
    from_start, to_end = sums
    return ChannelDecays(jnp.exp(from_start), jnp.exp(to_end), jnp.exp(from_start[-1]))


def level_sums(log_alpha: Float[Array, "C K"]) -> tuple[list[Sums], ChannelDecays]:
    """Every level's sums, finest first (those of the level with half-blocks of ``h``
    tokens are the sums within blocks of ``h``), and the chunk's decays from its gates
    ``log_alpha [C, K]`` (each ``<= 0``, finite)."""
    sums, levels = finest(log_alpha), []
    for half in halving_sizes(log_alpha.shape[0]):
        levels.append(sums)
        sums = coarser(sums, half)
    return levels, top_decays(sums)


def level_factors(sums: Sums, half: int):
    """The factors of the level whose blocks hold ``2 half`` tokens, from the sums within
    blocks of ``half``: ``(rows, cols)``, each ``[NB, half, K]``, ``rows = exp(G_t - G_r)``
    for ``t`` in a block's second half and ``cols = exp(G_r - G_i)`` for ``i`` in its first,
    ``r`` the first half's last token."""
    p, s = (x.reshape(-1, 2, half, x.shape[-1]) for x in sums)
    return jnp.exp(p[:, 1]), jnp.exp(s[:, 0])


def channel_scores(
    xs: tuple[Float[Array, "C K"], ...], k: Float[Array, "C K"], log_alpha: Float[Array, "C K"]
) -> tuple[tuple[Float[Array, "C C"], ...], ChannelDecays]:
    """``M_ti = sum_c x_tc k_ic exp(G_tc - G_ic)`` for ``i <= t``, zero above the diagonal,
    for each row factor ``x`` of ``xs`` (the queries, the erase vectors) against one ``k``:
    every level's factors are made once for all of them. Also returns the chunk's decays."""
    chunk, key_dim = k.shape
    blocks = [(x * k).sum(-1)[:, None, None] for x in xs]  # [C, 1, 1]: the diagonals
    sums = finest(log_alpha)
    for half in halving_sizes(chunk):
        blocks, sums = _after(blocks, sums)
        rows, cols = level_factors(sums, half)
        num = rows.shape[0]
        k_cols = k.reshape(num, 2, half, key_dim)[:, 0] * cols
        for i, x in enumerate(xs):
            x_rows = x.reshape(num, 2, half, key_dim)[:, 1] * rows
            lower = jnp.einsum("jtk,jik->jti", x_rows, k_cols)  # [NB, b/2, b/2]
            pairs = blocks[i].reshape(num, 2, half, half)
            top = jnp.concatenate([pairs[:, 0], jnp.zeros_like(lower)], axis=2)
            bottom = jnp.concatenate([lower, pairs[:, 1]], axis=2)
            blocks[i] = jnp.concatenate([top, bottom], axis=1)  # [NB, b, b]
        sums = coarser(sums, half)
    return tuple(b.reshape(chunk, chunk) for b in blocks), top_decays(sums)


def channel_scores_bwd(xs, k, levels: list[Sums], decays: ChannelDecays, d_scores, d_decays):
    """The pullback of ``channel_scores(xs, k, log_alpha)`` for cotangents ``d_scores`` (one
    ``[C, C]`` per score; what lies above the diagonal is ignored) and ``d_decays`` (of the
    decays from the start, to the end, over the chunk), given ``level_sums(log_alpha)``:
    ``(d_xs, d_k, d_log_alpha)``."""
    chunk, key_dim = k.shape
    n = len(xs)
    d_from_start, d_to_end, d_whole = d_decays
    d_p = d_from_start * decays.from_start
    d_p = d_p.at[-1].add(d_whole * decays.whole)
    d_sums = (d_p, d_to_end * decays.to_end)
    blocks = [d[None] for d in d_scores]  # the diagonal blocks of each level, [NB, b, b]
    d_xs = [jnp.zeros_like(x) for x in xs]
    d_k = jnp.zeros_like(k)
    for half, sums in reversed(list(zip(halving_sizes(chunk), levels, strict=True))):
        (blocks, d_sums), sums = _after((blocks, d_sums), sums)
        d_sums = coarser_bwd(d_sums, half)
        rows, cols = level_factors(sums, half)
        num = rows.shape[0]
        k_cols = k.reshape(num, 2, half, key_dim)[:, 0]
        lowers = jnp.concatenate([b[:, half:, :half] for b in blocks], axis=1)  # [NB, n h, h]
        x_rows = [x.reshape(num, 2, half, key_dim)[:, 1] for x in xs]
        d_x_rows = jnp.einsum("jti,jik->jtk", lowers, k_cols * cols)  # of each x_rows * rows
        d_k_cols = jnp.einsum(
            "jti,jtk->jik", lowers, jnp.concatenate([x * rows for x in x_rows], axis=1)
        )  # of k_cols * cols, summed over xs
        d_rows = jnp.zeros_like(rows)
        for i in range(n):
            d_x_i = d_x_rows[:, i * half : (i + 1) * half]
            d_xs[i] = d_xs[i] + _second_halves(d_x_i * rows)
            d_rows = d_rows + d_x_i * x_rows[i]
            halves = jnp.stack([blocks[i][:, :half, :half], blocks[i][:, half:, half:]], 1)
            blocks[i] = halves.reshape(num * 2, half, half)
        d_k = d_k + _first_halves(d_k_cols * cols)
        d_sums = (
            d_sums[0] + _second_halves(d_rows * rows),
            d_sums[1] + _first_halves(d_k_cols * k_cols * cols),
        )
    for i, x in enumerate(xs):
        diagonal = blocks[i][:, 0, :]  # [C, 1]
        d_xs[i], d_k = d_xs[i] + diagonal * k, d_k + diagonal * x
    return tuple(d_xs), d_k, d_sums[0]


def _after(done, sums):
    """``(done, sums)`` as they are, with the next level's factors made from these ``sums``
    only once ``done`` (the last level's results) exists. Off CPU the barrier keeps XLA from
    making every level's factors at once, ``log2(C)`` copies of the keys batched over all
    chunks, which holds more TPU temp; XLA:CPU's temp is the same either way and the barrier
    only slows it (docs/benchmarks.md)."""
    return barrier_off_cpu(done, sums)


def _first_halves(x: Float[Array, "NB h K"]) -> Float[Array, "C K"]:
    """``x``, one row per token of each block's first half, in place among zeros."""
    return jnp.stack([x, jnp.zeros_like(x)], axis=1).reshape(-1, x.shape[-1])


def _second_halves(x: Float[Array, "NB h K"]) -> Float[Array, "C K"]:
    """``x``, one row per token of each block's second half, in place among zeros."""
    return jnp.stack([jnp.zeros_like(x), x], axis=1).reshape(-1, x.shape[-1])
