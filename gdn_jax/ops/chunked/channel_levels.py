"""Every halving level of a chunk's channel-decayed scores at once: the form a GPU runs
(``channel_decays.py`` derives the halving; this is the same arithmetic in fewer kernels).

On a GPU every kernel of the halving is a launch of its own, a few a level, and each launch
costs more than these small products. Here each side of a level's block is stacked over the
levels, ``[L, C/2, K]`` (``L = log2(C)``): the second halves' rows decayed from the
boundary, the first halves' columns decayed to it (``channel_decays.level_factors``). One
batched product ``[L, C/2, C/2]`` a score makes every level's lower-left block, and a static
gather (``level_map``) puts them in place; the pullback is the same two products and the
gather's inverse.

Every sum of gates is still a sum over its own segment of tokens, never a difference of
running sums (``chunked/decays.py`` says why), but they all come from products with one
constant matrix of zeros and ones, ``SUMS [(L + 2) C, C]``: a row per level and token of
the segment its factor decays over (the rows' from the half's start through the token, the
columns' from after the token through the half's end), then the decays from the chunk's
start and to its end. Each sum adds gates of one sign, exactly in float32 (``summed`` says
how, on a GPU's tensor cores), and its pullback is the product with ``SUMS^T``. The levels'
halves are gathers of the tokens, and their cotangents go back to the tokens by the inverse
gathers: no level is a kernel of its own.

The stacked factors are ``L/2`` times the keys: the ``associative`` schedule's forward makes
them for every chunk at once, its backward a group of chunks at a time
(``chunked/channel_backward.py``). The halving is kept where a compiler runs each small
kernel cheaply (XLA:CPU) or memory binds (the ``hoisted`` schedule).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from gdn_jax.ops.chunked.blocks import barrier_off_cpu
from gdn_jax.ops.chunked.channel_decays import (
    ChannelDecays,
    channel_scores,
    channel_scores_bwd,
    halving_sizes,
    level_sums,
)

EXACT_F32 = jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6


class Tables(NamedTuple):
    """The constants of a chunk of ``C`` tokens, ``L = log2(C)`` levels (``tables``)."""

    sums: np.ndarray  # [(L + 2) C, C]: the segments of the levels' sums, then of the decays
    first: np.ndarray  # [L, C/2]: the token of each level's first-half row
    second: np.ndarray  # [L, C/2]: the token of each level's second-half row
    place: np.ndarray  # [L, C]: where each token sits among its level's halves' rows
    in_second: np.ndarray  # [L, C]: whether it is in a second half
    at: np.ndarray  # [C, C]: level_map
    strict: np.ndarray  # [C, C]
    inverse: np.ndarray  # [L, C/2, C/2]: level_map_bwd
    used: np.ndarray  # [L, C/2, C/2]


def level_map(chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """Where each score of a chunk sits among the levels' products: ``(at [C, C], strict
    [C, C])``. Score ``(t, i)``, ``i < t``, belongs to the level whose blocks first hold
    both tokens, the highest bit in which ``t`` and ``i`` differ (half ``h``), and in that
    level's ``[C/2, C/2]`` product of second-half rows and first-half columns, both in token
    order, it is row ``t // 2h * h + t % h``, column ``i // 2h * h + i % h``; ``at`` is its
    index in the levels' products flattened (0 where ``i >= t``)."""
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


