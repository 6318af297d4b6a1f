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
costs more than these small products (``scores``). There the chunked form makes every
level's products at once (``all_levels``): each level's second-half rows and first-half
columns, decayed to its boundaries as above, stacked over the levels as ``[L, C/2, K]``
(``L = log2(C)``), one batched product ``[L, C/2, C/2]`` whose diagonal blocks are the
levels' scores, and a static gather that puts them in place (``level_map``); the pullback
is the same two products and the gather's inverse. The stacked rows are ``L/2`` times the
keys, so it is taken where chunks are taken a group at a time or one by one (the
``associative`` schedule's gradients, ``in_scan``), and the halving where every chunk is
batched at once, and throughout the ``hoisted`` schedule, the one for when memory binds
(``chunked/channel.py``'s ``halving``; the figures that chose this in docs/benchmarks.md).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
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


def level_map(chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """Where each score of a chunk sits among the levels' products, for ``all_levels``:
    ``(at [C, C], strict [C, C])``. Score ``(t, i)``, ``i < t``, belongs to the level whose
    blocks first hold both tokens, the highest bit in which ``t`` and ``i`` differ (half
    ``h``), and in that level's ``[C/2, C/2]`` product of second-half rows and first-half
    columns, both in token order, it is row ``t // 2h * h + t % h``, column ``i // 2h * h +
    i % h``; ``at`` is its index in the levels' products flattened (0 where ``i >= t``)."""
    t, i = np.meshgrid(np.arange(chunk), np.arange(chunk), indexing="ij")
    strict = i < t
    level = np.zeros_like(t)
    for j in range(1, chunk.bit_length()):
        level[(t ^ i) >= 2**j] = j
    half = 2**level
    row = t // (2 * half) * half + t % half
    col = i // (2 * half) * half + i % half
    at = (level * (chunk // 2) + row) * (chunk // 2) + col
    return np.where(strict, at, 0), strict


def level_map_bwd(chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of ``level_map``: for each entry of the levels' products ``[L, C/2,
    C/2]``, the index of its score in ``[C, C]`` flattened, and whether it is one (the
    products' entries outside their levels' blocks are no score)."""
    at, strict = level_map(chunk)
    size = len(halving_sizes(chunk)) * (chunk // 2) ** 2
    inverse, used = np.zeros(size, np.int64), np.zeros(size, bool)
    inverse[at[strict]], used[at[strict]] = np.flatnonzero(strict), True
    shape = (len(halving_sizes(chunk)), chunk // 2, chunk // 2)
    return inverse.reshape(shape), used.reshape(shape)


def _level_halves(x: Float[Array, "C K"], chunk: int):
    """``x``'s first and second halves of every level's blocks, ``[L, C/2, K]`` each, in
    token order (the rows and columns of ``level_map``'s products)."""
    pairs = [x.reshape(-1, 2, half, x.shape[-1]) for half in halving_sizes(chunk)]
    return tuple(jnp.stack([p[:, j].reshape(chunk // 2, -1) for p in pairs]) for j in (0, 1))


def _levels_stacked(levels: list[Sums], chunk: int):
    """Every level's factors, ``rows`` and ``cols`` of ``level_factors``, ``[L, C/2, K]``."""
    factors = [level_factors(s, h) for h, s in zip(halving_sizes(chunk), levels, strict=True)]
    return tuple(jnp.stack([f[j].reshape(chunk // 2, -1) for f in factors]) for j in (0, 1))


def all_levels(xs, k, log_alpha):
    """``channel_scores(xs, k, log_alpha)`` with every level's products made at once: one
    batched product ``[L, n C/2, K] x [L, C/2, K]`` for the ``n`` row factors of ``xs``,
    the second halves of each level's blocks decayed from the boundary, against the first
    halves of ``k`` decayed to it, whose diagonal blocks of each level are the scores
    (``level_map``). It multiplies ``L C^2 K / 4`` a score where the halving does ``log2(C)
    C^2 K / 4`` over ``log2(C)`` products, each with its own factors: the same decays and
    sums of gates, in a few kernels rather than a few a level (docs/benchmarks.md)."""
    chunk = k.shape[0]
    levels, decays = level_sums(log_alpha)
    rows, cols = _levels_stacked(levels, chunk)
    k_cols = _level_halves(k, chunk)[0] * cols
    x_rows = jnp.concatenate([_level_halves(x, chunk)[1] * rows for x in xs], axis=1)
    products = jnp.einsum("ltk,lik->lti", x_rows, k_cols).reshape(-1, len(xs), (chunk // 2) ** 2)
    at, strict = level_map(chunk)
    scores = []
    for i, x in enumerate(xs):
        lower = jnp.where(strict, products[:, i].reshape(-1)[at], 0)
        scores.append(lower + jnp.diag((x * k).sum(-1)))
    return tuple(scores), decays


def all_levels_bwd(xs, k, log_alpha, d_scores, d_decays):
    """The pullback of ``all_levels(xs, k, log_alpha)`` as ``channel_scores_bwd``'s, its
    products batched over the levels and scores as the forward's, one a side: ``(d_xs,
    d_k, d_log_alpha, decays)``."""
    chunk = k.shape[0]
    half_c = chunk // 2
    levels, decays = level_sums(log_alpha)
    rows, cols = _levels_stacked(levels, chunk)
    k_first = _level_halves(k, chunk)[0]
    k_cols = k_first * cols
    x_seconds = [_level_halves(x, chunk)[1] for x in xs]
    inverse, used = level_map_bwd(chunk)
    d_products = jnp.concatenate(
        [jnp.where(used, d.reshape(-1)[inverse], 0) for d in d_scores], axis=1
    )  # [L, n C/2, C/2]
    x_rows = jnp.concatenate([x * rows for x in x_seconds], axis=1)
    d_x_rows = jnp.einsum("lti,lik->ltk", d_products, k_cols)
    d_k_cols = jnp.einsum("lti,ltk->lik", d_products, x_rows)  # summed over xs
    d_x_rows = [d_x_rows[:, i * half_c : (i + 1) * half_c] for i in range(len(xs))]
    d_rows = sum(d * x for d, x in zip(d_x_rows, x_seconds, strict=True))
    d_xs = tuple(
        jnp.diagonal(d)[:, None] * k + _placed(d_x * rows, chunk, second=True)
        for d, d_x in zip(d_scores, d_x_rows, strict=True)
    )
    d_k = sum(jnp.diagonal(d)[:, None] * x for d, x in zip(d_scores, xs, strict=True))
    d_k = d_k + _placed(d_k_cols * cols, chunk, second=False)
    d_p_levels = _placed(d_rows * rows, chunk, second=True, summed=False)
    d_s_levels = _placed(d_k_cols * k_cols, chunk, second=False, summed=False)
    d_from_start, d_to_end, d_whole = d_decays
    d_p = (d_from_start * decays.from_start).at[-1].add(d_whole * decays.whole)
    d_sums = (d_p, d_to_end * decays.to_end)
    for j, half in reversed(list(enumerate(halving_sizes(chunk)))):
        d_sums = coarser_bwd(d_sums, half)
        d_sums = (d_sums[0] + d_p_levels[j], d_sums[1] + d_s_levels[j])
    return d_xs, d_k, d_sums[0], decays


def _placed(x: Float[Array, "L rows K"], chunk: int, *, second: bool, summed: bool = True):
    """Each level's rows of ``x`` (``_level_halves``' order) in place among zeros, ``[C,
    K]`` a level: summed over the levels, or a list of them."""
    place = _second_halves if second else _first_halves
    levels = [
        place(x[j].reshape(-1, half, x.shape[-1])) for j, half in enumerate(halving_sizes(chunk))
    ]
    return sum(levels) if summed else levels


def scores(xs, k, log_alpha, halving=False):
    """``channel_scores`` for the platform compiled for: ``all_levels`` on a GPU, where each
    of the halving's kernels is a launch of its own, else (and with ``halving``) the halving
    (faster on XLA:CPU, less temp on a TPU: docs/benchmarks.md)."""
    if halving:
        return channel_scores(xs, k, log_alpha)
    return jax.lax.platform_dependent(
        xs, k, log_alpha, cuda=all_levels, rocm=all_levels, default=channel_scores
    )


def halving_bwd(xs, k, log_alpha, d_scores, d_decays):
    """``channel_scores_bwd`` from the gates, as ``all_levels_bwd`` takes them: ``(d_xs, d_k,
    d_log_alpha, decays)``."""
    levels, decays = level_sums(log_alpha)
    return (*channel_scores_bwd(xs, k, levels, decays, d_scores, d_decays), decays)


def scores_bwd(xs, k, log_alpha, d_scores, d_decays, halving=False):
    """The pullback of ``scores(xs, k, log_alpha, halving)``: ``(d_xs, d_k, d_log_alpha,
    decays)``."""
    if halving:
        return halving_bwd(xs, k, log_alpha, d_scores, d_decays)
    return jax.lax.platform_dependent(
        xs, k, log_alpha, d_scores, d_decays,
        cuda=all_levels_bwd, rocm=all_levels_bwd, default=halving_bwd,
    )  # fmt: skip


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