@functools.cache
def tables(chunk: int) -> Tables:
    """The constants for chunks of ``chunk`` tokens (a power of two)."""
    halves = halving_sizes(chunk)
    j, t = np.arange(chunk // 2), np.arange(chunk)
    first = np.stack([j // h * 2 * h + j % h for h in halves])
    second = first + np.asarray(halves)[:, None]
    levels = len(halves)
    rows = np.zeros((levels, chunk // 2, chunk), np.float32)
    cols = np.zeros_like(rows)
    for level, h in enumerate(halves):
        for row in range(chunk // 2):
            start = second[level, row] - row % h  # the second half's first token
            rows[level, row, start : second[level, row] + 1] = 1
            cols[level, row, first[level, row] + 1 : start] = 1
    from_start = (t[None, :] <= t[:, None]).astype(np.float32)
    to_end = (t[None, :] > t[:, None]).astype(np.float32)
    sums = np.concatenate([rows.reshape(-1, chunk), cols.reshape(-1, chunk), from_start, to_end])
    place = np.stack([t // (2 * h) * h + t % h for h in halves])
    in_second = np.stack([(t // h) % 2 == 1 for h in halves])
    return Tables(sums, first, second, place, in_second, *level_map(chunk), *level_map_bwd(chunk))


def summed(ones: np.ndarray, x: Float[Array, "C K"]) -> Float[Array, "M K"]:
    """``ones @ x`` for a constant matrix of zeros and ones: each row the sum of the rows of
    ``x`` it picks, exact in ``x``'s dtype. In float32 by ``BF16_BF16_F32_X6``: ``x`` split
    into three bfloat16 parts that hold its 24 bits, each multiplied by the ones (whose own
    second and third parts are zero) on a GPU's tensor cores and summed in float32. That is
    the float32 product to within its rounding, where ``HIGHEST`` multiplies in float32 on
    the CUDA cores at a fraction of the rate, and a TF32 or bfloat16 product would round the
    gates (``tests/ops/test_kda.py`` holds the sums to float32's; XLA:CPU multiplies in
    float32 either way)."""
    if x.dtype == jnp.float32:
        return jnp.dot(ones.astype(x.dtype), x, precision=EXACT_F32)
    return jnp.dot(ones.astype(x.dtype), x, precision=jax.lax.Precision.HIGHEST)


def level_factors_at_once(log_alpha: Float[Array, "C K"], *, apart: bool = False):
    """Every level's factors, ``(rows, cols)`` of ``channel_decays.level_factors`` stacked
    ``[L, C/2, K]``, from one product with ``SUMS``'s levels' rows, or with ``apart`` one a
    side, so that the rows' sums need not be kept while the columns' are made."""
    chunk, key_dim = log_alpha.shape
    levels = tables(chunk).sums[: -2 * chunk]
    if apart:
        rows, cols = (summed(x, log_alpha) for x in np.split(levels, 2))
        return (jnp.exp(x).reshape(-1, chunk // 2, key_dim) for x in (rows, cols))
    made = jnp.exp(summed(levels, log_alpha))
    return tuple(made.reshape(2, -1, chunk // 2, key_dim))


def decays_at_once(log_alpha: Float[Array, "C K"]) -> ChannelDecays:
    """The chunk's decays alone, from the last ``2 C`` rows of ``SUMS``."""
    chunk = log_alpha.shape[0]
    made = jnp.exp(summed(tables(chunk).sums[-2 * chunk :], log_alpha))
    from_start, to_end = jnp.split(made, 2)
    return ChannelDecays(from_start, to_end, from_start[-1])


def _products(xs, k, log_alpha, *, apart: bool = False):
    """What both directions start from: the levels' factors (``level_factors_at_once``),
    each ``x``'s second halves and ``k``'s first halves, the rows of every ``x`` decayed
    and stacked ``[L, n C/2, K]`` and ``k``'s columns decayed ``[L, C/2, K]``."""
    t = tables(k.shape[0])
    rows, cols = level_factors_at_once(log_alpha, apart=apart)
    x_seconds = [x[t.second] for x in xs]
    x_rows = jnp.concatenate([x * rows for x in x_seconds], axis=1)
    return rows, cols, x_seconds, x_rows, k[t.first] * cols


def all_levels(xs, k, log_alpha):
    """``channel_decays.channel_scores(xs, k, log_alpha)`` with every level's products made
    at once: one batched product ``[L, n C/2, K] x [L, C/2, K]`` for the ``n`` row factors
    of ``xs``, whose diagonal blocks of each level are the scores (``level_map``). It
    multiplies ``L C^2 K / 4`` a score where the halving does ``log2(C) C^2 K / 4`` over
    ``log2(C)`` products, each with its own factors: the same decays and sums of gates, in a
    few kernels rather than a few a level (docs/benchmarks.md)."""
    t = tables(k.shape[0])
    *_, x_rows, k_cols = _products(xs, k, log_alpha, apart=True)
    products = jnp.einsum("ltk,lik->lti", x_rows, k_cols).reshape(len(t.first), len(xs), -1)
    scores = []
    for i, x in enumerate(xs):
        lower = jnp.where(t.strict, products[:, i].reshape(-1)[t.at], 0)
        scores.append(lower + jnp.diag((x * k).sum(-1)))
    return tuple(scores), decays_at_once(log_alpha)


def _to_tokens(x: Float[Array, "L h K"], in_second: np.ndarray, t: Tables) -> Float[Array, "C K"]:
    """The rows of ``x``, one a level's second-half (``in_second``) or first-half token,
    summed onto their tokens: the inverse of the gathers ``x[t.second]``, ``x[t.first]``."""
    levels = np.arange(len(t.place))[:, None]
    return jnp.where(in_second[..., None], x[levels, t.place], 0).sum(0)


def levels_bwd(xs, k, log_alpha, d_scores):
    """The pullback of ``all_levels(xs, k, log_alpha)``'s scores alone, for cotangents
    ``d_scores`` (one ``[C, C]`` per score; what lies above the diagonal is ignored): ``(d_xs,
    d_k, d_log_alpha)``, its products batched over the levels and scores as the forward's,
    one a side, and the levels' sums' cotangents back to the gates by one product with
    ``SUMS^T``."""
    chunk, key_dim = k.shape
    t = tables(chunk)
    _, _, x_seconds, x_rows, k_cols = _products(xs, k, log_alpha)
    d_products = jnp.concatenate(
        [jnp.where(t.used, d.reshape(-1)[t.inverse], 0) for d in d_scores], axis=1
    )  # [L, n C/2, C/2]
    d_x_rows = jnp.einsum("lti,lik->ltk", d_products, k_cols)
    d_k_cols = jnp.einsum("lti,ltk->lik", d_products, x_rows)  # summed over xs
    # Off CPU the barrier has XLA make the factors again for what follows, rather than
    # hold them through both products beside the stacked rows and their cotangent.
    (d_x_rows, d_k_cols), log_alpha = barrier_off_cpu((d_x_rows, d_k_cols), log_alpha)
    rows, cols = level_factors_at_once(log_alpha)
    k_cols = k[t.first] * cols
    d_x_rows = jnp.split(d_x_rows, len(xs), axis=1)
    d_rows = sum(d * x for d, x in zip(d_x_rows, x_seconds, strict=True))
    d_xs = tuple(
        jnp.diagonal(d)[:, None] * k + _to_tokens(d_x * rows, t.in_second, t)
        for d, d_x in zip(d_scores, d_x_rows, strict=True)
    )
    d_k = sum(jnp.diagonal(d)[:, None] * x for d, x in zip(d_scores, xs, strict=True))
    d_k = d_k + _to_tokens(d_k_cols * cols, ~t.in_second, t)
    d_sums = jnp.concatenate(
        [(d_rows * rows).reshape(-1, key_dim), (d_k_cols * k_cols).reshape(-1, key_dim)]
    )
    d_log_alpha = summed(t.sums[: -2 * chunk].T, d_sums)
    return d_xs, d_k, d_log_alpha


def decays_bwd(decays: ChannelDecays, d_decays) -> Float[Array, "C K"]:
    """The gates' cotangent from those of the chunk's decays, ``d_decays = (d from_start,
    d to_end, d whole)``: each decay's cotangent times itself reaches the gates of its
    segment, by one product with the decays' rows of ``SUMS^T`` (each gate's sum holds the
    terms of the segments it is in and nothing else, as ``decays.chunk_decays_bwd``'s)."""
    chunk = decays.from_start.shape[0]
    d_from_start, d_to_end, d_whole = d_decays
    d_p = (d_from_start * decays.from_start).at[-1].add(d_whole * decays.whole)
    d_sums = jnp.concatenate([d_p, d_to_end * decays.to_end])
    return summed(tables(chunk).sums[-2 * chunk :].T, d_sums)


def all_levels_bwd(xs, k, log_alpha, d_scores, d_decays):
    """The pullback of ``all_levels(xs, k, log_alpha)`` for cotangents ``d_scores`` and
    ``d_decays`` (of the decays from the start, to the end, over the chunk): ``(d_xs, d_k,
    d_log_alpha, decays)``, ``levels_bwd``'s and ``decays_bwd``'s."""
    d_xs, d_k, d_log_alpha = levels_bwd(xs, k, log_alpha, d_scores)
    decays = decays_at_once(log_alpha)
    return d_xs, d_k, d_log_alpha + decays_bwd(decays, d_decays), decays


def scores(xs, k, log_alpha, halving=False):
    """``channel_decays.channel_scores`` for the platform compiled for: ``all_levels`` on a
    GPU, where each of the halving's kernels is a launch of its own, else (and with
    ``halving``) the halving (faster on XLA:CPU, less temp on a TPU: docs/benchmarks.md)."""
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


def halving_levels_bwd(xs, k, log_alpha, d_scores):
    """``channel_scores_bwd`` of the scores alone (the decays' cotangents zero), as
    ``levels_bwd`` takes them: ``(d_xs, d_k, d_log_alpha)``."""
    levels, decays = level_sums(log_alpha)
    zero = jnp.zeros_like(k)
    return channel_scores_bwd(xs, k, levels, decays, d_scores, (zero, zero, zero[0]))


def scores_levels_bwd(xs, k, log_alpha, d_scores):
    """The pullback of ``scores(xs, k, log_alpha)``'s scores alone, for the platform
    compiled for: ``(d_xs, d_k, d_log_alpha)``; the decays' share is ``decays_bwd``."""
    return jax.lax.platform_dependent(
        xs, k, log_alpha, d_scores,
        cuda=levels_bwd, rocm=levels_bwd, default=halving_levels_bwd,
    )  # fmt: skip


def scores_bwd(xs, k, log_alpha, d_scores, d_decays, halving=False):
    """The pullback of ``scores(xs, k, log_alpha, halving)``: ``(d_xs, d_k, d_log_alpha,
    decays)``."""
    if halving:
        return halving_bwd(xs, k, log_alpha, d_scores, d_decays)
    return jax.lax.platform_dependent(
        xs, k, log_alpha, d_scores, d_decays,
        cuda=all_levels_bwd, rocm=all_levels_bwd, default=halving_bwd,
    )  # fmt: skip


def chunk_decays(log_alpha: Float[Array, "C K"]) -> ChannelDecays:
    """The chunk's decays alone for the platform compiled for: ``decays_at_once`` on a GPU,
    the halving's chain of sums elsewhere."""
    return jax.lax.platform_dependent(
        log_alpha,
        cuda=decays_at_once,
        rocm=decays_at_once,
        default=lambda g: level_sums(g)[1],
    )
